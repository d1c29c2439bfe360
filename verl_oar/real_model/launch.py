"""verl's real trainer on a real pretrained model, on CPU: SmolLM2-135M-Instruct on the arithmetic word problems.

    python -m verl_oar.real_model.launch --adv-estimator oar_g --steps 2 [--workdir DIR] [extra hydra overrides ...]

1. prepares the model (``verl-oar prepare-model smollm2``, cached: ``$VERL_OAR_CACHE/models/smollm2``);
2. writes the task (``verl_oar.data.arithmetic``, ``TASK``) under ``--workdir``;
3. runs ``python -m verl.trainer.main_ppo`` in CPU mode (``cpu_overrides`` with the model, the task and the package's
   math reward, ``verl_oar.rewards.math_reward``), as ``python -m verl_oar.cpu.launch`` does for the tiny workspace.

The model is the Q4_1 GGUF dequantized to fp32, not the original checkpoint (docs/real-model.md).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from verl_oar.cpu.overrides import cpu_overrides, metrics_file
from verl_oar.data.arithmetic import TaskSpec

__all__ = ["TASK", "real_model_overrides", "run"]

TASK = TaskSpec(kind="sum1", example=True)
"""the task design the real-model runs train on (docs/real-model.md: how it was chosen)"""
DEFAULT_WORKDIR = Path(os.environ.get("VERL_OAR_REAL_WORKDIR", "~/.cache/verl_oar/real_model_runs")).expanduser()


def real_model_overrides(model_dir: str | os.PathLike, task_dir: str | os.PathLike, *, steps: int,
                         adv_estimator: str = "grpo", n: int = 4, batch_size: int = 4, max_prompt_length: int = 256,
                         max_response_length: int = 128, lr: float = 1e-6, seed: int = 0, micro_batch: int = 4,
                         experiment_name: str = "real_model", ranks: int = 1) -> list[str]:
    """Hydra overrides of a CPU run of ``model_dir`` on the task in ``task_dir`` (``train.parquet``,
    ``test.parquet``): the CPU mode's, then the model, data and reward. Lengths in tokens; ``lr`` AdamW's;
    ``micro_batch`` sequences per forward (every pass: the fp32 logits over SmolLM2's 49,152-token vocabulary
    and their gradient dominate the peak memory, ~0.75 GB per 16 sequences of 256 tokens and copy); ``ranks``
    FSDP2 ranks over gloo (``cpu_overrides``)."""
    task = Path(task_dir).resolve()
    return [
        *cpu_overrides(task, steps=steps, n=n, batch_size=batch_size, adv_estimator=adv_estimator,
                       max_prompt_length=max_prompt_length, max_response_length=max_response_length, lr=lr,
                       use_kl_loss=False, experiment_name=experiment_name, seed=seed, ranks=ranks),
        f"actor_rollout_ref.model.path={Path(model_dir).resolve()}",
        f"data.train_files={task / 'train.parquet'}",
        f"data.val_files={task / 'test.parquet'}",
        "reward.custom_reward_function.path=pkg://verl_oar.rewards.math_reward",
        "reward.custom_reward_function.name=compute_score",
        # packed sequences attend through a dense block-diagonal mask on CPU (docs/cpu-mode.md)
        "actor_rollout_ref.model.use_remove_padding=False",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch}",
    ]


def run(workdir: Path, *, steps: int, adv_estimator: str, extra_overrides: list[str] | None = None,
        timeout_s: float | None = None, experiment_name: str = "real_model", **settings) -> tuple[int, Path]:
    """Prepare, write the task, train; (the trainer's exit code, its metric file). ``settings``: the keyword
    arguments of :func:`real_model_overrides` (``n``, ``batch_size``, ``lr``, ``seed``, ...)."""
    import sys

    from verl_oar.cpu.launch import run_trainer
    from verl_oar.data.arithmetic import write
    from verl_oar.tools.prepare_model import prepare

    model = prepare("smollm2")
    task_dir = Path(workdir) / "task"
    write(task_dir, TASK)
    overrides = real_model_overrides(model, task_dir, steps=steps, adv_estimator=adv_estimator,
                                     experiment_name=experiment_name, **settings) + list(extra_overrides or [])
    overrides.append(f"trainer.default_local_dir={Path(workdir).resolve() / 'checkpoints'}")
    metrics = metrics_file(task_dir, experiment_name)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    return run_trainer(cmd, metrics, cwd=task_dir, timeout_s=timeout_s), metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_oar.real_model.launch", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--adv-estimator", default="grpo")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument("--timeout", type=float, default=None, help="stop the trainer after this many seconds")
    args, extra = p.parse_known_args(argv)
    rc, _ = run(args.workdir, steps=args.steps, adv_estimator=args.adv_estimator, extra_overrides=extra,
                timeout_s=args.timeout)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
