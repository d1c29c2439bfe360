"""``python -m verl_oar.tools.heatmap --dump step_N.pt``: dumps written by verl-oar's real estimators (each registered
estimator called as verl calls it, with and without CoDaPO's compose, and the payload ``integration.dump.dump_step``
writes: signals' tensors and artifacts, prompts, responses, response mask, real rows), drawn without a model; every
row's values equal the dumped tensors at the row's valid response tokens; bad input stops with the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from verl_oar.integration import acpo_estimator, codapo_estimator, estimators, privileged_estimators  # noqa: F401
from verl_oar.tools.heatmap import main

BS, T = 6, 9
"""3 groups of 2 responses, padded response length"""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The CPU workspace's byte tokenizer (one token per byte), saved as a directory (no model)."""
    from verl_oar.cpu.workspace import build_tokenizer

    directory = tmp_path_factory.mktemp("dump_tokenizer")
    build_tokenizer().save_pretrained(directory)
    return directory


def _signals(seed: int):
    """verl's estimator inputs and every signal field the six estimators read, on a batch whose last row is one
    of verl's synthetic padding rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 5, 7, 3, 8, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    score = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    rewards = torch.zeros(BS, T)
    rewards[torch.arange(BS), lengths - 1] = score
    index = np.array([f"u{i // 2}" for i in range(BS)], dtype=object)
    reasoning = mask.clone()
    answer = torch.zeros(BS, T)
    for r, n in enumerate(lengths.tolist()):
        reasoning[r, n - 2:] = 0
        answer[r, n - 1] = 1
    tensors = {
        "oar_importance": torch.rand(BS, T, generator=g) * reasoning,
        "oar_reasoning_mask": reasoning, "oar_answer_mask": answer,
        "cscr_pos_shift": torch.randn(BS, T, generator=g) * mask, "cscr_neg_shift": torch.randn(BS, T, generator=g) * mask,
        "cscr_scored": mask.clone(),
        "oppo_evidence": torch.randn(BS, T, generator=g) * mask, "oppo_scored": mask.clone(),
        "acpo_surrogate": torch.rand(BS, T, generator=g) * 3 * mask, "acpo_entropy": torch.rand(BS, T, generator=g) * mask,
        "old_log_probs": -torch.rand(BS, T, generator=g) * 2 * mask, "rm_scores": rewards.clone(),
    }
    responses = (torch.randint(97, 123, (BS, T), generator=g) * mask.long())  # letters, 0 on padding
    prompts = [torch.randint(97, 123, (int(n),), generator=g).tolist() for n in (3, 5, 4, 2, 6, 3)]
    real = torch.tensor([True] * (BS - 1) + [False])
    return rewards, mask, index, tensors, responses, prompts, real


def write_dump(path, estimator: str, compose: bool = False, seed: int = 0) -> dict:
    """Run the registered ``estimator`` as verl's trainer does and save what ``dump_step`` saves."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.integration.signals import ESTIMATOR_NEEDS, SIGNALS, TokenSignals, provide

    rewards, mask, index, tensors, responses, prompts, real = _signals(seed)
    config = {"codapo": {"compose": True}} if compose else {}
    needs = list(ESTIMATOR_NEEDS[estimator]) + (["old_log_probs", "verifier_scores"] if compose else [])
    fields = {f for need in needs for f in SIGNALS[need].fields}
    signals = TokenSignals(tensors={k: v for k, v in tensors.items() if k in fields}, step=3, real_rows=real)
    with provide(signals):
        get_adv_estimator_fn(estimator)(rewards, mask, index, config=config)
    payload = {"step": 3, "keys": [f"{u}_0_{i}" for i, u in enumerate(index)], **signals.tensors, **signals.artifacts,
               "responses": responses, "response_mask": mask.long(), "prompts": prompts, "real_rows": real}
    torch.save(payload, path)
    return payload


def _draw(tmp_path, tokenizer_dir, estimator, compose=False, extra=()):
    dump = write_dump(tmp_path / "step_3.pt", estimator, compose)
    report = main(["--dump", str(tmp_path / "step_3.pt"), "--tokenizer", str(tokenizer_dir), "--out",
                   str(tmp_path / "out"), *extra])
    return dump, report


