"""Two ranks through ``python -m verl.trainer.main_ppo`` in CPU mode (``cpu_overrides(ranks=2)``): two FSDP2 ranks over
gloo, the actor's parameters sharded across them, the importance pass on each rank's rows.

On the committed pick_max testbed (``verl_oar/testbed/start``), one step of 4 prompts x 4 responses, with the
recipes' engine settings (FSDP2, packed sequences, dynamic batch size; a token budget of 256 per micro-batch so
that each rank makes several micro-batches, the recipes' 24k would make one) and OAR's recipe defaults (OAR-G:
``noisy_kl``, ``grad_x_input``, fused into verl's log-prob pass; OAR-P: chunk mode, 16 spans). Three launches:

1. OAR-G on two ranks, its rollouts served by one hf replica (``rollout.tensor_model_parallel_size=2``: verl makes
   world size / TP replicas), so that it samples exactly the responses of
2. OAR-G on one rank (the hf rollout seeds each request by its replica, ``cpu/hf_rollout.py``);
3. OAR-P (chunk) on two ranks, one hf replica per rank (the default).

Each rank writes the rows it scored (``$VERL_OAR_RANK_DUMP_DIR``, ``engines/rank_dump.py``), the trainer the whole
step (``algorithm.oar.dump_dir``).

Tolerance of the one-rank equality (importance rtol 1e-4 with atol 1e-7; advantages and OAR weights rtol 1e-4 with
atol 1e-6; masks, GRPO advantages and fallbacks exact), and why: at step 1 both runs score the same rows with the
same parameters -- FSDP2's all-gather concatenates the shards, it sums nothing, so each rank's gathered weights are
bit-equal to the one rank's -- and each row's importance depends on its own tokens only (the noise is drawn per
sequence, ``core/noise.py``). No reduction across ranks enters step-1 importance, masks or advantages: the ranks'
gradients are reduced in the update, after them, and GRPO's group statistics and OAR's reshaping run in the driver
on the gathered batch. What differs is which rows share a micro-batch (8 rows per rank vs 16 on one rank, packed to
the 256-token budget), so a row's matmuls may be blocked and summed in another order: float32 rounding, which
``noisy_kl`` -- a KL of two nearly equal distributions -- magnifies to ~3e-5 relative (tests/e2e/test_resume_on_cpu.py
measured that from row order alone). Masks come from token ids and GRPO advantages from rewards: exact. Advantages and
weights follow from importance through its quantiles: equal to rounding unless a rounding difference swaps two
nearly tied tokens around a quantile, which would fail here loudly. Measured here: bit-equal (every max |difference|
0.0), on 2 loaded cores of an AMD EPYC.

Marked slow: three launches, about 2-3 minutes each on 2 loaded cores.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

SEED = 0
STEP = 1
TOKEN_BUDGET = 256
"""tokens per micro-batch and rank (dynamic batch size): a testbed row is about 72 tokens, so a rank's 8 rows make
three micro-batches (verl gives every rank the same number) and one rank's 16 rows six"""
RECIPE_ENGINE = (
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET}",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={TOKEN_BUDGET}",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={TOKEN_BUDGET}",
    "trainer.val_before_train=False",
    "trainer.test_freq=-1",
)
"""the recipes' engine settings (math_grpo.yaml: packed sequences, dynamic batch size) over the testbed's runs"""
OAR_P_CHUNK = ("++algorithm.oar.perturb_mode=chunk", "++algorithm.oar.perturb_budget=16")
"""the OAR-P recipes' mode (oar.yaml) instead of the testbed's exact mode"""
ONE_REPLICA = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
PER_TOKEN = ("oar_importance", "oar_reasoning_mask", "oar_answer_mask")
EXACT = ("oar_reasoning_mask", "oar_answer_mask", "grpo_advantages", "fallback")
TOLERANCE = {"oar_importance": (1e-4, 1e-7), "weights": (1e-4, 1e-6), "advantages": (1e-4, 1e-6)}
"""field -> (rtol, atol) of the one-rank equality (module docstring)"""


