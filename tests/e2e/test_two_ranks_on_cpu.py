"""Two ranks through ``python -m verl.trainer.main_ppo`` in CPU mode (``--ranks 2``, ``cpu_overrides``' ``ranks``): two
FSDP2 ranks over gloo, the actor's (and reference model's) parameters sharded across them, the importance pass on
each rank's rows.

The OAR-G and OAR-P recipes' CPU copies through their own launch scripts (``python -m verl_oar.cpu.recipe``: FSDP2,
packed sequences, dynamic batch size, KL loss against the reference model, the math reward; OAR-G fused into verl's
log-prob pass, OAR-P in chunk mode), steps of 2 prompts x 8 responses, with one size changed: a token budget of
128 per micro-batch and rank instead of the recipes' 24k, so that each rank makes several micro-batches of its
variable-length rows (verl gives every rank the same number; OAR's pass keeps the ranks' model calls equal). Four
launches:

1. OAR-G on two ranks, its rollouts served by one hf replica (``rollout.tensor_model_parallel_size=2``: verl makes
   world size / TP replicas), so that it samples exactly the responses of
2. OAR-G on one rank (the hf rollout seeds each request by its replica, ``cpu/hf_rollout.py``); both update on the
   whole step as one PPO mini-batch (the copy's two mini-batches would hold other rows on two ranks: verl forms each
   rank's mini-batches from its own share, so the updates could not be compared);
1 and 2 run one step;
3. OAR-P on two ranks, one hf replica per rank (the default), three steps with a checkpoint after each, its rank-1
   worker killed (SIGKILL) in step 3: its step 1 is checked as the others' step is, then the loss of the rank's worker
   (below);
4. the same run resumed on two ranks from its step-1 checkpoint, to step 3 (below).

Each rank writes the rows it scored (``$VERL_OAR_RANK_DUMP_DIR``, ``engines/rank_dump.py``), the trainer the whole
step (``algorithm.oar.dump_dir``). The pick_max testbed runs on two ranks as well (``RunSettings.ranks``), but its
responses all have one length, so a one-rank run of it is bit-equal and would not exercise the tolerance below.

Tolerance of the one-rank equality (importance rtol 1e-4 with atol 1e-7; OAR weights and advantages rtol 1e-4 with
atol 1e-6; masks, GRPO advantages and fallbacks exact), and why. At step 1 both runs score the same rows with the same
parameters: FSDP2's all-gather concatenates the shards and sums nothing, so each rank's gathered weights are bit-equal
to the one rank's; each row's importance depends on its own tokens only (the noise is drawn per sequence,
``core/noise.py``). No reduction across ranks enters step-1 importance, masks or advantages: the ranks' gradients are
reduced in the update, after them, and GRPO's group statistics and OAR's reshaping run in the driver on the gathered
batch. What differs is which rows share a packed micro-batch (a rank's 8 rows vs all 16), so a row's matmuls may be
blocked and summed in another order: float32 rounding, which ``noisy_kl`` -- a KL of two nearly equal distributions --
magnifies to ~3e-5 relative (tests/e2e/test_resume_on_cpu.py measured that from row order alone). Masks come from token
ids and GRPO advantages from rewards: exact. OAR weights and advantages follow from importance through its quantiles:
equal to rounding unless a rounding difference swaps two nearly tied tokens around a quantile, which would fail here
loudly. Measured on 2 loaded cores of an AMD EPYC: importance 3.0e-8, weights 2.4e-6, advantages 8.3e-7 (max absolute
differences; values up to 0.09, 2.4 and 5.5); at the recipes' own token budget (one micro-batch per rank) 2.5e-7,
4.3e-6 and 1.5e-6; see the printed line for this run's.

The update is where the ranks do reduce: FSDP2 reduce-scatters (sums) the two ranks' gradients, each the gradient of
verl's loss normalised by the global token count (``batch_num_tokens`` x ``dp_size``), where one rank sums the same
rows' terms in one backward. So ``actor/pg_loss`` and ``actor/grad_norm`` agree to rtol 1e-5 (float32 sums of two
partial sums in another order; measured: grad norm bit-equal, pg_loss 2.7e-7 relative).

A rank's worker lost mid-run (the third launch): as soon as rank 1 has written its step-3 rows
(``$VERL_OAR_RANK_DUMP_DIR``: at the end of its OAR-P pass, before the step's update, which needs both ranks' FSDP2
collectives), the test kills rank 1's worker process. verl's driver waits on both ranks' futures of a call with one
``ray.get``, which raises the dead actor's ``ActorDiedError`` without waiting for rank 0 (which cannot finish a
collective alone); the TaskRunner raises, ``main_ppo`` exits with 1, and Ray ends the run's other actors (the session
cluster's leftover check shows them gone). Checked: the launch exits non-zero within ``LOSS_BOUND_S`` of the kill; its
log names the lost worker twice, Ray's ``ActorDiedError`` (the ``WorkerDict`` actor, its pid) and the plugin's summary
(``integration/lost_workers.py``: the rank, its pid and node); step 1's metrics are the only ones logged; and the
checkpoints it leaves are complete: verl's ``latest_checkpointed_iteration.txt`` names step 1, every rank's model,
optimizer and extra-state shard and the data loader's state of steps 1 and 2 load, and nothing of step 3 was written.
Measured before this kill was folded into the OAR-P launch, in a launch of its own (OAR-G, killed in step 3): 13-16 s
from the kill to the launch's exit in three runs on 2 loaded cores of an AMD EPYC (``LOSS_BOUND_S`` allows about 6x).
Resumed (the fourth launch, two ranks, from a copy of the step-1 checkpoint: one step before the last, so that the
optimizer state it restores decides the next step's parameters), the run trains on exactly as it had before the
kill: step 2's dumped importance, masks, GRPO and OAR advantages and weights bit-equal (rows matched by content, as
tests/e2e/test_resume_on_cpu.py compares one rank's), and in step 3 the rows each rank had scored before the kill
(rank 1's, and rank 0's when it had finished) with bit-equal importance and masks. Bit-equal because both runs are
the same two ranks on the same rows in the same order (content-ordered batches), from the same sharded state.

Not covered: a worker lost while verl writes a checkpoint (the save takes ~0.3 s here, too short to aim a kill at):
verl writes the tracker file after every rank's shards and the data loader's state, so an interrupted save leaves a
``global_step_N`` folder the tracker does not name, which ``resume_mode=auto`` does not read.

Marked slow: four launches, about 1.5-3 minutes each on 2 loaded cores.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

STEP = 1
TOKEN_BUDGET = 128
"""tokens per micro-batch and rank (dynamic batch size; a row is at most 64 + 48 tokens): several micro-batches per
rank"""
SMALL_MICRO_BATCHES = (
    f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET}",
    f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={TOKEN_BUDGET}",
    f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={TOKEN_BUDGET}",
)
ONE_REPLICA = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
ONE_MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size=2"
"""the step's 2 prompts in one PPO mini-batch, so that both runs update on the same rows"""
UPDATE_METRICS = ("actor/pg_loss", "actor/grad_norm")
"""the update's metrics the one-rank and two-rank runs must agree on (rtol 1e-5, module docstring)"""
PER_TOKEN = ("oar_importance", "oar_reasoning_mask", "oar_answer_mask")
EXACT = ("oar_reasoning_mask", "oar_answer_mask", "grpo_advantages", "fallback")
TOLERANCE = {"oar_importance": (1e-4, 1e-7), "weights": (1e-4, 1e-6), "advantages": (1e-4, 1e-6)}
"""field -> (rtol, atol) of the one-rank equality (module docstring)"""


