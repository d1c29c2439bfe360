"""Run a shrunk copy of a recipe (``recipes/config/<recipe>.yaml``) for a step or two on this CPU machine.

    python -m verl_oar.cpu.recipe qwen2_5_math_1_5b_oar_g [--steps 1] [--workdir DIR] [hydra overrides...]

The copy goes through the recipe's own launcher, ``bash recipes/run_<recipe>.sh``: the recipe's Hydra
config and its defaults chain, ``recipes/launch.sh``'s arguments, verl's config validation, OAR's
start-up checks and ``python -m verl.trainer.main_ppo`` are those of a cluster run. Appended
overrides (:func:`recipe_cpu_overrides`) change only

- what a CPU machine cannot run: the hf rollout instead of vLLM, pretend GPUs (one per rank, ``--ranks``,
  default 1; several ranks run FSDP2 over gloo; ``--nodes`` splits them over Ray nodes), fp32, SDPA
  attention, no torch.compile, one TransferQueue storage unit (see ``overrides.py`` for why each);
- the sizes: the tiny model and arithmetic data of the CPU workspace instead of Qwen2.5-Math and
  MATH/GSM8K, 64 + 48 tokens instead of 1024 + 3072, 2 prompts per step in 2 PPO mini-batches
  (the recipe's 128 in 2), no validation, no checkpoints, ``steps`` steps.

Everything else is the recipe's: the estimator and ``algorithm.oar``, n responses per prompt, the
loss (KL loss, clip ratio, token-mean, entropy coefficient), dynamic batch size and token budgets,
gradient checkpointing, offload, the math-verify reward.

With ``$RAY_ADDRESS`` (a running cluster's dashboard) the copy is submitted to that cluster as a Ray job by
``recipes/launch.sh``, as a cluster user's run is, and followed to its end (``ray_job``).

Only a GPU runs what the copy replaces (:data:`GPU_ONLY`). A Megatron recipe is refused here:
megatron-core needs CUDA, and its FSDP2 twin is the recipe of the same name without ``_megatron``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from verl_oar.cpu.launch import DEFAULT_WORKDIR, run_trainer
from verl_oar.cpu.overrides import metrics_file

RECIPES_DIR = Path(os.environ.get("VERL_OAR_RECIPES_DIR", Path(__file__).resolve().parents[2] / "recipes"))
"""the repository's recipes/ folder (an editable install of verl-oar); ``$VERL_OAR_RECIPES_DIR`` overrides"""

GPU_ONLY = (
    "vLLM rollout (the copy uses the hf rollout: transformers generate)",
    "Megatron engine (megatron-core needs CUDA; Megatron recipes are composed and validated only)",
    "bf16 mixed precision and flash attention (the copy runs fp32 with SDPA)",
    "NCCL and real interconnects: NCCL collectives, vLLM tensor parallel over GPUs and nodes, real bandwidth (the copy "
    "runs data-parallel FSDP2 ranks over gloo with ``--ranks``, on Ray nodes of one machine with ``--nodes`` and a "
    "cluster's ``$RAY_ADDRESS``)",
    "the real model, data and lengths (Qwen2.5-Math, MATH/GSM8K, 1024 + 3072 tokens) and their memory",
    "validation on the evaluation sets and checkpoint saving",
)
"""what a recipe has and its CPU copy does not run"""


def has_teacher(recipe: str, recipes_dir: Path = RECIPES_DIR) -> bool:
    """Whether the recipe's own YAML sets OPPO's teacher oracle (its CPU copy then needs a local teacher)."""
    from omegaconf import OmegaConf

    own = OmegaConf.load(recipes_dir / "config" / f"{recipe}.yaml")
    return OmegaConf.select(own, "algorithm.oppo.oracle", default="self") == "teacher"


RECIPE_COPY_PROMPTS = 2
"""prompts per step of a recipe's CPU copy, in two PPO mini-batches of one prompt"""
RECIPE_N = 8
"""responses per prompt of every recipe (``math_grpo.yaml``: ``rollout.n``), which the CPU copy keeps"""


