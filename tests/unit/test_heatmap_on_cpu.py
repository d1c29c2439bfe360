"""python -m verl_oar.tools.heatmap in-process on a tiny randomly initialised Qwen2 (the CPU workspace's byte
tokenizer): files written, the JSON's scores equal the importance functions called directly on the
same ids (so the wiring of positions and masks is right), rollouts files in verl's formats, bad
input, and the renderer on awkward tokens."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from verl_oar.core.answer_span import locate_answer_tokens
from verl_oar.tools.heatmap import main
from verl_oar.tools.heatmap_render import html_block, render_png
from verl_oar.core.gradient import GradientConfig, gradient_importance
from verl_oar.core.hf import HFRowsModel, make_hf_logits_fn
from verl_oar.core.perturbation import PerturbationConfig, Sample, batched_perturbation_importance, occlusion_spans
from verl_oar.testbed.pick_max import oracle_token_masks

PROMPT = "max: 3 7 | 2 5"
RESPONSE = "qzt kdm 7 abx fod 5 kle pqa \\boxed{75}"
REASONING_TEXT = "qzt kdm 7 abx fod 5 kle pqa "
"""one token per character with the byte tokenizer: the reasoning tokens, up to the marker"""
SEED = 3
ORACLE = "verl_oar.testbed.pick_max:heatmap_oracle"
"""the testbed's oracle, passed in by name (the heatmap never imports the testbed)"""


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny randomly initialised Qwen2 (hidden 32, 2 layers) with the CPU workspace's tokenizer,
    saved as a Hugging Face model directory; scores are meaningless but exercise every path."""
    from _tiny_models import byte_qwen2

    from verl_oar.cpu.workspace import save_model_dir

    directory = tmp_path_factory.mktemp("heatmap_model") / "model"
    save_model_dir(*byte_qwen2(seed=0), directory)
    return directory


@pytest.fixture(scope="module")
def loaded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompt_run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("heatmap_out")
    report = main(["--model", str(model_dir), "--prompt", PROMPT, "--response", RESPONSE, "--oracle", ORACLE,
                   "--seed", str(SEED), "--device", "cpu", "--out", str(out)])
    return report, out


def templated_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------------
# --prompt / --response
# ---------------------------------------------------------------------------------------------------


def test_files_written(prompt_run):
    report, out = prompt_run
    assert report["files"]["png"] == [str(out / "heatmap_0.png")]
    assert (out / "heatmap_0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "heatmap.json").read_text()) == json.loads(json.dumps(report))
    page = (out / "heatmap.html").read_text()
    assert "oar_g" in page and "oar_p" in page and "oracle causal" in page


def test_ids_and_masks(prompt_run, loaded):
    _, tokenizer = loaded
    row = prompt_run[0]["rows"][0]
    assert row["prompt_ids"] == templated_ids(tokenizer, PROMPT) and row["chat_template"]
    assert row["response_ids"] == tokenizer.encode(RESPONSE, add_special_tokens=False)
    assert "".join(row["tokens"]) == RESPONSE
    assert sum(row["reasoning"]) == len(REASONING_TEXT) == row["reasoning"].index(False)
    assert row["answer_text"] == "75"
    assert (row["reasoning"], row["answer"]) == tuple(locate_answer_tokens(row["response_ids"], tokenizer))


def test_scores_equal_direct_calls(prompt_run, loaded):
    """OAR-G and OAR-P of the JSON are the package's functions on prompt + response ids, read back
    at the response positions; zero off the reasoning tokens."""
    model, tokenizer = loaded
    row = prompt_run[0]["rows"][0]
    p = len(row["prompt_ids"])
    ids = torch.tensor(row["prompt_ids"] + row["response_ids"])
    reasoning = torch.tensor([False] * p + row["reasoning"])
    answer = torch.tensor([False] * p + row["answer"])
    predict = torch.zeros_like(answer)
    predict[:-1] = answer[1:]

    embeds = model.get_input_embeddings()(ids[None]).detach()
    oar_g = gradient_importance(
        make_hf_logits_fn(model, attention_mask=torch.ones_like(ids[None])), embeds, reasoning[None], predict[None],
        torch.roll(ids, -1)[None], torch.zeros_like(ids[None]), 1, GradientConfig(),
        generator=torch.Generator().manual_seed(SEED),
    )[0, p:]
    span = occlusion_spans(reasoning, "chunk", 16)  # the tool's default without --config: training's, chunk K=16
    assert int(span.max()) + 1 == 16 < int(reasoning.sum())  # chunks of several tokens, not exact mode
    sample = Sample(ids, torch.arange(len(ids)), span, predict, prompt_len=int(reasoning.nonzero()[0]))
    (oar_p,), _, _ = batched_perturbation_importance(HFRowsModel(model, pad_id=tokenizer.pad_token_id), [sample],
                                                     tokenizer.pad_token_id, PerturbationConfig(mode="chunk"),
                                                     max_tokens=8192)
    for name, expected in (("oar_g", oar_g), ("oar_p", oar_p[p:])):
        got = torch.tensor(row["scores"][name])
        assert torch.equal(got, expected.float()), name  # the same computation: bit for bit
        mask = torch.tensor(row["reasoning"])
        assert (got[~mask] == 0).all() and (got[mask] > 0).any(), name
    config = prompt_run[0]["config"]
    assert config["neutral_id"] == tokenizer.pad_token_id and config["seed"] == SEED


def test_weights_and_oracle(prompt_run, loaded):
    _, tokenizer = loaded
    row = prompt_run[0]["rows"][0]
    mask = torch.tensor(row["reasoning"])
    for name in ("oar_g", "oar_p"):
        weights = torch.tensor(row["weights"][name])
        assert row["fallback"][name] == "NONE"
        assert (weights[~mask] == 1).all() and (weights[mask] > 0).all()
        assert weights[mask].sum().item() == pytest.approx(mask.sum().item(), rel=1e-5)  # mass preserved
        assert weights[mask].min() < 1 < weights[mask].max()                             # suppress and boost
    oracle = oracle_token_masks(row["response_ids"], tokenizer)
    assert row["oracle"] == {"causal": oracle.causal.tolist()}
    causal = [t for t, d in zip(row["tokens"], row["oracle"]["causal"]) if d]
    assert causal == ["7", "5"]


def test_oracle_is_a_callback(model_dir, tmp_path):
    """Any oracle(response_ids, tokenizer) is drawn and stored under its own names; None is a note."""
    seen = []

    def first_token(response_ids, tokenizer):
        seen.append(list(response_ids))
        return {"first": [i == 0 for i in range(len(response_ids))]} if len(seen) == 1 else None

    args = ["--model", str(model_dir), "--estimators", "oar_g", "--device", "cpu", "--out", str(tmp_path)]
    row = main([*args, "--prompt", PROMPT, "--response", RESPONSE], oracle=first_token)["rows"][0]
    assert seen == [row["response_ids"]]
    assert row["oracle"] == {"first": [True] + [False] * (len(row["response_ids"]) - 1)}
    row = main([*args, "--prompt", PROMPT, "--response", RESPONSE], oracle=first_token)["rows"][0]
    assert row["oracle"] is None and "oracle: none for this response" in row["notes"]


# ---------------------------------------------------------------------------------------------------
# --rollouts
# ---------------------------------------------------------------------------------------------------


def test_rollouts_parquet_chat_prompt(model_dir, loaded, tmp_path, capsys):
    """verl's RL parquet: the prompt is a message list; a row with no answer is reported and skipped."""
    _, tokenizer = loaded
    prompts = ["max: 3 7 | 2 5", "max: 1 2", "max: 4 3"]
    responses = [RESPONSE, "abc 1 def no box", "xyz 4 uvw \\boxed{4}"]
    path = tmp_path / "rollouts.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": p}] for p in prompts], "response": responses,
                  "data_source": "verl_oar/pick_max"}).to_parquet(path, index=False)
    report = main(["--model", str(model_dir), "--rollouts", str(path), "--rows", "2,1", "--estimators", "oar_g",
                   "--device", "cpu", "--out", str(tmp_path / "out")])
    assert [r["row"] for r in report["rows"]] == [2]
    assert report["rows"][0]["prompt_ids"] == templated_ids(tokenizer, prompts[2])
    assert list(report["rows"][0]["scores"]) == ["oar_g"]
    assert [s["row"] for s in report["skipped"]] == [1]
    assert "row 1 skipped: no final answer" in capsys.readouterr().err
    assert (tmp_path / "out" / "heatmap_2.png").exists() and not (tmp_path / "out" / "heatmap_1.png").exists()


