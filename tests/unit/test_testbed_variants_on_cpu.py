"""pick_max variants (verl_oar.testbed.variants): each spec's warm-start responses parse with the oracle
and fit the model's context; the committed folders load, were built from their specs (fingerprints), hold
a small model whose context holds the longest prompt + response, and record start statistics in the
ranges the variants were chosen for; the committed model greedily answers a few held-out prompts in
the format. The data's filler entropy is checked against the closed-form joint entropy of a gap."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pandas as pd
import pytest
import torch

from verl_oar.cpu.workspace import build_tokenizer, read_manifest
from verl_oar.testbed.pick_max import make_problems, oracle_token_masks
from verl_oar.testbed.variants import (
    VARIANTS,
    data_filler_entropy,
    filler_tokens,
    load_variant,
    variant,
)
from verl_oar.testbed.workspace import (
    COMMITTED,
    TestbedSpec,
    check_spec,
    context_tokens,
    initial_model,
    max_response_tokens,
    sample_responses,
)

NAMES = list(VARIANTS)
MODEL_BYTES = 2_000_000
"""per committed variant (the whole repository is cloned by CI)"""


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_the_variants_grow_the_filler_and_fill2_is_the_committed_start():
    specs = [v.spec for v in VARIANTS.values()]
    assert [s.filler_words for s in specs] == sorted(s.filler_words for s in specs)
    assert specs[0] == TestbedSpec() and VARIANTS["fill2"].directory == COMMITTED
    assert specs[-1].filler_words >= 16 * specs[0].filler_words
    assert all(s.word_length == 3 for s in specs)
    # today's start is untouched: its recorded fingerprint is the default spec's
    assert read_manifest(COMMITTED, "testbed.json")["fingerprint"] == TestbedSpec().fingerprint()
    with pytest.raises(ValueError, match="no pick_max variant 'fill9'; known: fill2, fill8, fill32, fill64"):
        variant("fill9")


@pytest.mark.parametrize("name", NAMES)
def test_warm_start_responses_parse_with_the_oracle_and_fit_the_context(name, tokenizer):
    spec = VARIANTS[name].spec
    problems = make_problems(40, spec.pairs, seed=7, pick_max_prob=spec.pick_max_prob, words=spec.filler_words,
                             word_length=spec.word_length, repeat_prob=spec.filler_repeat_prob)
    lengths = set()
    for p in problems:
        ids = tokenizer.encode(p.response, add_special_tokens=False) + [tokenizer.eos_token_id]
        masks = oracle_token_masks(ids, tokenizer)
        assert masks is not None and masks.trace.copies_picks, p.response
        assert len(masks.trace.picks) == spec.pairs
        assert int((masks.reasoning & ~masks.causal).sum()) == filler_tokens(spec)
        lengths.add(len(ids))
    assert lengths == {max_response_tokens(spec) - 16}  # every warm-start response: same length, 16 to spare
    assert context_tokens(spec, tokenizer) <= spec.max_position_embeddings
    check_spec(spec, tokenizer)


def test_a_spec_whose_responses_overflow_the_context_is_refused_naming_the_fix():
    spec = replace(TestbedSpec(), filler_words=32)  # 415 response tokens, 256 positions
    with pytest.raises(ValueError, match=r"needs 448 positions, but max_position_embeddings is 256; "
                                         r"raise max_position_embeddings to at least 448"):
        check_spec(spec)


@pytest.mark.parametrize("letters", [1, 3, 6, 24, 96])
@pytest.mark.parametrize("repeat", [0.0, 0.15, 0.5])
def test_data_filler_entropy_equals_the_joint_entropy_of_a_gap(letters, repeat):
    # a gap of n letters: all-same strings (26) have (1-r) 26^-n + r/26, the others (26^n - 26) (1-r) 26^-n;
    # the sum of per-letter conditional entropies is this joint entropy (spaces: certain)
    n, r = letters, repeat
    other = (1 - r) * 26.0 ** -n
    same = other + r / 26
    joint = -26 * same * math.log(same) - ((26.0 ** n - 26) * other * math.log(other) if n > 1 and other > 0 else 0.0)
    spec = replace(TestbedSpec(), filler_words=letters, word_length=1, filler_repeat_prob=repeat, pairs=1)
    assert data_filler_entropy(spec) * filler_tokens(spec) == pytest.approx(2 * joint, rel=1e-9)
    if repeat == 0.0:
        assert data_filler_entropy(spec) * filler_tokens(spec) == pytest.approx(2 * n * math.log(26), rel=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_the_committed_variant_loads_and_was_built_from_its_spec(name, tokenizer):
    v = VARIANTS[name]
    bed = load_variant(name)
    assert bed.manifest["spec"] == v.spec.record() and bed.spec == v.spec
    assert bed.manifest["max_response_tokens"] == max_response_tokens(v.spec)
    config = json.loads((bed.model_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == v.spec.max_position_embeddings >= context_tokens(v.spec, tokenizer)
    assert (bed.model_dir / "model.safetensors").stat().st_size < MODEL_BYTES
    assert bed.reward_file.read_text() == (COMMITTED / "reward.py").read_text()  # one reward for every variant
    val = pd.read_parquet(bed.val_file)
    assert len(val) == v.spec.n_val and len(pd.read_parquet(bed.train_file)) == v.spec.n_train
    assert {len(r["pairs"]) for r in val["extra_info"]} == {v.spec.pairs}
    # the start statistics the variant was chosen for (64 held-out prompts at the build)
    stats = bed.manifest["val_samples"]
    assert stats["samples"] == v.spec.stats_samples == 64
    assert 0.3 <= stats["sampled_accuracy"] <= 0.6, "GRPO starts well below the study's threshold (0.8), as the start"
    assert stats["answer_rate"] >= 0.95 and stats["copies_picks"] >= 0.95, "the format is learnt"
    assert stats["filler_tokens"] == pytest.approx(filler_tokens(v.spec), rel=0.05)
    assert stats["filler_entropy"] == pytest.approx(data_filler_entropy(v.spec), abs=0.3)


def test_init_from_is_left_out_of_the_record_at_its_default_and_begins_from_the_start(tokenizer):
    start = TestbedSpec()
    assert "init_from" not in start.record() and start.record() == read_manifest(COMMITTED, "testbed.json")["spec"]
    longer = VARIANTS["fill32"].spec
    assert longer.init_from == start.fingerprint() and longer.record() == asdict(longer)
    from transformers import AutoModelForCausalLM

    model = initial_model(longer, tokenizer)
    weights = AutoModelForCausalLM.from_pretrained(COMMITTED / "model", dtype=torch.float32).state_dict()
    assert model.config.max_position_embeddings == longer.max_position_embeddings
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    fresh = initial_model(replace(longer, init_from=""), tokenizer)
    assert not torch.equal(fresh.model.embed_tokens.weight, weights["model.embed_tokens.weight"])


def test_init_from_a_start_that_is_not_the_one_given_or_of_another_shape_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r"init_from=0123456789abcdef names a start that is not the one given.*"
                                         r"set init_from to that testbed's fingerprint"):
        initial_model(replace(TestbedSpec(), init_from="0123456789abcdef"), tokenizer)
    fill32 = load_variant("fill32")
    with pytest.raises(ValueError, match=r"names a start that is not the one given \(aed1d8d737720fc9"):
        initial_model(VARIANTS["fill8"].spec, tokenizer, fill32)  # fill8 starts from the start, not fill32
    with pytest.raises(ValueError, match=r"differs in hidden_size 64 vs 96: use the start's shape or init_from=''"):
        initial_model(replace(TestbedSpec(), init_from=TestbedSpec().fingerprint(), hidden_size=96), tokenizer)


def test_fill64_starts_from_fill32s_built_model_and_the_others_from_the_start(tokenizer):
    """fill64's warm start begins from fill32's model (three budgets from the start's never learnt to copy across
    its gaps: docs/study.md, amendment 3); its spec names fill32's fingerprint, which the build checks."""
    assert VARIANTS["fill64"].starts_from == "fill32"
    assert VARIANTS["fill64"].spec.init_from == VARIANTS["fill32"].spec.fingerprint() == load_variant("fill32").manifest["fingerprint"]
    assert all(VARIANTS[n].starts_from == "fill2" and VARIANTS[n].spec.init_from == TestbedSpec().fingerprint()
               for n in ("fill8", "fill32"))
    import torch
    from transformers import AutoModelForCausalLM

    model = initial_model(VARIANTS["fill64"].spec, tokenizer, load_variant("fill32"))
    assert model.config.max_position_embeddings == 1024
    fill32 = AutoModelForCausalLM.from_pretrained(load_variant("fill32").model_dir, dtype="float32").state_dict()
    assert all(torch.equal(w, fill32[k]) for k, w in model.state_dict().items())  # fill32's weights, not the start's