SIGNAL_ROWS = {
    "oar": {"oar_importance": "oar_importance"},
    "cscr": {"sensitivity": "sensitivity", "|cscr_pos_shift|": "cscr_pos_shift", "|cscr_neg_shift|": "cscr_neg_shift"},
    "oppo": {"|oppo_evidence|": "oppo_evidence", "V_t after token": "values"},
    "acpo": {"acpo_surrogate": "acpo_surrogate"},
    "codapo": {"-old_log_probs": "old_log_probs"},
}


@pytest.mark.parametrize("estimator, compose", [
    ("oar_g", False), ("oar_p", False), ("cscr", False), ("oppo", False), ("acpo", False), ("codapo", False),
    ("oar_p", True), ("oppo", True), ("acpo", True),
])
def test_every_estimators_dump_draws_what_the_run_applied(tmp_path, tokenizer_dir, estimator, compose):
    dump, report = _draw(tmp_path, tokenizer_dir, estimator, compose)
    view = "oar" if estimator.startswith("oar") else estimator
    assert report["config"]["estimator"] == view and report["config"]["composed"] == compose
    assert report["config"]["step"] == 3 and report["config"]["rows"] == [0, 1, 2, 3, 4]  # padding row 5 left out
    assert json.loads((tmp_path / "out" / "heatmap.json").read_text()) == json.loads(json.dumps(report))
    assert len(report["files"]["png"]) == 5 and (tmp_path / "out" / "heatmap_4.png").read_bytes()[:4] == b"\x89PNG"
    for record in report["rows"]:
        r = record["row"]
        mask = dump["response_mask"][r].bool()
        assert record["response_ids"] == dump["responses"][r][mask].tolist() and len(record["tokens"]) == int(mask.sum())
        assert "".join(record["tokens"]) == bytes(record["response_ids"]).decode()
        assert record["prompt"] == bytes(dump["prompts"][r]).decode()
        # the weights row is the dumped weights; the applied row is advantages / GRPO's, both at the valid tokens
        assert record["weights"][f"w~ {view}"] == dump["weights"][r][mask].double().tolist()
        advantages, grpo = dump["advantages"][r][mask].double(), dump["grpo_advantages"][r][mask].double()
        expected = torch.where(grpo != 0, advantages / torch.where(grpo != 0, grpo, 1.0), 1.0)
        torch.testing.assert_close(torch.tensor(record["weights"]["w~ applied"], dtype=torch.float64), expected, rtol=0, atol=0)
        for label, key in SIGNAL_ROWS[view].items():
            tensor = dump[key][:, 1:] if key == "values" else dump[key]  # OPPO's V_0 .. V_R: the value after each token
            signed = tensor[r][mask].double() * (-1 if key == "old_log_probs" else 1)
            assert record["signed_scores"][label] == signed.tolist(), label
            assert record["scores"][label] == (signed.abs() if label.startswith("|") else signed).tolist(), label
        if view == "oar":
            assert record["masks"]["reasoning"] == dump["oar_reasoning_mask"][r][mask].bool().tolist()
            assert record["masks"]["answer"] == dump["oar_answer_mask"][r][mask].bool().tolist()
            assert record["values"]["fallback"] in ("NONE", "ALL_EQUAL", "NO_REASONING", "NO_ANSWER", "NON_FINITE")
        else:
            assert record["masks"] == {}
        if view == "oppo":
            assert record["values"]["V_0"] == pytest.approx(float(dump["values"][r, 0]))
        if view == "codapo" or compose:
            assert record["values"]["codapo_value"] == pytest.approx(float(dump["codapo_value"][r]))
            assert record["inner_advantages"] == (dump["inner_advantages"][r][mask].double().tolist() if compose else None)
        assert record["values"]["grpo_advantage"] == pytest.approx(float(grpo[grpo != 0][0]) if (grpo != 0).any() else 0)