def _launch(bed, out: Path, method: str, ranks: int, *extra: str, monkeypatch) -> tuple[Path, float]:
    """One step of ``method`` on ``ranks`` ranks through main_ppo; returns the run's folder and wall time (s)."""
    import sys

    from _e2e import CONTENT_ORDERED_SAMPLER

    from verl_oar.testbed.demo import write_val_subset
    from verl_oar.testbed.fast_runner import neutral_token_id
    from verl_oar.testbed.training_runs import Run, RunSettings, run_all, run_overrides

    run = out / f"{method}_{ranks}ranks"
    settings = RunSettings(steps=1, batch_size=4, n=4, val_every=0, val_prompts=4, ranks=ranks)
    val_file = write_val_subset(bed, settings.val_prompts, run / "val.parquet")
    overrides = run_overrides(bed, method, SEED, settings, neutral_id=neutral_token_id(bed), name=run.name,
                              val_file=val_file, dump_dir=run / "dump")
    # content-ordered batches: each run's micro-batches are a function of the step's rows, not of rollout timing
    overrides += [*RECIPE_ENGINE, *CONTENT_ORDERED_SAMPLER, f"trainer.rollout_data_dir={run / 'rollouts'}", *extra]
    monkeypatch.setenv("VERL_OAR_RANK_DUMP_DIR", str(run / "ranks"))
    job = Run(method, SEED, [sys.executable, "-m", "verl.trainer.main_ppo", *overrides], run / "metrics.jsonl",
              run / "train.log", cwd=bed.root)
    started = time.monotonic()
    run_all([job], total_steps=1, log=print, timeout_s=600)
    wall = time.monotonic() - started
    print(f"[two ranks] {run.name}: {wall:.0f} s wall (2 loaded cores)")
    assert [r["step"] for r in job.records] == [STEP], job.log_path.read_text()[-3000:]
    data = job.records[0]["data"]
    assert data["oar/mass_error/max_abs"] < 1e-4 and data["actor/pg_loss"] == data["actor/pg_loss"]
    assert data["training/rollout_probs_diff_mean"] < 1e-4  # fp32 rollout and trainer agree
    return run, wall


def _check_each_rank_scored_its_own_rows(run: Path, method: str, ranks: int, *, fused: bool) -> None:
    """Every rank's file: its rank, the data-parallel group, a shard of the parameters, and the rows it scored,
    which are its contiguous share of the step's batch (verl's dispatch after ``_balance_batch``), row for row,
    with the importance and masks the trainer gathered for those rows."""
    step = torch.load(run / "dump" / f"step_{STEP}.pt")
    rows = len(step["keys"])
    share = rows // ranks
    files = sorted((run / "ranks").glob(f"step_{STEP}_{method}_rank*.pt"))
    assert [f.name for f in files] == [f"step_{STEP}_{method}_rank{r}.pt" for r in range(ranks)]
    dumps = [torch.load(f) for f in files]
    assert len({d["pid"] for d in dumps}) == ranks  # one process per rank
    held = 0
    for rank, d in enumerate(dumps):
        assert (d["rank"], d["world_size"], d["dp_rank"], d["dp_size"]) == (rank, ranks, rank, ranks)
        assert d["fused"] is fused and d["method"] == method
        # FSDP2: with several ranks each holds a shard of the parameters, not the whole model
        assert (d["param_numel_local"] < d["param_numel_full"]) == (ranks > 1)
        held += d["param_numel_local"]
        assert len(d["prompts"]) == share, (rank, len(d["prompts"]), rows)
        for i in range(share):
            row = rank * share + i
            length = len(d["responses"][i])
            assert d["prompts"][i] == step["prompts"][row], (rank, i)
            assert d["responses"][i] == step["responses"][row][:length].tolist(), (rank, i)
            for field in PER_TOKEN:  # what the trainer holds for the row is what this rank computed
                assert torch.equal(d[field][i], step[field][row][:length].to(d[field][i].dtype)), (rank, i, field)
                assert not step[field][row][length:].any()  # beyond the response: padding
    assert held == dumps[0]["param_numel_full"]  # the shards add up to the model, none held twice
    assert any(bool(d["oar_importance"][i].any()) for d in dumps for i in range(share))  # a real signal


@pytest.mark.slow
def test_oar_g_on_two_ranks_scores_each_ranks_rows_and_equals_one_rank(tiny_bed, tmp_path, monkeypatch):
    from _e2e import compare_dumped_steps

    two, wall_two = _launch(tiny_bed, tmp_path, "oar_g", 2, ONE_REPLICA, monkeypatch=monkeypatch)
    _check_each_rank_scored_its_own_rows(two, "gradient", 2, fused=True)
    one, wall_one = _launch(tiny_bed, tmp_path, "oar_g", 1, monkeypatch=monkeypatch)
    _check_each_rank_scored_its_own_rows(one, "gradient", 1, fused=True)
    # the same rollouts (asserted first by compare_dumped_steps), then the same step within TOLERANCE
    diffs = compare_dumped_steps(one, two, [STEP], EXACT)
    for field, (rtol, atol) in TOLERANCE.items():
        diffs[STEP].update(compare_dumped_steps(one, two, [STEP], (field,), rtol=rtol, atol=atol)[STEP])
    print(f"[two ranks] OAR-G, one rank vs two, step {STEP}: max |difference| {diffs[STEP]}; "
          f"wall {wall_one:.0f} s (1 rank), {wall_two:.0f} s (2 ranks)")


@pytest.mark.slow
def test_oar_p_chunk_on_two_ranks_scores_each_ranks_rows(tiny_bed, tmp_path, monkeypatch):
    run, _ = _launch(tiny_bed, tmp_path, "oar_p", 2, *OAR_P_CHUNK, monkeypatch=monkeypatch)
    _check_each_rank_scored_its_own_rows(run, "perturbation", 2, fused=False)
    step = torch.load(run / "dump" / f"step_{STEP}.pt")
    for row, reasoning in zip(step["oar_importance"], step["oar_reasoning_mask"].bool(), strict=True):
        assert row[reasoning].unique().numel() <= 16  # chunk mode: at most 16 spans, one value each
