"""The fast runner (verl_oar.testbed.fast_runner) is verl's math, checked against main_ppo's own step.

The fixture (tests/fixtures/fast_runner, written by ``python -m verl_oar.testbed.fast_check make-fixture
tests/fixtures/fast_runner``) is one step of main_ppo per method on the committed start, seed 0: metric files and
the token methods' dumps. Here, without launching a trainer:

- data order: the runner's step-k prompts are the dataset's rows in the order of ``torch.randperm`` under a
  generator seeded with ``data.seed`` (a plain reference of verl's sampler);
- step 1's rollout: the runner's in-process hf server samples exactly main_ppo's step-1 responses (the multiset
  of (prompt ids, response ids) of the dumps), and its reward gives main_ppo's ``critic/score/mean``;
- advantages: on the dumped batch (rows in the dump's order, its importance fields) the runner's advantage
  computation equals the dumped OAR and GRPO advantages bit for bit, and GRPO's equals a per-group float64 loop;
- in one fresh process (verl's process group is global; ~40 s on 2 cores): the runner's actor replays each dumped
  step (importance to float32 accuracy: the fixture's CPU rounds differently from most; ``actor/pg_loss``,
  ``actor/grad_norm``, ``actor/entropy`` against main_ppo's metrics) and a two-step CLI run writes a metric file
  that ``training_runs.read_records`` and ``comparison.compare`` read;
- refusals name their cause and main_ppo.

Bit for bit on one CPU, on fill32 (the study's headline task): tests/e2e/test_fast_runner_fill32_on_cpu.py runs
main_ppo and the runner on this machine.

The slow test compares 24-step GRPO curves with the committed long run's (proof 2).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fast_runner"
ROOT = Path(__file__).resolve().parents[2]


def _config(method: str, seed: int = 0, **settings):
    """main_ppo's config of the fixture's run of ``method`` (a copy: callers may change it)."""
    return copy.deepcopy(_composed(method, seed, tuple(sorted(settings.items()))))


@functools.lru_cache(maxsize=None)
def _composed(method: str, seed: int, settings: tuple):
    """Each (method, seed, settings) composed once with Hydra (about a second each)."""
    settings = dict(settings)
    from verl_oar.testbed.fast_check import fixture_settings
    from verl_oar.testbed.fast_runner import compose_config, load_bed, overrides_of

    bed = load_bed(None)
    base = fixture_settings()
    from dataclasses import replace

    return compose_config(overrides_of(bed, method, seed, replace(base, **settings), val_file=bed.val_file))


@pytest.fixture(scope="module")
def step_one():
    """The runner's rollout, tokenizer and step-1 dataloader rows for seed 0 (the fixture's run)."""
    from verl_oar.testbed.fast_rollout import Rollout
    from verl_oar.testbed.fast_runner import Batches

    config = _config("oar_g")
    rollout = Rollout(config)
    rollout.load_weights({k: v.clone() for k, v in rollout.server.model.state_dict().items()}, 0)  # on_init_end
    batches = Batches(config, rollout.tokenizer, rollout.model_config.processor)
    return config, rollout, batches.train()


def _dump(method: str) -> dict:
    return torch.load(FIXTURE / f"{method}_step_1.pt", weights_only=False)


def _logged(method: str, step: int) -> dict:
    from verl_oar.testbed.training_runs import read_records

    return next(r["data"] for r in read_records(FIXTURE / f"{method}_metrics.jsonl") if r["step"] == step)


def _pairs(dump: dict) -> Counter:
    lengths = dump["response_mask"].sum(-1).tolist()
    return Counter((tuple(p), tuple(dump["responses"][b, :n].tolist())) for b, (p, n) in
                   enumerate(zip(dump["prompts"], lengths)))


def test_fixture_is_of_the_committed_start():
    from verl_oar.testbed.workspace import committed_testbed

    info = json.loads((FIXTURE / "fixture.json").read_text())
    assert info["testbed_fingerprint"] == committed_testbed().manifest["fingerprint"], (
        "the fixture was made on another start: rebuild it with " + info["command"])


def test_data_order_is_a_seeded_randperm_of_the_dataset():
    import pandas as pd

    from verl_oar.testbed.fast_runner import Batches
    from verl_oar.testbed.workspace import committed_testbed

    frame = pd.read_parquet(committed_testbed().train_file)
    questions = [row["extra_info"]["question"] for _, row in frame.iterrows()]
    for seed in (0, 3):
        config = _config("grpo", seed)
        from verl.utils.config import omega_conf_to_dataclass

        tokenizer = omega_conf_to_dataclass(config.actor_rollout_ref.model).tokenizer
        batches = Batches(config, tokenizer, None)
        order = torch.randperm(len(frame), generator=torch.Generator().manual_seed(seed)).tolist()
        for step in range(3):
            got = [r["extra_info"]["question"] for r in batches.train()]
            assert got == [questions[i] for i in order[8 * step : 8 * step + 8]], (seed, step)


def test_step_one_rollout_and_rewards_are_main_ppos(step_one):
    config, rollout, rows = step_one
    samples = rollout.rollout(rows, [f"u{i}" for i in range(len(rows))], validate=False)
    ours = Counter((tuple(s.prompt_ids), tuple(s.response_ids)) for s in samples)
    for method in ("oar_g", "oar_p"):
        assert ours == _pairs(_dump(method)), f"step-1 rollouts differ from main_ppo's {method} run"
    scores = [s.score for s in samples]
    for method in ("grpo", "oar_g", "oar_p"):
        assert sum(scores) / len(scores) == _logged(method, 1)["critic/score/mean"]
    assert all(s.response_mask == [1] * len(s.response_ids) for s in samples)
    # a prompt's requests since the last weight update are ranked: the same burst again draws new samples; after
    # reloading the step-0 weights it draws the same ones again; step-1 weights (here equal) draw others
    def burst():
        return Counter((tuple(s.prompt_ids), tuple(s.response_ids))
                       for s in rollout.rollout(rows, [f"u{i}" for i in range(len(rows))], validate=False))

    weights = {k: v.clone() for k, v in rollout.server.model.state_dict().items()}
    assert burst() != ours
    rollout.load_weights(weights, 0)
    assert burst() == ours
    rollout.load_weights(weights, 1)
    assert burst() != ours
    rollout.load_weights(weights, 0)


def test_advantages_equal_main_ppos_dumps_bit_for_bit(step_one):
    from verl_oar.testbed.fast_check import dump_samples
    from verl_oar.testbed.fast_actor import compute_advantages

    _, rollout, rows = step_one
    for method in ("oar_g", "oar_p"):
        dump = _dump(method)
        samples = dump_samples(dump, rows, rollout)
        mask = dump["response_mask"]
        rm = torch.zeros(mask.shape, dtype=torch.float32)
        for b, s in enumerate(samples):
            rm[b, len(s.response_ids) - 1] = s.score
        keys, uids = [s.key for s in samples], [s.uid for s in samples]
        signals = {f: dump[f] for f in ("oar_importance", "oar_reasoning_mask", "oar_answer_mask")}
        advantages, got = compute_advantages(_config(method), 1, keys, uids, mask, rm, signals)
        assert torch.equal(advantages, dump["advantages"]), method
        assert torch.equal(got.artifacts["grpo_advantages"], dump["grpo_advantages"]), method
        assert torch.equal(got.artifacts["weights"], dump["weights"]), method
        grpo, _ = compute_advantages(_config("grpo"), 1, keys, uids, mask, rm, {})
        assert torch.equal(grpo, dump["grpo_advantages"]), method
        # a plain reference: (r - mean) / (std + 1e-6) per group in float64, unbiased std as torch.std
        groups: dict[str, list[int]] = {}
        for b, uid in enumerate(uids):
            groups.setdefault(uid, []).append(b)
        for members in groups.values():
            r = torch.tensor([samples[b].score for b in members], dtype=torch.float64)
            want = (r - r.mean()) / (r.std() + 1e-6)
            for b, a in zip(members, want.tolist()):
                want_row = torch.full((int(mask[b].sum()),), a, dtype=torch.float64)
                assert torch.allclose(grpo[b][mask[b].bool()].double(), want_row, rtol=1e-6, atol=1e-6)
        # the comparison can fail: another quantile level gives other advantages
        from omegaconf import open_dict

        config = _config(method)
        with open_dict(config):
            config.algorithm.oar.tau = 0.7
        moved, _ = compute_advantages(config, 1, keys, uids, mask, rm, signals)
        assert not torch.equal(moved, dump["advantages"])


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory):
    """One interpreter (verl's process group is global): the replay of every fixture method and a 2-step CLI run."""
    out = tmp_path_factory.mktemp("fast_runner")
    script = (
        "import json, sys\n"
        "from verl_oar.testbed.fast_check import replay\n"
        f"print('REPLAY ' + json.dumps(replay({str(FIXTURE)!r})), flush=True)\n"
        "from verl_oar.testbed.fast_runner import main\n"
        f"main(['--method', 'oar_g', '--seed', '1', '--steps', '2', '--batch-size', '2', '--n', '4', "
        f"'--val-prompts', '4', '--val-every', '1', '--out', {str(out / 'oar_g.jsonl')!r}, "
        f"'--dump-dir', {str(out / 'dumps')!r}])\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VERL_PLATFORM", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPLAY "))
    return json.loads(line[len("REPLAY "):]), out, done.stdout


def test_replayed_step_matches_main_ppo(fresh_process):
    """To float32 accuracy on any CPU: the fixture was made on one CPU, and another rounds its float32 kernels
    differently (measured on an Intel Xeon and on a family-26 AMD EPYC against the fixture's AMD EPYC: importance
    within 2e-6 of its maximum, entropy 1.2e-6), so a token whose importance sits at a bi-level quantile can move
    tier and OAR advantages and the loss's gradient differ there. So: the importance to float32 accuracy, the masks
    and GRPO bit for bit, the OAR advantages on the dump's own importance bit for bit
    (test_advantages_equal_main_ppos_dumps_bit_for_bit). The bit-for-bit check of both runners on one CPU runs
    main_ppo here and now instead of reading a fixture: tests/e2e/test_fast_runner_fill32_on_cpu.py."""
    report, _, _ = fresh_process
    for method in ("oar_g", "oar_p"):
        entry = report[method]
        assert entry["rows"] == 64 and entry["rollouts_identical"], entry
        assert entry["oar_reasoning_mask_identical"] and entry["oar_answer_mask_identical"], entry
        assert entry["oar_importance_max_abs_diff"] <= 1e-4 * entry["oar_importance_max_abs"], entry
    for method, entry in report.items():
        assert entry["grpo_advantages_identical"], (method, entry)
        assert entry["score_mean"] == entry["logged_score_mean"], (method, entry)
        if method != "grpo":  # entropy precedes the advantages; the gradient follows them (a tier move: 0.6% measured)
            assert entry["actor/entropy"]["abs_diff"] <= 1e-5, entry
            assert entry["actor/pg_loss"]["abs_diff"] <= 1e-6, entry
            assert entry["actor/grad_norm"]["abs_diff"] <= 0.05 * entry["actor/grad_norm"]["main_ppo"], entry
            continue
        # GRPO's run dumped nothing: replayed on OAR-G's dump, whose rows are GRPO's step-1 rollouts in another
        # order (each run's rollouts finish in their own order), so sums round differently. pg_loss is minus the
        # token mean of the advantages at ratio 1 (~1e-9 here: equal lengths, advantages summing to 0 per group):
        # float32 rounding of a 2.5k-term sum of O(1) terms, divided by the count, is below 1e-6
        assert entry["actor/pg_loss"]["abs_diff"] <= 1e-6, entry
        assert entry["actor/grad_norm"]["abs_diff"] <= 1e-6 * entry["actor/grad_norm"]["main_ppo"], entry
        assert entry["actor/entropy"]["abs_diff"] <= 1e-5, entry


def test_cli_run_writes_verls_metric_file_that_the_comparison_reads(fresh_process):
    from verl_oar.testbed.comparison import compare
    from verl_oar.testbed.fast_runner import run_summary
    from verl_oar.testbed.training_runs import REWARD, VAL_REWARD, read_records, train_records

    _, out, stdout = fresh_process
    records = read_records(out / "oar_g.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["step"] for r in train_records(records)] == [1, 2]
    assert all(VAL_REWARD in r["data"] for r in records)
    assert all(0.0 <= r["data"][REWARD] <= 1.0 for r in train_records(records))
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "timing_s/step", "oar/timing_s/token_importance",
                "response_length/mean", "oar/answer/frac_locator"):
        assert key in records[1]["data"], key
    assert sorted(p.name for p in (out / "dumps").iterdir()) == ["step_1.pt", "step_2.pt"]
    summary = run_summary(records, 1)
    assert set(summary["val_accuracy"]) == {"0", "1", "2"}
    result = compare({"grpo": [summary], "oar_g": [summary]}, "grpo")
    assert result["methods"]["oar_g"]["vs_baseline"]["auc"]["estimate"] == 0.0
    assert '"reward"' in stdout


def test_methods_run_with_the_overrides_main_ppo_gets():
    from verl_oar.testbed.fast_runner import METHODS, neutral_token_id, overrides_of
    from verl_oar.testbed.training_runs import RunSettings, run_overrides
    from verl_oar.testbed.workspace import committed_testbed

    bed, settings = committed_testbed(), RunSettings(steps=24)
    neutral = neutral_token_id(bed)
    assert neutral == 32  # a space in the byte tokenizer (testbed.quality's neutral token)
    for method in ("grpo", "oar_g", "oar_p"):
        want = run_overrides(bed, method, 3, settings, neutral_id=neutral, name=f"{method}_seed3",
                             val_file=bed.val_file)
        assert overrides_of(bed, method, 3, settings, val_file=bed.val_file) == want
    chunk = overrides_of(bed, "oar_p_chunk16", 3, settings, val_file=bed.val_file)
    exact = run_overrides(bed, "oar_p", 3, settings, neutral_id=neutral, name="oar_p_chunk16_seed3",
                          val_file=bed.val_file)
    assert set(exact) - set(chunk) == {"+algorithm.oar.perturb_mode=exact"}
    assert set(chunk) - set(exact) == {"+algorithm.oar.perturb_mode=chunk", "+algorithm.oar.perturb_budget=16"}
    # the study's OAR-G ablation and tau methods are checked in test_study_runner_on_cpu.py
    assert {"grpo", "oar_g", "oar_p", "oar_p_chunk16"} <= set(METHODS)
    oar = _config("oar_p_chunk16").algorithm.oar
    assert (oar.perturb_mode, oar.perturb_budget, oar.perturb_token_id, oar.seed) == ("chunk", 16, 32, 0)


def test_refusals_name_the_cause_and_main_ppo(tmp_path, capsys):
    from verl_oar.testbed.fast_actor import prepare_process
    from verl_oar.testbed.fast_runner import load_bed, overrides_of, parse_args
    from verl_oar.testbed.fast_step import FastTrainer
    from verl_oar.testbed.training_runs import RunSettings

    with pytest.raises(SystemExit):
        parse_args(["--method", "cscr", "--seed", "0", "--out", str(tmp_path / "x.jsonl")])
    assert "main_ppo" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # several runs, one file
        parse_args(["--method", "grpo,oar_g", "--seed", "0", "--out", str(tmp_path / "x.jsonl")])
    assert "{method} and {seed}" in capsys.readouterr().err
    args = parse_args(["--method", "grpo,oar_p_chunk16", "--seed", "0,2", "--out", "r/{method}_{seed}.jsonl"])
    assert args.methods == ["grpo", "oar_p_chunk16"] and args.seeds == [0, 2]
    bed = load_bed(None)
    with pytest.raises(ValueError, match="main_ppo"):
        overrides_of(bed, "codapo", 0, RunSettings(), val_file=bed.val_file)
    with pytest.raises(FileNotFoundError, match="verl_oar.testbed.workspace"):
        load_bed(tmp_path)
    from verl_oar.testbed.training_runs import run_overrides
    from verl_oar.testbed.fast_runner import compose_config

    config = compose_config(run_overrides(bed, "cscr", 0, RunSettings(), neutral_id=32, name="x",
                                          val_file=bed.val_file))
    with pytest.raises(NotImplementedError, match="main_ppo"):
        FastTrainer(config)
    from omegaconf import open_dict

    config = _config("grpo")
    with open_dict(config):
        config.actor_rollout_ref.actor.use_kl_loss = True  # needs the reference model the runner does not build
    with pytest.raises(NotImplementedError, match="reference model"):
        FastTrainer(config)
    import verl  # noqa: F401  (imported without the cpu platform, as in this test process)

    saved = os.environ.pop("VERL_PLATFORM", None)
    try:
        with pytest.raises(RuntimeError, match="VERL_PLATFORM=cpu"):
            prepare_process()
    finally:
        if saved is not None:
            os.environ["VERL_PLATFORM"] = saved


# ---------------------------------------------------------------------------------------------------------------------
# proof 2: curves against the committed long run (slow: five 24-step runs)
# ---------------------------------------------------------------------------------------------------------------------

LONG_RUN = ROOT / "benchmarks" / "results_testbed_long_run_cpu.json"


@pytest.mark.slow
def test_grpo_curves_agree_with_the_committed_main_ppo_long_run(tmp_path):
    from verl_oar.testbed.comparison import run_measures
    from verl_oar.testbed.measures import paired_bootstrap
    from verl_oar.testbed.workspace import TestbedSpec, committed_testbed

    long_run = json.loads(LONG_RUN.read_text())
    assert TestbedSpec(**long_run["testbed"]["spec"]).fingerprint() == committed_testbed().manifest["fingerprint"]
    seeds, steps = long_run["seeds"], long_run["settings"]["steps"]
    script = (
        "from verl_oar.testbed.fast_runner import run\n"
        "from verl_oar.testbed.training_runs import RunSettings\n"
        f"for seed in {seeds!r}:\n"
        f"    run('grpo', seed, RunSettings(steps={steps}), {str(tmp_path)!r} + f'/grpo_seed{{seed}}.jsonl')\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VERL_PLATFORM", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    from verl_oar.testbed.fast_runner import run_summary
    from verl_oar.testbed.training_runs import read_records

    ours = {s: run_summary(read_records(tmp_path / f"grpo_seed{s}.jsonl"), s) for s in seeds}
    theirs = {r["seed"]: r for r in long_run["runs"]["grpo"]}
    # step 1: the same sampler, seeds and weights as main_ppo: the same responses, so the same reward
    assert [ours[s]["reward"][0] for s in seeds] == [theirs[s]["reward"][0] for s in seeds]
    diffs = [sum(a - b for a, b in zip(ours[s]["reward"], theirs[s]["reward"], strict=True)) / steps for s in seeds]
    interval = paired_bootstrap(diffs, [0.0] * len(diffs), resamples=10000, seed=0)
    assert interval.low <= 0.0 <= interval.high, (diffs, interval)
    assert interval.high - interval.low <= 0.1, (diffs, interval)
    auc = paired_bootstrap([run_measures(ours[s])["auc"] for s in seeds],
                           [run_measures(theirs[s])["auc"] for s in seeds], resamples=10000, seed=0)
    assert auc.low <= 0.0 <= auc.high and auc.high - auc.low <= 0.1, auc
    assert not math.isnan(auc.estimate)