def test_rollouts_jsonl_verl_dump(model_dir, loaded, tmp_path):
    """verl's rollout dump (input / output): the input is already templated, so it is tokenised raw."""
    _, tokenizer = loaded
    dump = [{"input": f"user\nsum: {a} {b}\nassistant\n", "output": f"{a} ok +{b}={a + b} \\boxed{{{a + b}}}",
             "score": 1.0, "step": 1} for a, b in ((3, 4), (2, 5))]
    path = tmp_path / "1.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in dump) + "\n")
    report = main(["--model", str(model_dir), "--rollouts", str(path), "--rows", "1", "--estimators", "oar_p",
                   "--oar-p-mode", "chunk", "--oar-p-budget", "4", "--neutral", "space", "--device", "cpu",
                   "--out", str(tmp_path / "out")])
    (row,) = report["rows"]
    assert row["row"] == 1 and not row["chat_template"]
    assert row["prompt_ids"] == tokenizer.encode(dump[1]["input"], add_special_tokens=True)
    assert report["config"]["neutral_id"] == tokenizer.encode(" ", add_special_tokens=False)[0]
    reasoning = torch.tensor(row["reasoning"])
    assert len(set(torch.tensor(row["scores"]["oar_p"])[reasoning].tolist())) <= 4  # 4 chunks share scores