def recipe_cpu_overrides(workspace_dir: str | os.PathLike, *, steps: int, experiment_name: str,
                         teacher: bool = False, ranks: int = 1, nodes: int = 1) -> list[str]:
    """Overrides appended after a recipe's own, turning it into a CPU run over the CPU workspace (``teacher``:
    OPPO's teacher becomes the workspace model, i.e. the actor's starting weights; ``ranks``: data-parallel
    ranks, as ``overrides.cpu_overrides``; a PPO mini-batch's 8 rows must split over them; ``nodes``:
    ``trainer.nnodes``, the ranks split evenly over them, ``ranks / nodes`` pretend GPUs per node)."""
    from verl_oar.cpu.overrides import check_nodes, check_ranks, own_cluster_overrides

    check_ranks(ranks, rows=RECIPE_COPY_PROMPTS * RECIPE_N, mini_batch_rows=RECIPE_N)
    check_nodes(ranks, nodes)
    ws = Path(workspace_dir).expanduser().resolve()
    fp32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    return ([f"algorithm.oppo.teacher.path={ws / 'model'}"] if teacher else []) + [
        # --- sizes: workspace model and data, short sequences, 2 prompts in 2 mini-batches ---
        f"actor_rollout_ref.model.path={ws / 'model'}",
        f"data.train_files={ws / 'data' / 'train.parquet'}",
        f"data.val_files={ws / 'data' / 'val.parquet'}",
        f"data.train_batch_size={RECIPE_COPY_PROMPTS}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "data.max_prompt_length=64",
        "data.max_response_length=48",
        "actor_rollout_ref.rollout.max_model_len=null",
        "data.dataloader_num_workers=0",
        # --- required on CPU (overrides.py says why) ---
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={fp32}",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={fp32}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={ranks // nodes}",
        f"trainer.nnodes={nodes}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        *own_cluster_overrides(ranks),  # run_trainer appends the joining ones (a job, $VERL_OAR_RAY_ADDRESS)
        # --- a short run: no validation, no checkpoints, local logging ---
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={ws / 'checkpoints'}",
        "trainer.logger=[console,file]",
        "trainer.log_val_generations=0",
        f"trainer.experiment_name={experiment_name}",
    ]


def recipe_names(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """The runnable recipes: ``recipes/config/qwen*.yaml`` (the other YAML files are shared parts)."""
    return sorted(p.stem for p in (recipes_dir / "config").glob("qwen*.yaml"))


def run(
    recipe: str,
    workdir: Path = DEFAULT_WORKDIR,
    *,
    steps: int = 1,
    experiment_name: str | None = None,
    extra_overrides: list[str] | None = None,
    timeout_s: float | None = None,
    recipes_dir: Path = RECIPES_DIR,
    ranks: int = 1,
    nodes: int = 1,
) -> int:
    """Build the CPU workspace, run ``bash recipes/run_<recipe>.sh`` shrunk, on ``ranks`` ranks over ``nodes``
    nodes; return its exit code. With ``$RAY_ADDRESS`` (a dashboard), launch.sh submits the run as a Ray job to that
    cluster and this follows it (``ray_job``): the exit code and output are the job's."""
    from verl_oar.cpu import ray_job
    from verl_oar.cpu.workspace import build_workspace

    names = recipe_names(recipes_dir)
    if recipe not in names:
        raise SystemExit(f"no recipe {recipe!r} in {recipes_dir / 'config'}; recipes: {' '.join(names)}")
    if recipe.endswith("_megatron"):
        raise SystemExit(
            f"{recipe} runs verl's Megatron engine, which needs CUDA (megatron-core); its CPU copy cannot run. "
            f"Run its FSDP2 twin instead: python -m verl_oar.cpu.recipe {recipe.removesuffix('_megatron')}"
        )
    ws = build_workspace(workdir)
    experiment_name = experiment_name or f"cpu_{recipe}"
    script = recipes_dir / f"run_{recipe}.sh"
    cmd = ["bash", str(script), *recipe_cpu_overrides(ws.root, steps=steps, experiment_name=experiment_name,
                                                      teacher=has_teacher(recipe, recipes_dir), ranks=ranks,
                                                      nodes=nodes)]
    cmd += list(extra_overrides or [])
    os.environ.setdefault("PYTHON", sys.executable)  # launch.sh's interpreter: this environment's
    os.environ.setdefault("DATA_DIR", str(ws.root / "data"))
    job = None
    if ray_job.dashboard_address():
        job = (ray_job.dashboard_address(), ray_job.new_submission_id(experiment_name))
        # launch.sh's `ray job submit`: this environment's
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return run_trainer(cmd, metrics_file(ws.root, experiment_name), cwd=ws.root, timeout_s=timeout_s, job=job)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a shrunk CPU copy of a recipe through its own launcher (VERL_PLATFORM=cpu).",
        epilog="Any further arguments are Hydra overrides, appended last. Recipes: " + " ".join(recipe_names()),
    )
    parser.add_argument("recipe", help="a recipe name, e.g. qwen2_5_math_1_5b_oar_g")
    parser.add_argument("--steps", type=int, default=1, help="training steps (default 1)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help=f"CPU workspace (default {DEFAULT_WORKDIR})")
    parser.add_argument("--experiment-name", default=None, help="names the metrics file (default cpu_<recipe>)")
    parser.add_argument("--timeout", type=float, default=None, help="stop the trainer after this many seconds")
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel FSDP2 ranks over gloo (default 1)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="trainer.nnodes, the ranks split evenly over them (default 1); with $RAY_ADDRESS (a "
                             "dashboard) the copy is submitted to that cluster as a Ray job")
    args, extra = parser.parse_known_args(argv)
    return run(
        args.recipe,
        args.workdir,
        steps=args.steps,
        experiment_name=args.experiment_name,
        extra_overrides=extra,
        timeout_s=args.timeout,
        ranks=args.ranks,
        nodes=args.nodes,
    )


if __name__ == "__main__":
    sys.exit(main())
