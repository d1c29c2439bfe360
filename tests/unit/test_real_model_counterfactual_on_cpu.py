"""real_model.counterfactual and data.worked_solutions on a tiny random Llama with the byte-level tokenizer: each
piece against a plain reference (a per-token loop of log-probabilities, the edits done by hand, rank correlation
from its definition), in fp32 and bf16. The same code on SmolLM2 is the benchmark's
(benchmarks/real_model_counterfactual.py)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from verl_oar.core.answer_span import locate_answer_tokens
from verl_oar.core.token_ranking import entropy_scores, recall_at, top_fraction_mask
from verl_oar.cpu.workspace import build_tokenizer
from verl_oar.data.worked_solutions import FILLER, worked_solutions
from verl_oar.real_model import counterfactual as cf
from verl_oar.tools.heatmap import make_sample

PROMPT = "Solve the problem. Put the final answer in \\boxed{}.\n\nProblem: What is 7 + 5?"
RESPONSE = "We add 7 and 5: 7 + 5 = 12. So the sum is 12, and \\boxed{12}"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def sample(tokenizer):
    return make_sample(0, [{"role": "user", "content": PROMPT}], RESPONSE, tokenizer, chat_template=True)


def _reference_log_prob(model, ids: torch.Tensor, answer: torch.Tensor) -> float:
    """One sequence alone, token by token: sum of log p(ids[t] | ids[:t]) over the answer positions."""
    total = 0.0
    with torch.no_grad():
        for t in answer.nonzero().squeeze(1).tolist():
            logits = model(ids[None, :t]).logits[0, -1].float()
            total += float(torch.log_softmax(logits, -1)[ids[t]])
    return total


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_answer_log_prob_of_a_padded_batch_equals_a_per_token_loop(model, sample, dtype, tol):
    m = model.to(dtype)
    try:
        ids, answer = sample.ids, sample.full_masks()[1]
        g = torch.Generator().manual_seed(3)
        other = torch.cat([ids[:20], torch.randint(3, 200, (11,), generator=g), ids[-6:]])  # shorter, fresh tokens
        other_answer = torch.zeros(len(other), dtype=torch.bool)
        other_answer[-4:-1] = True
        got = cf.answer_log_prob(m, [(ids, answer), (other, other_answer)])
        assert got[0] == pytest.approx(_reference_log_prob(m, ids, answer), abs=tol * abs(got[0]) + 1e-4)
        assert got[1] == pytest.approx(_reference_log_prob(m, other, other_answer), abs=tol * abs(got[1]) + 1e-4)
        assert all(v < 0 for v in got)
    finally:
        model.to(torch.float32)


def test_edits_delete_or_replace_exactly_the_chosen_reasoning_tokens(sample):
    T, P = len(sample.response_ids), len(sample.prompt_ids)
    reasoning = torch.tensor(sample.reasoning)
    remove = torch.zeros(T, dtype=torch.bool)
    chosen = reasoning.nonzero().squeeze(1)[[0, 3, 7]]
    remove[chosen] = True
    ids, answer = cf.edited_sequence(sample, remove, "replace", neutral_id=0)
    assert torch.equal(ids[P + chosen], torch.zeros(3, dtype=torch.long))
    keep = torch.ones(P + T, dtype=torch.bool)
    keep[P + chosen] = False
    assert torch.equal(ids[keep], sample.ids[keep]) and torch.equal(answer, sample.full_masks()[1])
    ids, answer = cf.edited_sequence(sample, remove, "delete", neutral_id=0)
    assert torch.equal(ids, sample.ids[keep]) and len(ids) == P + T - 3
    assert torch.equal(ids[answer], sample.ids[sample.full_masks()[1]])  # the answer tokens moved up, unchanged
    with pytest.raises(ValueError, match="include answer tokens"):
        cf.edited_sequence(sample, torch.tensor(sample.answer), "delete", 0)
    with pytest.raises(ValueError, match="edit='cut' must be one of"):
        cf.edited_sequence(sample, remove, "cut", 0)


def test_answer_change_is_the_edited_minus_the_original_log_prob_of_each_rankings_top(model, sample):
    g = torch.Generator().manual_seed(5)
    scores = {"a": torch.rand(len(sample.response_ids), generator=g), "b": torch.zeros(len(sample.response_ids))}
    got = cf.answer_change(model, sample, scores, neutral_id=0, seed=11, batch_size=5)
    ids, answer = sample.ids, sample.full_masks()[1]
    original = _reference_log_prob(model, ids, answer)
    reasoning = torch.tensor(sample.reasoning)
    tops = []
    for name, row in scores.items():
        for frac in cf.FRACS:
            remove = top_fraction_mask(row, reasoning, frac, torch.Generator().manual_seed(11))
            tops.append(remove)
            for edit in cf.EDITS:
                edited = cf.edited_sequence(sample, remove, edit, 0)
                assert got[name][edit][frac] == pytest.approx(_reference_log_prob(model, *edited) - original, abs=1e-4)
    assert all(bool((a <= b).all()) for a, b in zip(tops[0:2], tops[1:3]))  # one ranking's tops are nested
    assert int(tops[1].sum()) == math.ceil(0.1 * int(reasoning.sum()))


def test_rankings_have_the_response_shape_and_are_zero_off_the_reasoning_tokens(model, sample, tokenizer):
    got = cf.rankings(model, sample, neutral_id=0, seed=2, tokenizer=tokenizer)
    assert list(got) == list(cf.RANKINGS)
    T, off = len(sample.response_ids), ~torch.tensor(sample.reasoning)
    for name, row in got.items():
        assert row.shape == (T,) and row.dtype == torch.float32 and torch.isfinite(row).all(), name
        if name in cf.IMPORTANCE_RANKINGS:
            assert bool((row[off] == 0).all()) and bool((row[~off] > 0).any()), name
    with torch.no_grad():
        logits = model(sample.ids[None]).logits[0]
    assert torch.equal(got["entropy"], entropy_scores(logits)[len(sample.prompt_ids):])
    again = cf.rankings(model, sample, neutral_id=0, seed=2, names=("random", "oar_g"))
    assert torch.equal(again["random"], got["random"]) and torch.equal(again["oar_g"], got["oar_g"])
    assert not torch.equal(cf.rankings(model, sample, neutral_id=0, seed=3, names=("random",))["random"], got["random"])
    with pytest.raises(ValueError, match="unknown ranking 'attention'"):
        cf.rankings(model, sample, neutral_id=0, seed=2, names=("attention",))


def test_token_categories_of_a_worked_sum(tokenizer):
    ids = tokenizer.encode("We add 7 and 5: 7 + 5 = 12.", add_special_tokens=False)  # one token per byte
    got = cf.token_categories(ids, tokenizer, problem_numbers=[7, 5])
    text = tokenizer.decode(ids)
    expected = []
    for ch_index, ch in enumerate(text):
        if ch in "75" and text[ch_index - 1] == " " and not text[ch_index + 1].isdigit():
            expected.append("problem number")
        elif ch.isdigit():
            expected.append("other number")
        elif ch in "+=":
            expected.append("operator")
        elif ch.isalpha():
            expected.append("word")
        else:
            expected.append("other")
    assert got == expected
    assert cf.token_categories(tokenizer.encode("17 - 7", add_special_tokens=False), tokenizer, [7]) == [
        "other number", "other number", "other", "operator", "other", "problem number"]


def _plain_spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        return [sum(1 for w in v if w < a) + (sum(1 for w in v if w == a) - 1) / 2 for a in v]

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return num / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spearman_and_top_overlap_against_their_definitions(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 6, (40,), generator=g).float()  # ties
    b = a + torch.rand(40, generator=g) * 3
    candidates = torch.rand(40, generator=g) < 0.8
    assert cf.spearman(a, b, candidates) == pytest.approx(_plain_spearman(a[candidates].tolist(), b[candidates].tolist()),
                                                         abs=1e-12)
    assert math.isnan(cf.spearman(torch.ones(40), b, candidates))
    top_a = top_fraction_mask(a, candidates, 0.2, torch.Generator().manual_seed(4))
    top_b = top_fraction_mask(b, candidates, 0.2, torch.Generator().manual_seed(4))
    assert cf.top_overlap(a, b, candidates, 0.2, seed=4) == float((top_a & top_b).sum()) / int(top_a.sum())
    assert cf.top_overlap(b, b, candidates, 0.2, seed=4) == 1.0


def test_worked_solutions_label_each_steps_result_and_the_reasoning_holds_them(tokenizer):
    problems = worked_solutions(12, seed=0)
    assert worked_solutions(12, seed=0) == problems and worked_solutions(12, seed=1) != problems
    for i, p in enumerate(problems):
        steps = (2, 3, 4)[i % 3]
        assert len(p.numbers) == steps + 1 and len(p.results) == steps
        total = p.numbers[0]
        ops = re.findall(r"gets|gives away", p.question)
        for op, x, (start, end) in zip(ops, p.numbers[1:], p.results):
            total = total + x if op == "gets" else total - x
            assert total >= 0 and p.solution[start:end] == str(total)
            assert p.solution[start - 2:start] == "= "
        assert p.answer == total and p.solution.endswith(f"The answer is \\boxed{{{total}}}.")
        fillers = sum(p.solution.count(f) for f in FILLER)
        assert steps <= fillers <= 2 * steps
        ids = tokenizer.encode(p.solution, add_special_tokens=False)
        labelled = cf.labelled_tokens(ids, tokenizer, p.results, p.solution)
        reasoning, _ = locate_answer_tokens(ids, tokenizer)
        reasoning = torch.tensor(reasoning)
        assert int(labelled.sum()) == sum(e - s for s, e in p.results)  # a byte per token
        assert not bool((labelled & ~reasoning).any())
        perfect = labelled.float()
        assert recall_at(perfect, reasoning, labelled, [0.2])[0.2] == pytest.approx(
            min(1.0, math.ceil(0.2 * int(reasoning.sum())) / int(labelled.sum())))
    with pytest.raises(ValueError, match="do not decode to the text"):
        cf.labelled_tokens(tokenizer.encode("abc", add_special_tokens=False), tokenizer, [(0, 1)], "abd")
    with pytest.raises(ValueError, match="need n >= 0"):
        worked_solutions(3, steps=())


def _fake_store(tmp_path, n: int = 5, worked: int = 3):
    """A store as the benchmark's steps write it: n scored responses of 10 tokens (the first 8 reasoning) and
    ``worked`` worked solutions, with fresh random numbers."""
    import json
    import random

    rng = random.Random(7)
    names, edits, fracs = cf.RANKINGS, cf.EDITS, cf.FRACS
    with open(tmp_path / "scores.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({
                "index": i, "score": float(i % 2), "tokens": 10, "reasoning_tokens": 8, "answer_tokens": 1,
                "categories": [rng.choice(cf.CATEGORIES) for _ in range(10)], "reasoning": [True] * 8 + [False] * 2,
                "scores": {k: [rng.random() for _ in range(8)] + [0.0, 0.0] for k in names},
                "bf16_agreement": {k: {"top10_overlap": rng.random(), "spearman": rng.uniform(-1, 1)}
                                   for k in cf.IMPORTANCE_RANKINGS},
                "answer_change": {k: {e: {str(fr): rng.gauss(0, 1) for fr in fracs} for e in edits} for k in names},
                "seconds": 1.0}) + "\n")
    with open(tmp_path / "worked.jsonl", "w") as f:
        for i in range(worked):
            f.write(json.dumps({"index": i, "steps": 2, "tokens": 40, "reasoning_tokens": 30, "labelled_tokens": 3,
                                "recall": {k: {str(fr): rng.random() for fr in fracs} for k in names},
                                "seconds": 2.0}) + "\n")
    (tmp_path / "sampling.json").write_text(json.dumps({"batches": 1, "sampled": 9, "no_answer": 3, "short": 1}))


def test_the_benchmarks_collection_counts_every_response_and_renders_the_docs_tables(tmp_path):
    import json
    import statistics

    from _benchmarks import load_benchmark

    bench = load_benchmark("real_model_counterfactual")
    _fake_store(tmp_path)
    scored = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    got = bench.collect(tmp_path, resamples=200)
    assert got["responses"]["scored"] == 5 and got["responses"]["right"] == 2 and got["worked"]["problems"] == 3
    for name in cf.RANKINGS:
        values = [r["answer_change"][name]["delete"]["0.1"] for r in scored]
        base = [r["answer_change"]["random"]["delete"]["0.1"] for r in scored]
        c = got["answer_change"][name]["delete"]["0.1"]
        assert c["mean"] == pytest.approx(statistics.fmean(values)) and c["low"] <= c["mean"] <= c["high"]
        assert c["minus_random"]["mean"] == pytest.approx(statistics.fmean(values) - statistics.fmean(base))
        assert c["absolute"]["mean"] == pytest.approx(statistics.fmean(abs(v) for v in values))
    # the top 10% of 8 reasoning tokens is 1 token per response: 5 tokens per ranking, categories counted by hand
    for name in cf.RANKINGS:
        counts = dict.fromkeys(cf.CATEGORIES, 0)
        for r in scored:
            top = top_fraction_mask(torch.tensor(r["scores"][name]), torch.tensor(r["reasoning"]), 0.1,
                                    torch.Generator().manual_seed(r["index"]))
            counts[r["categories"][int(top.nonzero()[0])]] += 1
        assert got["top10_categories"]["counts"][name] == counts
        assert sum(got["top10_categories"]["shares"][name].values()) == pytest.approx(1.0)
    assert sum(got["top10_categories"]["counts"]["all reasoning tokens"].values()) == 5 * 8
    assert got["bf16_agreement"]["oar_g"]["spearman"]["mean"] == pytest.approx(
        statistics.fmean(r["bf16_agreement"]["oar_g"]["spearman"] for r in scored))
    text = bench.tables(got)
    assert text.count("\n| OAR-P exact |") == 2 and "| top 10%, entropy |" in text
    bench.figure(got, tmp_path / "figure.png")
    assert (tmp_path / "figure.png").stat().st_size > 10_000


def test_the_docs_quote_the_committed_results():
    """docs/real-model.md's counterfactual tables are what ``real_model_counterfactual.py --table`` renders from the
    committed results, which cover every scored response and worked solution of the committed store."""
    import json
    from pathlib import Path

    from _benchmarks import load_benchmark

    root = Path(__file__).resolve().parents[2]
    bench = load_benchmark("real_model_counterfactual")
    results = json.loads((root / "benchmarks" / "results_real_model_counterfactual_cpu.json").read_text())
    assert bench.tables(results) in (root / "docs" / "real-model.md").read_text()
    store = root / "benchmarks" / "real_model_counterfactual"
    kept = [line for line in (store / "responses.jsonl").read_text().splitlines() if line.strip()]
    scored = [line for line in (store / "scores.jsonl").read_text().splitlines() if line.strip()]
    assert results["responses"]["scored"] == len(scored) == len(kept) >= 100  # every kept response, none dropped
    assert results["worked"]["problems"] == 60
