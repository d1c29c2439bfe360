"""Train on the chain_sum testbed through ``python -m verl.trainer.main_ppo`` in CPU mode: one run per
(method, seed), several at a time, with per-step progress read from verl's file logger.

``run_overrides`` is the whole configuration of a run: ``verl_oar.cpu.overrides.cpu_overrides`` (what
CPU mode needs) plus the testbed's settings below. Methods differ only in ``algorithm.adv_estimator``
and the ``algorithm.oar.*`` keys; seeds only in ``data.seed`` (prompt order), the rollout seed
(sampling), the FSDP seed and ``algorithm.oar.seed`` (OAR-G's noise). Every run starts from the same
warm-started model.

Testbed settings, and why:

- 8 prompts x 8 responses per step (GRPO groups of 8, as the recipes), one PPO mini-batch per step
  (on-policy), lr 1e-4 (AdamW, the tiny model's scale), no KL loss (no reference pass: it would cost
  a tenth of a step and the recipes' coefficient, 1e-3, does not act within a few dozen steps);
- ``use_remove_padding=False``: on CPU, packed sequences attend through a dense block-diagonal
  mask, which made the log-prob and update passes twice as slow as padded batches here;
- verl's replay buffer polls every 2 s; ``verl_oar.cpu.replay_buffer.QuickPollReplayBuffer`` polls
  every 0.05 s (verl's custom-sampler extension point), a third of a tiny step otherwise;
- OAR-P occludes with a space (the quality measure's neutral token, see ``testbed.quality``), exact
  mode (one copy per reasoning token, the paper's definition); OAR-G runs with the package defaults.
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
from verl_oar.cpu.overrides import cpu_overrides
from verl_oar.testbed.workspace import Testbed, max_response_tokens

METHODS = ("grpo", "oar_g", "oar_p")
"""the estimators the demo can train with (``algorithm.adv_estimator``)"""

REWARD = "critic/score/mean"
"""per-step mean reward of the step's responses; on chain_sum it is their accuracy (1 right, 0 wrong)"""
VAL_REWARD = "val-core/verl_oar/chain_sum/acc/mean@1"
"""greedy accuracy on the held-out val prompts (verl's validation, ``val_kwargs.do_sample=False``)"""


@dataclass(frozen=True)
class RunSettings:
    """What the demo's flags change; the rest of a run's configuration is fixed (module docstring)."""

    steps: int = 10
    batch_size: int = 8
    """prompts per step"""
    n: int = 8
    """responses per prompt"""
    lr: float = 1e-4
    val_every: int = 0
    """validate (greedy, on ``val_prompts`` val prompts) before training and every this many steps;
    0 = before training and after the last step only"""
    val_prompts: int = 64


def method_overrides(method: str, seed: int, neutral_id: int) -> list[str]:
    """``algorithm.*`` overrides of a method (GRPO: none beyond the estimator)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    out = [f"algorithm.adv_estimator={method}"]
    if method != "grpo":
        out.append(f"+algorithm.oar.seed={seed}")
    if method == "oar_p":
        out += ["+algorithm.oar.perturb_mode=exact", f"+algorithm.oar.perturb_token_id={neutral_id}"]
    return out


def run_overrides(
    bed: Testbed, method: str, seed: int, settings: RunSettings, *, neutral_id: int, name: str, val_file: Path
) -> list[str]:
    """The Hydra overrides of one run (``name`` = ``trainer.experiment_name``)."""
    response_length = max_response_tokens(bed.spec)
    test_freq = settings.val_every if settings.val_every > 0 else settings.steps
    out = cpu_overrides(
        bed.root,
        steps=settings.steps,
        n=settings.n,
        batch_size=settings.batch_size,
        adv_estimator=method,
        max_prompt_length=48,
        max_response_length=response_length,
        lr=settings.lr,
        use_kl_loss=False,
        experiment_name=name,
        seed=seed,
    )
    out += method_overrides(method, seed, neutral_id)
    out += [
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
    process: subprocess.Popen | None = None
    started: float = 0.0
    finished: float = 0.0
    returncode: int | None = None
    steps_seen: int = 0
    records: list[dict] = field(default_factory=list)

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


def run_all(
    runs: Sequence[Run], *, parallel: int, total_steps: int, log: Callable[[str], None], timeout_s: float | None = None
) -> None:
    """Run every run, ``parallel`` at a time, in order; log each new step as it lands. Raises
    RuntimeError naming the first failed run and its log once every run has ended."""
    queue = list(runs)
    active: list[Run] = []
    while queue or active:
        while queue and len(active) < parallel:
            run = queue.pop(0)
            _start(run)
            log(f"{run.label}: started (log {run.log_path})")
            active.append(run)
        time.sleep(1.0)
        for run in list(active):
            _report_progress(run, total_steps, log)
            if run.process.poll() is not None or (timeout_s and time.time() - run.started > timeout_s):
                if run.process.poll() is None:
                    stop_process_group(run.process)
                    log(f"{run.label}: stopped after {timeout_s:.0f} s")
                run.returncode = run.process.returncode
                run.finished = time.time()
                _report_progress(run, total_steps, log)
                run.records = read_records(run.metrics_path)
                log(f"{run.label}: {'finished' if run.returncode == 0 else f'FAILED (exit {run.returncode})'} "
                    f"in {run.finished - run.started:.0f} s")
                active.remove(run)
    failed = [r for r in runs if r.returncode != 0]
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
    env.setdefault("OMP_NUM_THREADS", "1")  # each run's processes share the cores with the other runs
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
    """One Run per (method, seed), method-major: with 2 at a time and 2 seeds, a method's runs share
    the machine with each other, so its step time is measured under the same load as the others'."""
    runs = []
    for method in methods:
        for seed in seeds:
            name = f"{method}_seed{seed}"
            cmd = [sys.executable, "-m", "verl.trainer.main_ppo",
                   *run_overrides(bed, method, seed, settings, neutral_id=neutral_id, name=name, val_file=val_file)]
            runs.append(Run(method, seed, cmd, out_dir / "metrics" / f"{name}.jsonl", out_dir / "logs" / f"{name}.log",
                            cwd=bed.root))
    return runs