def test_a_missing_variant_build_names_its_build_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds nothing.*python -m verl_oar.testbed.variants fill8 --out"):
        load_variant("fill8", tmp_path)


@pytest.mark.parametrize("name", NAMES[1:])
def test_the_committed_model_answers_held_out_prompts_in_the_format(name, tokenizer):
    from transformers import AutoModelForCausalLM

    bed = load_variant(name)
    model = AutoModelForCausalLM.from_pretrained(bed.model_dir, dtype=torch.float32).eval()
    val = pd.read_parquet(bed.val_file)["extra_info"].iloc[:4]
    problems = [_problem(row) for row in val]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = sample_responses(model, tokenizer, [p.prompt for p in problems], seed=0,
                               max_new_tokens=max_response_tokens(bed.spec), greedy=True)
    finally:
        torch.set_num_threads(threads)
    for _, response in out:
        text = tokenizer.decode(response, skip_special_tokens=True)
        masks = oracle_token_masks(response, tokenizer)
        assert masks is not None and masks.trace.copies_picks, text
        assert len(masks.trace.picks) == bed.spec.pairs, text


def _problem(row):
    from verl_oar.testbed.pick_max import PickMaxProblem

    return PickMaxProblem(tuple(tuple(int(d) for d in pair) for pair in row["pairs"]), "")


def test_the_build_command_lists_variants_and_leaves_the_committed_start_alone(capsys, monkeypatch):
    from verl_oar.testbed.variants.__main__ import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # restored after the test, whatever main sets

    main(["--list"])
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["name"] for row in listed] == NAMES
    assert listed[0]["fingerprint"] == read_manifest(COMMITTED, "testbed.json")["fingerprint"]
    with pytest.raises(SystemExit):
        main(["fill2"])
    assert "fill2 is the committed start; rebuild it with OMP_NUM_THREADS=1 python -m verl_oar.testbed.workspace " \
           "verl_oar/testbed/start --force" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fill9"])
    assert "no pick_max variant 'fill9'" in capsys.readouterr().err
