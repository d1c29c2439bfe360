"""Train on the pick_max testbed through ``python -m verl.trainer.main_ppo`` in CPU mode: one run per
(method, seed), one after the other in one Ray cluster (``verl_oar.cpu.ray_cluster``), with per-step
progress read from verl's file logger.

``run_overrides`` is the whole configuration of a run: ``verl_oar.cpu.overrides.cpu_overrides`` (what
CPU mode needs) plus the testbed's settings below. Methods differ only in ``algorithm.*`` (their
entries in ``testbed.methods``, a test checks it); seeds only in ``data.seed`` (prompt order), the
rollout seed (sampling), the FSDP seed and the methods' own seeds. Every run starts from the same
committed warm-started model.

Testbed settings, and why (docs/testbed.md, "Decisions"):

- 8 prompts x 8 responses per step (GRPO groups of 8, as the recipes), one PPO mini-batch per step
  (on-policy), lr 1e-3 (AdamW; chosen on GRPO alone so that it learns within the demo's steps), no KL
  loss (no reference pass);
- greedy validation on 64 held-out prompts before training and every ``val_every`` steps;
- ``use_remove_padding=False``: on CPU, packed sequences attend through a dense block-diagonal
  mask, which made the log-prob and update passes twice as slow as padded batches here;
- verl's replay buffer polls every 2 s; ``verl_oar.cpu.replay_buffer.QuickPollReplayBuffer`` polls
  every 0.05 s (verl's custom-sampler extension point), a third of a tiny step otherwise;
- runs of methods with a token signal dump their token tensors every step (``Method.dump``), which
  ``testbed.credit`` reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from verl_oar.cpu.launch import stop_process_group, trainer_env
from verl_oar.cpu.overrides import check_ranks, cpu_overrides
from verl_oar.testbed.methods import method as method_entry
from verl_oar.testbed.workspace import Testbed, max_response_tokens

REWARD = "critic/score/mean"
"""per-step mean reward of the step's responses; on pick_max it is their accuracy (1 right, 0 wrong)"""
VAL_REWARD = "val-core/verl_oar/pick_max/acc/mean@1"
"""greedy accuracy on the held-out val prompts (verl's validation, ``val_kwargs.do_sample=False``)"""


@dataclass(frozen=True)
class RunSettings:
    """What the demo's flags change; the rest of a run's configuration is fixed (module docstring)."""

    steps: int = 10
    """the demo's default (its 10-minute budget); the long run passes --steps 24. GRPO gained >= 20
    held-out points by step 8 on 3 of the long run's 5 seeds, on all 5 by step 24 (README)"""
    batch_size: int = 8
    """prompts per step"""
    mini_batch_size: int | None = None
    """prompts per PPO mini-batch: ``batch_size`` / this optimizer steps per training step (None: the
    whole step, one on-policy update; the Qwen2.5-Math recipes take two)"""
    n: int = 8
    """responses per prompt"""
    lr: float = 1e-3
    val_every: int = 4
    """validate (greedy, on ``val_prompts`` val prompts) before training and every this many steps
    (and after the last); 0 = before training and after the last step only"""
    val_prompts: int = 64
    ranks: int = 1
    """data-parallel ranks of the actor (``trainer.n_gpus_per_node``, ``cpu_overrides``' ``ranks``); the micro-batch
    is a rank's share of the mini-batch"""


def method_overrides(name: str, seed: int, neutral_id: int, bed: Testbed, dump_dir: Path | None = None) -> list[str]:
    """``algorithm.*`` overrides of a method beyond its estimator (its ``testbed.methods`` entry); with ``dump_dir``, also
    those that make it dump its token tensors there (methods with a token signal)."""
    entry = method_entry(name)  # ``cpu_overrides`` sets the estimator itself (``algorithm.adv_estimator``)
    out = list(entry.algorithm(seed, neutral_id, bed))
    if dump_dir is not None and entry.dump is not None:
        out += entry.dump(str(dump_dir))
    return out


def run_overrides(
    bed: Testbed, method: str, seed: int, settings: RunSettings, *, neutral_id: int, name: str, val_file: Path,
    dump_dir: Path | None = None,
) -> list[str]:
    """The Hydra overrides of one run (``name`` = ``trainer.experiment_name``)."""
    response_length = max_response_tokens(bed.spec)
    test_freq = settings.val_every if settings.val_every > 0 else settings.steps
    mini_batch = settings.mini_batch_size or settings.batch_size
    check_ranks(settings.ranks, rows=settings.batch_size * settings.n, mini_batch_rows=mini_batch * settings.n)
    out = cpu_overrides(
        bed.root,
        steps=settings.steps,
        n=settings.n,
        batch_size=settings.batch_size,
        adv_estimator=method_entry(method).adv_estimator,
        max_prompt_length=48,
        max_response_length=response_length,
        lr=settings.lr,
        use_kl_loss=False,
        experiment_name=name,
        seed=seed,
        ranks=settings.ranks,
    )
    out += method_overrides(method, seed, neutral_id, bed, dump_dir)
    out += [
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mini_batch * settings.n // settings.ranks}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "trainer.v1.sampler.custom_sampler.path=pkg://verl_oar.cpu.replay_buffer",
        "trainer.v1.sampler.custom_sampler.name=QuickPollReplayBuffer",
        f"data.val_files={val_file}",
        "trainer.val_before_train=True",
        f"trainer.test_freq={test_freq}",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
        f"data.val_batch_size={settings.val_prompts}",
    ]
    return out


