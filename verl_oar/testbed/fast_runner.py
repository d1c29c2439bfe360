"""The study's fast runner: one pick_max training run in one process, verl's math without Ray or TransferQueue.

    python -m verl_oar.testbed.fast_runner --method oar_g --seed 0 --steps 24 --lr 1e-3 --out run.jsonl \
        [--testbed DIR] [--batch-size 8 --n 8 --val-every 4 --val-prompts 64] [--dump-dir DIR]
    python -m verl_oar.testbed.fast_runner --method grpo,oar_g --seed 0,1,2 ... --out 'runs/{method}_seed{seed}.jsonl'

Several methods and seeds (comma-separated) run one after the other in one process, which pays Python's and
verl's imports (~10 s on 2 cores) once; ``--out`` (and ``--dump-dir``) then name each run with ``{method}`` and
``{seed}``.

For CPU sweeps of the pick_max testbed only (hundreds of runs on 2 cores). ``python -m verl.trainer.main_ppo``
(``testbed.training_runs``, the demo) stays the reference and the demo's path; it spends ~45-65 s per run starting
Ray, TransferQueue and the workers. This runner composes the same configuration (``training_runs.run_overrides``:
``cpu.overrides.cpu_overrides`` plus the testbed's settings and the method's ``algorithm.*``, through verl's Hydra
config) and runs the same code on it, in-process: the hf rollout server and its seeded sampler, verl's dataset,
sampler and agent-loop tokenization, the testbed's reward through verl's loader (``fast_rollout``); verl's actor
worker with OAR's importance passes on the FSDP2 engine (``fast_actor``); verl's advantage, loss, optimizer and
metric functions in the v1 trainer's order (``fast_step``). The metric file is verl's file logger's
(``{"step": s, "data": {...}}`` lines: ``critic/score/mean`` per step, ``val-core/verl_oar/pick_max/acc/mean@1`` at
step 0, every ``val_every`` steps and the last), read by ``training_runs.read_records`` / ``train_records``;
:func:`run_summary` gives the per-run entry ``testbed.comparison.compare`` takes.

Methods: ``grpo``, ``oar_g``, ``oar_p`` (exact mode, as the testbed runs it) and ``oar_p_chunk16`` (OAR-P in the
package's default chunk mode, K=16). CSCR, OPPO, ACPO and CoDaPO need signals or samplers of their own (a teacher,
modal log-probs, CoDaSampling): they stop at start-up with the main_ppo command to use instead.

Where it differs from main_ppo, and what that changes (tests/unit/test_fast_runner_on_cpu.py,
benchmarks/results_fast_runner_speed_cpu.json):

- nothing in step 1: its rollouts are main_ppo's bit for bit (the same sampler, seeds, weights, and the step's
  requests as one batch: the same multiset of (prompt, response) pairs), and on main_ppo's dumped step-1 batch (its
  rows in its order) the runner's importance, advantages, ``actor/pg_loss``, ``actor/grad_norm`` and
  ``actor/entropy`` are main_ppo's bit for bit (OAR-G, OAR-P; GRPO's on another row order within 1e-6);
- row order: main_ppo trains a step's rows in the order their rollouts finished (it differs between two main_ppo
  runs); this runner in content order (prompt ids, response ids), then verl's balancing, as main_ppo with the tests'
  content-ordered sampler. Row order can change float rounding in the update's sums (and OAR-G's importance, by
  ~3e-5 relative, tests/e2e/test_resume_on_cpu.py), so from step 2 on the weights may differ from a given main_ppo
  run's at rounding level; a sampled token changes only if its uniform draw falls within that rounding of a
  boundary of its cumulative distribution. Observed against the committed long run (main_ppo, 5 seeds x 24 steps):
  GRPO and OAR-G reproduced exactly (training reward and held-out accuracy at every point); OAR-P from step 6-11
  on differs, as two main_ppo runs of it do (the long run and a current main_ppo run of seed 0 differ from step 4):
  exact OAR-P importance moves by ~1e-7 with the row order (copies of several rows share a model call) and the
  reshaping of a row whose importance is nearly flat turns that into advantages ~1e-3 apart at step 1; over the 5
  seeds the mean reward difference is -0.001, 95% interval [-0.013, +0.008];
- the actor's engine is built with role ``actor`` (main_ppo: ``actor_rollout``, whose rollout side is the hf
  adapter that this process replaces by sending the engine's weights to the server directly); no reference
  model (the testbed runs without a KL loss); samples get deterministic uids instead of uuid4s (they only group);
  metrics of Ray/TransferQueue internals (off-policy staleness, throughput, per-token timings) are not written;
- a reward that returns the graded answer's span (``answer_span``) and importance under the reference model are
  refused (main_ppo carries them; the testbed uses neither).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from verl_oar.testbed.fast_actor import prepare_process

__all__ = ["METHODS", "compose_config", "main", "run", "run_summary"]

METHODS = {
    "grpo": ("grpo", {}),
    "oar_g": ("oar_g", {}),
    "oar_p": ("oar_p", {}),
    "oar_p_chunk16": ("oar_p", {"perturb_mode": "chunk", "perturb_budget": 16}),
    # OAR-G's ablations and tau (docs/study.md, H3 and H4)
    "oar_g_no_amplify": ("oar_g", {"amplify": "false"}),
    "oar_g_no_suppress": ("oar_g", {"suppress": "false"}),
    "oar_g_no_preserve_mass": ("oar_g", {"preserve_mass": "false"}),
    "oar_g_tau0.25": ("oar_g", {"tau": 0.25}),
    "oar_g_tau0.75": ("oar_g", {"tau": 0.75}),
}
"""runner method -> (the testbed method whose overrides it takes, ``algorithm.oar`` keys changed)"""


def load_bed(directory: str | os.PathLike | None):
    """The testbed in ``directory`` (default: the committed start); a clear error when it is not one."""
    from verl_oar.cpu.workspace import read_manifest
    from verl_oar.testbed.workspace import COMMITTED, MANIFEST, Testbed

    root = Path(directory).expanduser().resolve() if directory is not None else COMMITTED
    manifest = read_manifest(root, MANIFEST)
    missing = [p for p in ("model", "data/train.parquet", "data/val.parquet", "reward.py") if not (root / p).exists()]
    if manifest is None or missing:
        raise FileNotFoundError(
            f"{root} is not a built pick_max testbed (missing {MANIFEST if manifest is None else ', '.join(missing)}); "
            f"pass --testbed a folder written by python -m verl_oar.testbed.workspace DIR, or omit it for the "
            f"committed start")
    return Testbed(root, manifest)


def neutral_token_id(bed) -> int:
    """The token OAR-P occludes with on the testbed: a space (``testbed.quality``, what the demo passes)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bed.model_dir).encode(" ", add_special_tokens=False)[0]


