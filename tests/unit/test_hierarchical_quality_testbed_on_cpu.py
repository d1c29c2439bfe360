"""benchmarks/hierarchical_quality.py --testbed: the model, tokenizer and prompts of a built testbed (fill32), its
long lengths skipped when they do not fit the model or its own responses are longer, and the pick measures."""

import json
import random
from pathlib import Path

import pytest
import torch
from _benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
FILL32 = ROOT / "verl_oar" / "testbed" / "variants" / "fill32"


hq = load_benchmark("hierarchical_quality")


def test_fill32_tiny_run(tmp_path, monkeypatch):
    """One fill32 response, one configuration of each kind: its own long responses are measured, every default
    long length is skipped (R 256 is shorter than its responses; 512 and 1024 exceed its context 512)."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the test process's threads alone
    out = tmp_path / "r.json"
    report = hq.main(["--testbed", str(FILL32), "--samples", "1", "--long-per-length", "1", "--budgets", "4",
                      "--tops", "1", "--units", "4", "--chunks", "4", "--out", str(out), "--plot", ""])
    assert json.loads(out.read_text())["families"].keys() == {"testbed"}
    assert report["testbed"]["context"] == 512 and report["testbed"]["filler_words"] == 32
    assert "variants/fill32/model" in report["model"] and "context 512" in report["model"]
    assert set(report["long_skipped"]) == {"long256", "long512", "long1024"}
    assert "context 512" in report["long_skipped"]["long1024"] and "own responses" in report["long_skipped"]["long256"]
    fam = report["families"]["testbed"]
    assert fam["reasoning_tokens_range"][0] > 300  # ~388 reasoning tokens: the long measurement, in context
    assert fam["exact_top2_are_picks"]["sequences"] == 1 and fam["answer_prob"]["mean"] > 0.5
    methods = {(r["method"], r.get("K")): r for r in fam["rows"]}
    assert set(methods) == {("exact", None), ("chunk", 4), ("hierarchical", 4)}
    assert methods[("exact", None)]["recall@0.1"]["mean"] == 1.0
    assert methods[("chunk", 4)]["passes"]["mean"] == pytest.approx(4 / fam["reasoning_tokens"]["mean"], abs=1e-4)
    assert fam["target"]["best_chunk"]["label"] == "chunk K=4" and fam["target"]["met"] in (True, False)


def test_bad_testbed_folder_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a built pick_max testbed.*--testbed"):
        hq.main(["--testbed", str(tmp_path), "--samples", "1", "--out", str(tmp_path / "r.json"), "--plot", ""])


def test_long_sequences_mark_the_picks_and_fitting_long_skips():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(FILL32 / "model")
    seqs = hq.long_sequences(tok, [64, 256], 2, seed=3)
    for s in seqs:
        assert int(s.picks.sum()) == 2 and not (s.picks & ~s.reasoning).any()
        digits = tok.decode(s.ids[s.picks].tolist())
        assert digits == tok.decode(s.ids[s.answer].tolist())  # the picks are the boxed answer, in order
    keep, skipped = hq.fitting_long(seqs, context=200, own_tokens=50)
    assert {s.family for s in keep} == {"long64"} and set(skipped) == {"long256"}
    keep, skipped = hq.fitting_long(seqs, context=512, own_tokens=100)
    assert {s.family for s in keep} == {"long256"} and "own responses" in skipped["long64"]


def test_top2_are_picks():
    ids = torch.arange(8)
    reasoning = torch.tensor([0, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    answer = torch.tensor([0, 0, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    picks = torch.tensor([0, 0, 1, 0, 1, 0, 0, 0], dtype=torch.bool)
    seq = hq.Sequence_(ids, reasoning, answer, "t", picks)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    noise = torch.rand(8, generator=g) * 0.1
    assert hq.top2_are_picks(noise + picks * 1.0, seq) is True
    assert hq.top2_are_picks(noise + torch.tensor([0, 0, 1.0, 0, -1, 0, 0, 0]), seq) is False  # one pick only
    tied = torch.tensor([9.0, 0, 1, 1, 1, 0, 9, 9])  # a tie at second place: the picks are not singled out
    assert hq.top2_are_picks(tied, seq) is False
    assert hq.top2_are_picks(noise, hq.Sequence_(ids, reasoning, answer, "t", None)) is None


def test_recorded_command_reruns_as_written(tmp_path):
    """The report's command quotes its arguments (an empty --long-lengths once came out bare, so the recorded
    command could not be pasted back)."""
    import shlex

    out = tmp_path / "r.json"
    report = hq.main(["--testbed", str(FILL32), "--samples", "0", "--long-lengths", "", "--out", str(out), "--plot", ""])
    assert report["families"] == {} and report["long_skipped"] == {}
    args = shlex.split(report["command"])[2:]
    assert args[args.index("--long-lengths") + 1] == "" and args[args.index("--samples") + 1] == "0"