# ---------------------------------------------------------------------------------------------------
# CSCR and OPPO: re-scored under rewritten prompts, against a per-token plain reference
# ---------------------------------------------------------------------------------------------------


def per_token_log_probs(model, prompt_ids: list[int], response_ids: list[int], temperature: float) -> list[float]:
    """One forward per response token (no batching, no gather over a sequence): the plain reference."""
    out = []
    for t, token in enumerate(response_ids):
        ids = torch.tensor([prompt_ids + response_ids[:t]])
        with torch.no_grad():
            logits = model(ids).logits[0, -1].double() / temperature
        out.append(float(torch.log_softmax(logits, -1)[token]))
    return out


def rendered(tokenizer, text: str) -> list[int]:
    return templated_ids(tokenizer, text)


@pytest.fixture(scope="module")
def privileged_run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("heatmap_privileged")
    return main(["--model", str(model_dir), "--prompt", PROMPT, "--response", RESPONSE, "--estimators", "cscr,oppo",
                 "--ground-truth", "75", "--reward", "0", "--temperature", "0.7", "--device", "cpu", "--out", str(out)])


def test_cscr_sensitivity_and_weights_equal_a_per_token_reference(privileged_run, loaded):
    from verl_oar.core.privileged_prompt import CSCR_NEGATIVE, CSCR_POSITIVE

    model, tokenizer = loaded
    row = privileged_run["rows"][0]
    response = row["response_ids"]
    base = per_token_log_probs(model, rendered(tokenizer, PROMPT), response, 0.7)
    pos = per_token_log_probs(model, rendered(tokenizer, CSCR_POSITIVE.replace("{question}", PROMPT)), response, 0.7)
    neg = per_token_log_probs(model, rendered(tokenizer, CSCR_NEGATIVE.replace("{question}", PROMPT)), response, 0.7)
    sens = [max(abs(p - b), abs(n - b)) for p, n, b in zip(pos, neg, base)]
    assert row["signed_scores"]["cscr"] == pytest.approx(sens, abs=1e-5)
    tau = float(torch.quantile(torch.tensor(sens, dtype=torch.float64), 0.8))  # the defaults: quantile 0.8, alpha 1, floor 0.3
    raw = [max(0.3, math.exp(-(s - tau))) if s > tau else 1.0 for s in sens]
    weights = [w * len(raw) / sum(raw) for w in raw]
    assert row["weights"]["cscr"] == pytest.approx(weights, abs=1e-5)
    assert sum(row["weights"]["cscr"]) == pytest.approx(len(response), abs=1e-4)   # the credit budget