def test_compose_applied_row_is_the_value_times_the_inner_weights(tmp_path, tokenizer_dir):
    """Under compose the policy received v_q * A^GRPO * w~: the applied row is v_q * w~ (ACPO's weights)."""
    dump, report = _draw(tmp_path, tokenizer_dir, "acpo", compose=True)
    for record in report["rows"]:
        if record["values"]["grpo_advantage"] == 0:
            continue
        expected = torch.tensor(record["weights"]["w~ acpo"]) * record["values"]["codapo_value"]
        torch.testing.assert_close(torch.tensor(record["weights"]["w~ applied"], dtype=torch.float64), expected.double(),
                                   rtol=1e-5, atol=1e-6)


def test_rows_padding_rows_and_config_name(tmp_path, tokenizer_dir):
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("algorithm.adv_estimator=oar_p\n")
    _, report = _draw(tmp_path, tokenizer_dir, "oar_p", extra=["--rows", "5,1", "--config", str(overrides)])
    assert [r["row"] for r in report["rows"]] == [5, 1] and report["config"]["estimator"] == "oar_p"
    assert not report["rows"][0]["real"] and "padding row" in report["rows"][0]["notes"][0]


def test_the_runs_model_path_is_the_default_tokenizer(tmp_path, tokenizer_dir):
    config = tmp_path / "config.yaml"
    config.write_text(f"algorithm:\n  adv_estimator: acpo\nactor_rollout_ref:\n  model:\n    path: {tokenizer_dir}\n")
    write_dump(tmp_path / "step_3.pt", "acpo")
    report = main(["--dump", str(tmp_path / "step_3.pt"), "--config", str(config), "--out", str(tmp_path / "out")])
    assert report["tokenizer"] == str(tokenizer_dir) and report["config"]["estimator"] == "acpo"


@pytest.mark.parametrize("args, needle", [
    (["--rows", "7"], "out of range, the dump has 6 rows"),
    (["--estimators", "oar_g"], "--estimators only apply when recomputing"),
    (["--oar-p-mode", "chunk"], "--oar-p-mode only apply when recomputing"),
    (["--prompt", "x"], "--prompt only apply when recomputing"),
    (["--temperature", "0.5", "--seed", "1"], "--temperature, --seed only apply when recomputing"),
])
def test_bad_dump_arguments_exit_with_the_fix(tmp_path, tokenizer_dir, args, needle):
    write_dump(tmp_path / "step_3.pt", "cscr")
    with pytest.raises(SystemExit) as err:
        main(["--dump", str(tmp_path / "step_3.pt"), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path), *args])
    assert needle in str(err.value)


def test_bad_dump_files_exit_with_the_fix(tmp_path, tokenizer_dir):
    def message(*args):
        with pytest.raises(SystemExit) as err:
            main(["--out", str(tmp_path / "out"), *args])
        return str(err.value)

    assert "no such file" in message("--dump", str(tmp_path / "nope.pt"), "--tokenizer", str(tokenizer_dir))
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    assert "cannot be read by torch.load" in message("--dump", str(tmp_path / "junk.pt"), "--tokenizer", str(tokenizer_dir))
    torch.save({"step": 1}, tmp_path / "other.pt")
    assert "not a verl-oar step dump" in message("--dump", str(tmp_path / "other.pt"), "--tokenizer", str(tokenizer_dir))
    write_dump(tmp_path / "step_3.pt", "cscr")
    assert "give --tokenizer PATH" in message("--dump", str(tmp_path / "step_3.pt"))
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("+algorithm.adv_estimator=acpo\n")
    assert "holds cscr's signals" in message("--dump", str(tmp_path / "step_3.pt"), "--tokenizer", str(tokenizer_dir),
                                            "--config", str(wrong))
    payload = torch.load(tmp_path / "step_3.pt", weights_only=False)
    for key in ("cscr_pos_shift", "cscr_neg_shift", "sensitivity"):
        payload.pop(key)
    torch.save(payload, tmp_path / "bare.pt")
    assert "no estimator's token signal" in message("--dump", str(tmp_path / "bare.pt"), "--tokenizer", str(tokenizer_dir))