def overrides_of(bed, method: str, seed: int, settings, *, val_file: Path, dump_dir: Path | None = None) -> list[str]:
    """The run's Hydra overrides: ``training_runs.run_overrides`` of the method's testbed entry (what main_ppo gets),
    with the runner method's ``algorithm.oar`` changes."""
    from verl_oar.testbed.training_runs import run_overrides

    if method not in METHODS:
        from verl_oar.testbed.fast_actor import UNSUPPORTED

        raise ValueError(f"unknown method {method!r}: " + UNSUPPORTED.format(what=method)
                         + f"; the runner knows {', '.join(METHODS)}")
    base, changes = METHODS[method]
    out = run_overrides(bed, base, seed, settings, neutral_id=neutral_token_id(bed), name=f"{method}_seed{seed}",
                        val_file=val_file, dump_dir=dump_dir)
    for key, value in changes.items():
        out = [o for o in out if not o.startswith(f"+algorithm.oar.{key}=")] + [f"+algorithm.oar.{key}={value}"]
    return out


def compose_config(overrides: Sequence[str]):
    """verl's ``ppo_trainer`` config with ``overrides``, as ``main_ppo`` composes, validates and resolves it (and as
    the trainer sets the optimizer's horizon)."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        config = compose(config_name="ppo_trainer", overrides=list(overrides))
    GlobalHydra.instance().clear()
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    OmegaConf.resolve(config)
    with open_dict(config):
        config.actor_rollout_ref.actor.optim.total_training_steps = int(config.trainer.total_training_steps)
    return config


class Batches:
    """verl's train and val dataloaders (``_init_dataloader``): ``create_rl_dataset``, ``create_rl_sampler`` with
    ``data.seed``, ``StatefulDataLoader`` and ``collate_fn``; ``train()`` restarts the iterator at an epoch's end."""

    def __init__(self, config, tokenizer, processor) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
        from verl.utils.dataset.rl_dataset import collate_fn

        data = config.data
        train = create_rl_dataset(data.train_files, data, tokenizer, processor, is_train=True,
                                  max_samples=data.get("train_max_samples", -1))
        val = create_rl_dataset(data.val_files, data, tokenizer, processor, is_train=False,
                                max_samples=data.get("val_max_samples", -1))
        self.train_loader = StatefulDataLoader(dataset=train,
                                               batch_size=data.get("gen_batch_size") or data.train_batch_size,
                                               num_workers=data["dataloader_num_workers"], drop_last=True,
                                               collate_fn=collate_fn, sampler=create_rl_sampler(data, train))
        self.val_loader = StatefulDataLoader(dataset=val, batch_size=data.val_batch_size or len(val),
                                             num_workers=data["dataloader_num_workers"],
                                             shuffle=data.get("validation_shuffle", True), drop_last=False,
                                             collate_fn=collate_fn)
        self.steps_per_epoch = len(train) // data.train_batch_size
        self._it = None

    def train(self) -> list[dict]:
        try:
            if self._it is None:
                self._it = iter(self.train_loader)
            batch = next(self._it)
        except StopIteration:
            self._it = iter(self.train_loader)
            batch = next(self._it)
        return _rows(batch)

    def val(self) -> list[list[dict]]:
        return [_rows(batch) for batch in self.val_loader]