LOSS_BOUND_S = 90.0
"""seconds from killing a rank's worker to the launch's exit (measured 13-16 s on 2 loaded cores; module docstring)"""
KILL_STEP = 3
"""the OAR-P launch's step in which rank 1's worker is killed, after steps 1 and 2 and their checkpoints"""
RESUME_FROM = 1
"""the checkpoint the resumed two-rank run starts from: one step before the last, so that a whole resumed step (2)
is compared and the next one's importance (3) depends on the optimizer state it restored"""
RESUMED_EQUAL = ("oar_importance", "oar_reasoning_mask", "oar_answer_mask", "grpo_advantages", "advantages", "weights")
"""dumped per-token fields bit-equal between the killed run and the resumed one (tests/e2e/test_resume_on_cpu.py's)"""


class KillRankWorker:
    """Called while a launch runs (``launch_recipe``'s ``while_running``): kills (SIGKILL) the worker process of
    ``rank`` as soon as that rank has written its ``method`` rows of ``step`` (the rank's file names its pid)."""

    def __init__(self, rank_dir: Path, method: str, step: int, rank: int):
        self.path = rank_dir / f"step_{step}_{method}_rank{rank}.pt"
        self.pid: int | None = None
        self.killed_at: float | None = None

    def __call__(self) -> None:
        if self.killed_at is not None or not self.path.exists():
            return
        try:
            self.pid = torch.load(self.path)["pid"]
        except Exception:  # noqa: BLE001 - still being written: next time
            return
        os.kill(self.pid, signal.SIGKILL)
        self.killed_at = time.monotonic()