def test_oppo_evidence_and_weights_equal_a_per_token_reference(privileged_run, loaded):
    model, tokenizer = loaded
    row = privileged_run["rows"][0]
    response = row["response_ids"]
    base = per_token_log_probs(model, rendered(tokenizer, PROMPT), response, 0.7)
    oracle = per_token_log_probs(model, rendered(tokenizer, f"{PROMPT}\n\nThe correct final answer is: 75."), response, 0.7)
    evidence = [o - b for o, b in zip(oracle, base)]
    assert row["signed_scores"]["oppo"] == pytest.approx(evidence, abs=1e-5)
    # reward 0 from the prior 1/2: the exact form, evidence clipped at 2, every credit anchored to <= 0
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    logit, advantages = 0.0, []
    for e in evidence:
        e = min(2.0, max(-2.0, e))
        advantages.append(min(0.0, sigmoid(logit + e) - sigmoid(logit)))
        logit += e
    weights = [a * len(evidence) / (0.0 - 0.5) for a in advantages]
    assert row["weights"]["oppo"] == pytest.approx(weights, abs=1e-5)
    assert min(row["weights"]["oppo"]) >= 0 and privileged_run["config"]["reward"] == 0.0


def oppo_reference_weights(evidence: list[float], reward: float, cfg) -> list[float]:
    """Plain per-token OPPO for one response from the prior 1/2, no group scale or zeroing, as w~."""
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    logit, advantages = 0.0, []
    for e in evidence:
        e = min(cfg.clip, max(-cfg.clip, e)) if cfg.clip > 0 else e
        state = logit if cfg.state_weight == "tracked" else 0.0
        v = sigmoid(state)
        advantages.append(sigmoid(state + e) - v if cfg.form == "exact" else v * (1 - v) * e)
        logit += e
    if cfg.terminal == "last_token":
        advantages[-1] += (reward - 0.5) - sum(advantages)
    d = 1.0 if reward > 0.5 else -1.0
    if cfg.anchor == "clamp":
        advantages = [d * max(0.0, d * a) for a in advantages]
    elif cfg.anchor == "abs":
        advantages = [d * abs(a) for a in advantages]
    return [a * len(evidence) / (reward - 0.5) for a in advantages]