@dataclass
class Run:
    """One training run: its command, files and (once started) process."""

    method: str
    seed: int
    cmd: list[str]
    metrics_path: Path
    log_path: Path
    cwd: Path
    dump_dir: Path | None = None
    """where the run dumps its token tensors (methods with a token signal)"""
    process: subprocess.Popen | None = None
    started: float = 0.0
    finished: float = 0.0
    returncode: int | None = None
    steps_seen: int = 0
    records: list[dict] = field(default_factory=list)
    summary: dict | None = None
    """reused from an earlier summary file (``testbed.reuse``): the run's curves and credit as that summary has
    them; the run has no metric file or dumps here"""

    @property
    def label(self) -> str:
        return f"{self.method}/seed{self.seed}"


def read_records(path: Path) -> list[dict]:
    """verl's file-logger lines ``{"step": s, "data": {...}}``; a line being written is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def train_records(records: Sequence[dict]) -> list[dict]:
    """The per-step training records (validation-only records carry no reward)."""
    return [r for r in records if REWARD in r["data"]]


class RunInterrupted(RuntimeError):
    """A trainer process was killed by a signal it did not send itself (an operator, the OOM killer): the run did
    not fail on its own, and a caller that records failures should not record it as one."""


def run_all(
    runs: Sequence[Run], *, total_steps: int, log: Callable[[str], None], timeout_s: float | None = None
) -> None:
    """Run every run, one at a time (they share one Ray cluster, and TransferQueue's controller is a
    named actor in a fixed namespace), in order; log each new step as it lands. Raises RuntimeError
    naming the first failed run and its log once every run has ended; :class:`RunInterrupted` when every
    failed run was killed by a signal from outside (not a failure of the run itself). An interrupt of this
    process (Ctrl-C) stops the running trainer too: it runs in its own session and would outlive us."""
    timed_out = set()
    for run in runs:  # the parallel scheduler of the first edition reduced to what one cluster allows
        _start(run)
        log(f"{run.label}: started (log {run.log_path})")
        try:
            while run.process.poll() is None and not (timeout_s and time.time() - run.started > timeout_s):
                time.sleep(1.0)
                _report_progress(run, total_steps, log)
        except BaseException:
            stop_process_group(run.process)
            raise
        if run.process.poll() is None:
            stop_process_group(run.process)
            timed_out.add(run.label)
            log(f"{run.label}: stopped after {timeout_s:.0f} s")
        run.returncode = run.process.returncode
        run.finished = time.time()
        _report_progress(run, total_steps, log)
        run.records = read_records(run.metrics_path)
        log(f"{run.label}: {'finished' if run.returncode == 0 else f'FAILED (exit {run.returncode})'} "
            f"in {run.finished - run.started:.0f} s")
    failed = [r for r in runs if r.returncode != 0]
    if failed and all(r.returncode < 0 and r.label not in timed_out for r in failed):
        raise RunInterrupted(f"{len(failed)} training run(s) killed by a signal from outside: "
                             + ", ".join(f"{r.label} (signal {-r.returncode})" for r in failed))
    if failed:
        tail = failed[0].log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"{len(failed)} training run(s) failed: {', '.join(r.label for r in failed)}. "
            f"The log of {failed[0].label} is {failed[0].log_path}; its end:\n{tail}"
        )


def _start(run: Run) -> None:
    run.metrics_path.parent.mkdir(parents=True, exist_ok=True)
    run.metrics_path.unlink(missing_ok=True)
    env = trainer_env(run.metrics_path)
    env.setdefault("OMP_NUM_THREADS", "1")  # a run's processes (rollout, actor, ...) share the cores
    run.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(run.log_path, "w") as log_file:  # the child keeps its own descriptor
        run.process = subprocess.Popen(
            run.cmd, env=env, cwd=str(run.cwd), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    run.started = time.time()


def _report_progress(run: Run, total_steps: int, log: Callable[[str], None]) -> None:
    records = train_records(read_records(run.metrics_path))
    for record in records[run.steps_seen :]:
        data = record["data"]
        log(
            f"{run.label}: step {record['step']}/{total_steps} reward {data[REWARD]:.3f}"
            f" ({data.get('timing_s/step', float('nan')):.1f} s/step)"
        )
    run.steps_seen = len(records)


def make_runs(
    bed: Testbed, methods: Sequence[str], seeds: Sequence[int], settings: RunSettings, *, neutral_id: int,
    out_dir: Path, val_file: Path,
) -> list[Run]:
    """One Run per (method, seed), seed-major (every method of seed 0, then of seed 1, ...): a run cut
    short leaves complete pairs behind. Files: ``out_dir/{metrics,logs,dumps}/<method>_seed<seed>``."""
    runs = []
    for seed in seeds:
        for name in methods:
            label = f"{name}_seed{seed}"
            dump_dir = out_dir / "dumps" / label
            cmd = [sys.executable, "-m", "verl.trainer.main_ppo",
                   *run_overrides(bed, name, seed, settings, neutral_id=neutral_id, name=label, val_file=val_file,
                                  dump_dir=dump_dir)]
            runs.append(Run(name, seed, cmd, out_dir / "metrics" / f"{label}.jsonl", out_dir / "logs" / f"{label}.log",
                            cwd=bed.root, dump_dir=dump_dir if method_entry(name).dump is not None else None))
    return runs