def _rows(batch: dict) -> list[dict]:
    n = len(batch["raw_prompt"])
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def run(method: str, seed: int, settings, out: str | os.PathLike, *, testbed: str | os.PathLike | None = None,
        dump_dir: str | os.PathLike | None = None, log: Callable[[str], None] = print) -> list[dict]:
    """Train one run; write its metric file to ``out``; return its records (``read_records`` format)."""
    prepare_process()
    from verl_oar.testbed.demo import write_val_subset
    from verl_oar.testbed.fast_actor import plugin_load_error
    from verl_oar.testbed.fast_step import FastTrainer
    from verl_oar.testbed.training_runs import read_records

    if plugin_load_error() is not None:
        raise RuntimeError(f"the verl-oar plugin failed to load:\n{plugin_load_error()}")
    started = time.time()
    bed = load_bed(testbed)
    out = Path(out).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fast_runner_") as tmp:
        val_file = write_val_subset(bed, settings.val_prompts, Path(tmp) / "val_subset.parquet")
        config = compose_config(overrides_of(bed, method, seed, settings, val_file=val_file,
                                             dump_dir=Path(dump_dir).resolve() if dump_dir else None))
        trainer = FastTrainer(config)
        batches = Batches(config, trainer.rollout.tokenizer, trainer.rollout.model_config.processor)
        val_rows = batches.val()
    trainer.sync_weights(0)  # on_init_end
    logger = _file_logger(out)
    try:
        total, test_freq = int(config.trainer.total_training_steps), int(config.trainer.test_freq)
        if config.trainer.get("val_before_train", True):
            logger.log(data=_validate(trainer, val_rows), step=0)
        log(f"{method}/seed{seed}: ready in {time.time() - started:.1f} s")
        for step in range(1, total + 1):
            metrics = trainer.step(step, batches.train())
            if test_freq > 0 and (step == total or step % test_freq == 0):
                began = time.perf_counter()
                metrics.update(_validate(trainer, val_rows))
                metrics["timing_s/testing"] = time.perf_counter() - began
            metrics.update({"training/global_step": step, "training/epoch": (step - 1) // batches.steps_per_epoch})
            logger.log(data=metrics, step=step)
            log(f"{method}/seed{seed}: step {step}/{total} reward {metrics['critic/score/mean']:.3f} "
                f"({metrics['timing_s/step']:.2f} s)")
    finally:
        logger.finish()
    log(f"{method}/seed{seed}: done in {time.time() - started:.1f} s -> {out}")
    return read_records(out)


def _validate(trainer, val_rows: list[list[dict]]) -> dict:
    metrics: dict = {}
    for rows in val_rows:  # one batch at the testbed's val_batch_size (= val prompts)
        metrics.update(trainer.validate(rows))
    return metrics


def _file_logger(path: Path):
    """verl's file logger (its serialisation), writing to ``path``."""
    from verl.utils.tracking import FileLogger

    saved = os.environ.get("VERL_FILE_LOGGER_PATH")
    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        return FileLogger(project_name="verl_oar_fast", experiment_name=path.stem)
    finally:
        if saved is None:
            os.environ.pop("VERL_FILE_LOGGER_PATH", None)
        else:
            os.environ["VERL_FILE_LOGGER_PATH"] = saved


def run_summary(records: Sequence[dict], seed: int) -> dict:
    """The per-run entry ``testbed.comparison.compare`` reads (``demo.run_summary``'s curves) from a metric file's
    records."""
    from verl_oar.testbed.training_runs import REWARD, VAL_REWARD, train_records

    train = train_records(records)
    val = {r["step"]: r["data"][VAL_REWARD] for r in records if VAL_REWARD in r["data"]}
    return {
        "seed": seed,
        "reward": [r["data"][REWARD] for r in train],
        "response_length": [r["data"].get("response_length/mean") for r in train],
        "step_seconds": [r["data"].get("timing_s/step") for r in train],
        "importance_seconds": [r["data"].get("oar/timing_s/token_importance") for r in train],
        "val_accuracy": {str(k): v for k, v in sorted(val.items())},
    }


def parse_args(argv: Sequence[str] | None):
    from verl_oar.testbed.training_runs import RunSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)}, or several, comma-separated")
    p.add_argument("--seed", required=True, help="an integer, or several, comma-separated")
    p.add_argument("--steps", type=int, default=RunSettings.steps)
    p.add_argument("--lr", type=float, default=RunSettings.lr)
    p.add_argument("--out", required=True,
                   help="metric file (verl's file-logger JSON lines); with several runs a pattern with {method} "
                        "and {seed}")
    p.add_argument("--testbed", type=Path, default=None, help="a testbed folder (default: the committed start)")
    p.add_argument("--batch-size", type=int, default=RunSettings.batch_size, help="prompts per step")
    p.add_argument("--n", type=int, default=RunSettings.n, help="responses per prompt")
    p.add_argument("--val-every", type=int, default=RunSettings.val_every)
    p.add_argument("--val-prompts", type=int, default=RunSettings.val_prompts)
    p.add_argument("--dump-dir", default=None,
                   help="dump each step's token tensors (token methods); with several runs a pattern like --out")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.method.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        p.error(f"--method {args.method!r}: the fast runner carries {', '.join(METHODS)}; other methods run through "
                "python -m verl.trainer.main_ppo (python -m verl_oar.testbed.demo --methods ...)")
    try:
        args.seeds = [int(x) for x in args.seed.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seed {args.seed!r}: give integers, comma-separated")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        p.error("--seed: give distinct integers")
    several = len(args.methods) * len(args.seeds) > 1
    for name, value in (("--out", args.out), ("--dump-dir", args.dump_dir)):
        if several and value is not None and not ("{method}" in value and "{seed}" in value):
            p.error(f"{name} {value!r}: with several runs, name each with {{method}} and {{seed}}")
    if args.steps < 1 or args.batch_size < 1 or args.val_prompts < 1 or args.val_every < 0 or args.n < 2:
        p.error("--steps, --batch-size and --val-prompts must be >= 1, --val-every >= 0, --n >= 2")
    args.settings = RunSettings(steps=args.steps, batch_size=args.batch_size, n=args.n, lr=args.lr,
                                val_every=args.val_every, val_prompts=args.val_prompts)
    return args


def main(argv: Sequence[str] | None = None) -> dict[tuple[str, int], list[dict]]:
    """Run every (method, seed) of the command line, seed-major; returns each run's records."""
    args = parse_args(argv)
    out = {}
    for seed in args.seeds:
        for method in args.methods:
            path = args.out.format(method=method, seed=seed)
            dump = args.dump_dir.format(method=method, seed=seed) if args.dump_dir else None
            records = run(method, seed, args.settings, path, testbed=args.testbed, dump_dir=dump,
                          log=lambda m: print(f"[verl-oar fast {time.strftime('%H:%M:%S')}] {m}", flush=True))
            summary = run_summary(records, seed)
            print(json.dumps({"method": method, "seed": seed, "reward": summary["reward"],
                              "val_accuracy": summary["val_accuracy"]}), flush=True)
            out[(method, seed)] = records
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