def test_oppo_weights_for_every_valid_config(loaded):
    """Every valid OPPO config draws (``scale=group_std`` used to raise: the heatmap turned off the zeroing of
    uniform groups, which group_std requires); the group keys are set for a group of one (scale none, no
    zeroing), the others used as given, each against a per-token reference on the same evidence."""
    import itertools
    from dataclasses import replace

    from verl_oar.core.oppo import CHOICES, OPPOConfig
    from verl_oar.tools.heatmap import make_sample
    from verl_oar.tools.heatmap.privileged import oppo_signal

    model, tokenizer = loaded
    sample = make_sample(0, PROMPT, RESPONSE, tokenizer, True)
    keys = ("form", "state_weight", "terminal", "anchor", "scale")
    evidence, checked = None, 0
    for values in itertools.product(*(CHOICES[k] for k in keys), (True, False)):
        *choice, zero = values
        if choice[-1] == "group_std" and not zero:
            continue  # refused by OPPOConfig itself
        cfg = OPPOConfig(clip=0.005, zero_uniform_groups=zero, **dict(zip(keys, choice)))
        got_evidence, weights = oppo_signal(model, tokenizer, sample, "75", 1.0, 0.7, cfg)
        evidence = got_evidence.tolist() if evidence is None else evidence
        assert got_evidence.tolist() == evidence, cfg  # the config changes the credit, not the evidence
        assert weights.tolist() == pytest.approx(oppo_reference_weights(evidence, 1.0, cfg), abs=1e-5), cfg
        if cfg.terminal == "last_token" and cfg.anchor == "none":
            assert float(weights.sum()) == pytest.approx(len(evidence), rel=1e-5)  # sum A = R - V_0
        checked += 1
    # the tiny random model's evidence is ~0.005 nats: clip 0.005 clips some tokens and not others
    assert checked == 72 and any(abs(e) > 0.005 for e in evidence) and any(abs(e) < 0.005 for e in evidence)
    with pytest.raises(ValueError, match="group_std"):  # the refusal itself stands for training configs
        replace(OPPOConfig(), scale="group_std", zero_uniform_groups=False)


def test_ground_truth_from_verls_reward_model_column(model_dir, tmp_path):
    path = tmp_path / "rollouts.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": PROMPT}]], "response": [RESPONSE],
                  "reward_model": [{"style": "rule", "ground_truth": "75"}]}).to_parquet(path, index=False)
    report = main(["--model", str(model_dir), "--rollouts", str(path), "--estimators", "oppo", "--device", "cpu",
                   "--out", str(tmp_path / "out")])
    single = main(["--model", str(model_dir), "--prompt", PROMPT, "--response", RESPONSE, "--estimators", "oppo",
                   "--ground-truth", "75", "--device", "cpu", "--out", str(tmp_path / "out2")])
    assert report["rows"][0]["signed_scores"]["oppo"] == pytest.approx(single["rows"][0]["signed_scores"]["oppo"], abs=1e-6)
    assert "w~ oppo" in (tmp_path / "out" / "heatmap.html").read_text()


# ---------------------------------------------------------------------------------------------------
# bad input: a message naming the problem, no stack trace
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def rollouts_jsonl(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"question": "sum: 1 2", "answer_text": "1 +2=3 \\boxed{3}"}) + "\n")
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rollouts", "/nonexistent/r.jsonl"], "no such file"),
        (["--rollouts", "{file}"], "available keys: answer_text, question"),
        (["--rollouts", "{file}", "--prompt-key", "question", "--response-key", "answer_text", "--rows", "0,5"],
         r"--rows 5: out of range, .* has 1 rows \(0..0\)"),
        (["--prompt", PROMPT, "--response", "3 ok +7=10 so the sum is 10"], "no final answer found"),
        (["--prompt", PROMPT, "--response", RESPONSE, "--estimators", "oar_x"], "choose from oar_g, oar_p"),
        (["--prompt", PROMPT, "--response", RESPONSE, "--answer-locator", "pkg://no_such_module_xyz.f"],
         "no_such_module_xyz"),
        (["--prompt", PROMPT, "--response", RESPONSE, "--oracle", "pick_max"], "give MODULE:FUNCTION"),
        (["--prompt", PROMPT, "--response", RESPONSE, "--oracle", "no_such_module_xyz:f"], "cannot load it"),
        (["--prompt", PROMPT, "--response", RESPONSE, "--estimators", "oppo"], "needs the reference answer"),
        (["--prompt", PROMPT, "--response", RESPONSE, "--estimators", "oppo", "--ground-truth", "7", "--reward", "2"],
         r"--reward 2.0: .* in \[0, 1\]"),
        (["--rollouts", "{dump}", "--estimators", "cscr"], "holds the prompt after the chat template"),
        (["--rollouts", "{file}", "--prompt-key", "question", "--response-key", "answer_text", "--estimators", "oppo"],
         "no column 'ground_truth' / 'reward_model' / 'gts'"),
    ],
)
def test_bad_input(model_dir, rollouts_jsonl, capsys, args, message):
    dump = rollouts_jsonl.parent / "dump.jsonl"
    dump.write_text(json.dumps({"input": "user\nsum: 1 2\nassistant\n", "output": "1 +2=3 \\boxed{3}"}) + "\n")
    args = [a.replace("{file}", str(rollouts_jsonl)).replace("{dump}", str(dump)) for a in args]
    with pytest.raises(SystemExit, match=message) as info:
        main(["--model", str(model_dir), "--device", "cpu", "--out", str(rollouts_jsonl.parent / "out"), *args])
    assert str(info.value.code).startswith("verl_oar.tools.heatmap: ")
    assert "Traceback" not in capsys.readouterr().err