def _launch(workspace: Path, out: Path, estimator: str, ranks: int, *extra: str, monkeypatch, steps: int = STEP,
            while_running=None, name: str | None = None, first: int = STEP) -> tuple[Path, dict, float, int, str]:
    """``steps`` steps of the estimator's recipe copy on ``ranks`` ranks, in ``out / name`` (default
    ``{estimator}_{ranks}ranks``); checks its first step, ``first`` (and, unless ``while_running`` interrupts it,
    that it succeeded through step ``steps``); returns the run's folder, its first step's metrics, its wall time (s),
    its exit code and its output."""
    from _e2e import CONTENT_ORDERED_SAMPLER, check_recipe_records, launch_recipe

    from verl_oar.cpu.launch import read_metrics
    from verl_oar.cpu.overrides import metrics_file

    run = out / (name or f"{estimator}_{ranks}ranks")
    run.mkdir(parents=True)
    monkeypatch.setenv("VERL_OAR_RANK_DUMP_DIR", str(run / "ranks"))
    started = time.monotonic()
    # content-ordered batches: each run's micro-batches are a function of the step's rows, not of rollout timing
    rc, text = launch_recipe(
        workspace, run / "train.log", f"qwen2_5_math_1_5b_{estimator}", steps, run.name, "--ranks", str(ranks),
        *CONTENT_ORDERED_SAMPLER, *SMALL_MICRO_BATCHES, f"algorithm.oar.dump_dir={run / 'dump'}",
        f"trainer.rollout_data_dir={run / 'rollouts'}", *extra, timeout_s=500, while_running=while_running,
    )  # fmt: skip
    wall = time.monotonic() - started
    print(f"[two ranks] {run.name}: {wall:.0f} s wall (2 loaded cores), exit code {rc}")
    if while_running is None:
        assert rc == 0, text[-6000:]
    assert f"trainer.n_gpus_per_node={ranks}" in text
    records = read_metrics(metrics_file(workspace, run.name))
    assert [r["step"] for r in records][:1] == [first], text[-3000:]
    if while_running is None:
        assert [r["step"] for r in records] == list(range(first, steps + 1)), text[-3000:]
    check_recipe_records(records, estimator)
    return run, records[0]["data"], wall, rc, text


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
def test_oar_g_on_two_ranks_scores_each_ranks_rows_and_equals_one_rank(cpu_workspace_dir, tmp_path, monkeypatch):
    from _e2e import compare_dumped_steps

    two, two_metrics, wall_two, _, _ = _launch(cpu_workspace_dir, tmp_path, "oar_g", 2, ONE_REPLICA, ONE_MINI_BATCH,
                                               monkeypatch=monkeypatch)
    _check_each_rank_scored_its_own_rows(two, "gradient", 2, fused=True)
    one, one_metrics, wall_one, _, _ = _launch(cpu_workspace_dir, tmp_path, "oar_g", 1, ONE_MINI_BATCH,
                                               monkeypatch=monkeypatch)
    _check_each_rank_scored_its_own_rows(one, "gradient", 1, fused=True)
    # the same rollouts (compare_dumped_steps asserts that first), then the same step within TOLERANCE
    diffs = compare_dumped_steps(one, two, [STEP], EXACT)
    for field, (rtol, atol) in TOLERANCE.items():
        diffs[STEP].update(compare_dumped_steps(one, two, [STEP], (field,), rtol=rtol, atol=atol)[STEP])
    update = {k: (one_metrics[k], two_metrics[k]) for k in UPDATE_METRICS}
    print(f"[two ranks] OAR-G, one rank vs two, step {STEP}: max |difference| {diffs[STEP]}; update (one, two) "
          f"{update}; wall {wall_one:.0f} s (1 rank), {wall_two:.0f} s (2 ranks)")
    for name, (a, b) in update.items():  # the update, where the ranks' gradients are summed
        assert b == pytest.approx(a, rel=1e-5), (name, a, b)


@pytest.mark.slow
def test_oar_p_on_two_ranks_scores_each_ranks_rows_a_killed_worker_fails_the_run_and_two_ranks_resume_as_before(
    cpu_workspace_dir, tmp_path, monkeypatch
):
    from _e2e import (RECIPE_PERTURB_BUDGET, check_complete_checkpoints, check_reshaped_exactly_where_importance_varies,
                      compare_dumped_steps)

    from verl_oar.cpu.launch import read_metrics
    from verl_oar.cpu.overrides import metrics_file

    ckpt = tmp_path / "ckpt"
    kill = KillRankWorker(tmp_path / "oar_p_2ranks" / "ranks", "perturbation", KILL_STEP, rank=1)
    run, _, _, rc, text = _launch(cpu_workspace_dir, tmp_path, "oar_p", 2, "trainer.save_freq=1",
                                  f"trainer.default_local_dir={ckpt}", steps=KILL_STEP, while_running=kill,
                                  monkeypatch=monkeypatch)
    ended = time.monotonic()

    # step 1: each rank scored its own rows, in chunk mode
    _check_each_rank_scored_its_own_rows(run, "perturbation", 2, fused=False)
    step = torch.load(run / "dump" / f"step_{STEP}.pt")
    for row, reasoning in zip(step["oar_importance"], step["oar_reasoning_mask"].bool(), strict=True):
        assert row[reasoning].unique().numel() <= RECIPE_PERTURB_BUDGET  # chunk mode: one value per span

    # step 2: rank 1's worker killed; a non-zero exit in bounded time, naming the lost worker; complete checkpoints
    assert kill.killed_at is not None, f"rank 1 never reached step {KILL_STEP}:\n{text[-6000:]}"
    lost_for = ended - kill.killed_at
    print(f"[two ranks] OAR-P: rank 1 (pid {kill.pid}) killed in step {KILL_STEP}; the launch ended {lost_for:.1f} s "
          "later")
    assert rc != 0, text[-6000:]
    assert lost_for <= LOSS_BOUND_S, (lost_for, text[-6000:])
    assert "ActorDiedError" in text and "WorkerDict" in text and f"pid: {kill.pid}" in text, text[-6000:]
    assert re.search(rf"rank 1 of actor_rollout: actor \S*WorkerDict\S*, pid {kill.pid}, on node \w+, DEAD", text), \
        text[-6000:]  # the plugin's summary (integration/lost_workers.py)
    done = list(range(1, KILL_STEP))   # the steps finished before the kill
    assert [r["step"] for r in read_metrics(metrics_file(cpu_workspace_dir, run.name))] == done
    assert check_complete_checkpoints(ckpt, 2) == (KILL_STEP - 1, done)  # nothing of the step it was killed in

    # resumed on two ranks from the step before the last checkpoint (a copy: the resumed run writes its own), it
    # trains steps RESUME_FROM + 1 .. KILL_STEP as the run did before it was killed
    resumed_ckpt = tmp_path / "resumed_ckpt" / f"global_step_{RESUME_FROM}"
    shutil.copytree(ckpt / f"global_step_{RESUME_FROM}", resumed_ckpt)
    resumed, _, _, rc, text = _launch(
        cpu_workspace_dir, tmp_path, "oar_p", 2, "trainer.save_freq=1", f"trainer.default_local_dir={resumed_ckpt.parent}",
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={resumed_ckpt}", steps=KILL_STEP,
        name="oar_p_2ranks_resumed", first=RESUME_FROM + 1, monkeypatch=monkeypatch,
    )  # fmt: skip
    assert sorted(p.name for p in (resumed / "dump").iterdir()) == [f"step_{s}.pt" for s in
                                                                    range(RESUME_FROM + 1, KILL_STEP + 1)]
    whole = range(RESUME_FROM + 1, KILL_STEP)   # the steps the killed run finished: every dumped field bit-equal
    diffs = compare_dumped_steps(run, resumed, whole, RESUMED_EQUAL)
    assert check_reshaped_exactly_where_importance_varies(resumed / "dump", steps=whole) > 0   # not vacuous
    # the step it was killed in: the rows each rank had scored before the kill (rank 1's at least), bit-equal
    killed_rows = sorted((run / "ranks").glob(f"step_{KILL_STEP}_perturbation_rank*.pt"))
    assert killed_rows, sorted(p.name for p in (run / "ranks").iterdir())
    for path in killed_rows:
        before, after = torch.load(path), torch.load(resumed / "ranks" / path.name)
        assert (before["prompts"], before["responses"]) == (after["prompts"], after["responses"]), path.name
        for field in PER_TOKEN:
            assert all(torch.equal(a, b) for a, b in zip(before[field], after[field], strict=True)), (path.name, field)
        assert any(bool(x.any()) for x in after["oar_importance"]), path.name
    print(f"[two ranks] OAR-P resumed from step {RESUME_FROM}: steps {list(whole)} bit-equal ({diffs}), step "
          f"{KILL_STEP}'s rows of {[p.name for p in killed_rows]} bit-equal")