def test_help_shows_the_common_case_first():
    """--help: the usage lines are the common calls, the first group holds the few flags they need, and every
    other flag sits in a group titled "advanced: ..." (each has a default: --config's, else training's)."""
    from verl_oar.tools.heatmap.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    assert text.startswith("usage: python -m verl_oar.tools.heatmap --dump DIR/step_N.pt --config RUN_CONFIG")
    groups = [g for g in parser._action_groups  # argparse's own: positional (empty here) and -h
              if g._group_actions and g.title not in ("options", "optional arguments")]
    common, *advanced = groups
    assert common.title == "the common case" and text.index("the common case:") < text.index("advanced:")
    assert {a.dest for a in common._group_actions} == {"dump", "model", "config", "rollouts", "rows", "prompt",
                                                      "response", "estimators", "out"}
    assert advanced and all(g.title.startswith("advanced: ") for g in advanced)
    assert not any(a.required for g in groups for a in g._group_actions)


# ---------------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------------

TOKENS = ["$", "x", "$", "\n", "\\boxed{", "1", "}", "$$", " ", "<script>", "\t"]


def test_render_png_awkward_tokens(tmp_path):
    n = len(TOKENS)
    path = tmp_path / "h.png"
    render_png(path, TOKENS, [("oar_g", [float(i) for i in range(n)]), ("zeros", [0.0] * n)],
               [("reasoning", [i < 4 for i in range(n)])], title="a $title$ with {braces}\nsecond line", wrap=4,
               weights=[("w~", [0.5, 1.0, 2.0, float("nan"), *([1.0] * (n - 4))])])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_html_block_escapes():
    n = len(TOKENS)
    block = html_block(TOKENS, [("oar_g", [1.0] * n)], [("answer", [True] * n)], title="<b>row</b>")
    assert "<script>" not in block and "&lt;script&gt;" in block and "&lt;b&gt;row" in block
    assert "⏎" in block and block.count("■") == n
    with pytest.raises(ValueError, match="2 values for"):
        html_block(TOKENS, [("short", [1.0, 2.0])], [], "")


def test_answer_locator_is_the_runs(model_dir, tmp_path):
    """A response the built-in cannot read is scored with the run's own locator (--answer-locator)."""
    locator = tmp_path / "my_locator.py"
    locator.write_text(
        "from verl_oar.core.answer_span import AnswerSpan\n"
        "def locate(text):\n"
        "    at = text.rfind('RESULT ')\n"
        "    return None if at < 0 else AnswerSpan(at, at + 7, len(text))\n"
    )
    response = "3 ok +7=10 so RESULT 10"
    report = main(["--model", str(model_dir), "--device", "cpu", "--out", str(tmp_path / "out"), "--prompt", PROMPT,
                   "--response", response, "--estimators", "oar_g", "--answer-locator", f"{locator}:locate"])
    row = report["rows"][0]
    tokens = row["tokens"]
    assert "".join(t for t, a in zip(tokens, row["answer"]) if a) == "10"
