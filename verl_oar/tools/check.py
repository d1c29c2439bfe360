"""``verl-oar check``: will this verl run start? A preflight for a login node (no GPU, no Ray).

    verl-oar check [--config-path DIR --config-name NAME] [--sample 64] [--responses FILE] [--json] OVERRIDES...

Takes the Hydra overrides of ``python -m verl.trainer.main_ppo`` (and a recipe's ``--config-path`` /
``--config-name``), composes the config as main_ppo does (verl's ``trainer/config/ppo_trainer.yaml`` unless a
config is named) and runs, in order, what the run's start-up runs before any GPU is used, reporting every problem
it finds in one pass (the run itself stops at the first):

1. verl's own ``validate_config`` and the typed actor / rollout configs its workers build, and what verl's trainer
   and engine workers assume of batch sizes and lengths at their first step, dynamic batch size or not
   (``tools.check_batches``: ``rollout.n``, the mini-batch over data-parallel ranks, micro-batches, the context);
2. the plugin's load and every start-up refusal of the estimator
   (``integration.validate.check_token_signals_supported``: trainer mode, ``algorithm.<method>.*`` keys,
   engine settings, each signal's checks), ``VERL_OAR_MEMORY_CHECK``, the no-answer guard's settings;
3. the block the driver logs at start-up (``integration.memory_check.startup_block``: the estimator's mode,
   its extra cost, memory per GPU), with the model's shape read from ``config.json`` on this machine only:
   a hub id that is not in the local cache is reported and its memory lines skipped (nothing is downloaded);
4. a sample of ``data.train_files`` and optional responses (``tools.check_data``).

Exit status: 0 the run would start; 1 it would not (every problem's message: cause and fix); 2 bad flags.
What only the GPUs check (the workers' memory comparison with their device, the worker classes verl picks,
vLLM, NCCL) is listed in the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from verl_oar.core.method_configs import ESTIMATOR_NODES
from verl_oar.tools.check_data import locate_answers, read_responses, sample_train_file

GPU_ONLY = (
    "the workers' memory check against their GPU (after verl builds the models; VERL_OAR_MEMORY_CHECK)",
    "the worker class verl picks for the actor (a custom worker needs verl-oar's OARWorkerMixin)",
    "vLLM / SGLang start-up, NCCL, Ray placement over nodes",
)
TOKEN_CONFIGS = ESTIMATOR_NODES
"""estimator -> its ``algorithm.<node>`` (``core.method_configs``)"""


class Refusal(Exception):
    """The run would not start: ``stage`` (what refused) and the message (cause and fix)."""

    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


def split_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this command's flags, the Hydra overrides in their order). ``--config-path X``, ``--config-path=X``,
    ``-cp X`` (and ``--config-name`` / ``-cn``) are taken as Hydra's."""
    p = argparse.ArgumentParser(prog="verl-oar check", description=__doc__.split("\n\n")[0],
                                epilog="Everything else is a Hydra override, as for python -m verl.trainer.main_ppo.")
    p.add_argument("--config-path", "-cp", default=None, help="a folder of Hydra configs, absolute (a relative one is read under verl/trainer/, as "
                        "main_ppo does); a recipe's: $PWD/recipes/config")
    p.add_argument("--config-name", "-cn", default=None, help="the config in it (default: verl's ppo_trainer)")
    p.add_argument("--sample", type=int, default=64, help="rows of the first data.train_files file to read (default 64)")
    p.add_argument("--responses", default=None,
                   help="a .jsonl or .parquet of sample responses: count the answers the answer locator finds")
    p.add_argument("--response-key", default="response", help="the responses' text field / column (default 'response')")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="also predict the workers' memory check on GPUs of this size (GiB, e.g. 80): exit 1 if they "
                        "would stop the run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--online", action="store_true",
                   help="let transformers reach the hub (default: offline, HF_HUB_OFFLINE=1: local files and cache only)")
    p.add_argument("--traceback", action="store_true", help="on an unexpected error, print its stack trace")
    args, rest = p.parse_known_args(list(argv))
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        p.error(f"unknown flag(s) {flags}; Hydra overrides look like key=value, +key=value or ~key")
    if args.sample < 1:
        p.error("--sample must be at least 1")
    return args, rest


def compose(config_path: str | None, config_name: str | None, overrides: list[str]):
    """The config ``python -m verl.trainer.main_ppo [--config-path P --config-name N] overrides`` composes."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import verl

    trainer_dir = Path(verl.__file__).parent / "trainer"
    if config_path is None:
        config_dir = trainer_dir / "config"
    elif os.path.isabs(os.path.expanduser(config_path)):
        config_dir = Path(config_path).expanduser()
    else:
        # main_ppo's Hydra resolves a relative --config-path against the file declaring @hydra.main
        # (verl/trainer/), not against the working directory
        config_dir = (trainer_dir / config_path).resolve()
        if not config_dir.is_dir():
            here = Path(config_path).resolve()
            raise Refusal("hydra", f"--config-path {config_path}: python -m verl.trainer.main_ppo resolves a relative "
                                   f"config path against verl's trainer folder ({trainer_dir}), not the working "
                                   f"directory, and {config_dir} does not exist. Give an absolute path"
                                   + (f": --config-path={here}" if here.is_dir() else "") + ".")
    if not config_dir.is_dir():
        raise Refusal("hydra", f"--config-path {config_path}: no such folder. Give the folder that holds "
                               f"{config_name or 'the config'}.yaml (a recipe's: an absolute path to recipes/config).")
    name = config_name or "ppo_trainer"
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            return hydra_compose(config_name=name, overrides=overrides)
    except Exception as err:  # noqa: BLE001 - Hydra's and OmegaConf's errors: the message is the refusal
        raise Refusal("hydra", f"the config does not compose ({config_dir}/{name}.yaml with {len(overrides)} "
                               f"override(s)): {_first_lines(err)}. Fix the override it names (+key=value adds a key "
                               "verl's config does not have; key=value sets one it has).") from None
    finally:
        GlobalHydra.instance().clear()


def _first_lines(err: BaseException, lines: int = 3) -> str:
    text = str(err).strip() or type(err).__name__
    return " ".join(text.splitlines()[:lines])


def estimator_name(config) -> str:
    est = config.algorithm.adv_estimator
    return str(getattr(est, "value", est))


def resolved_settings(config) -> dict:
    """{"algorithm.<node>": the typed config's values} of the estimator (and of CoDaPO when composed); {} when a
    node does not parse (its problems are reported)."""
    classes = _config_classes()
    try:
        return {f"algorithm.{n}": classes[n].from_algorithm(config.algorithm).to_dict() for n in _estimator_nodes(config)}
    except (TypeError, ValueError):
        return {}


def _config_classes() -> dict:
    from verl_oar.core.method_configs import NODES, config_class

    return {node: config_class(node) for node in NODES}


def _estimator_nodes(config) -> list[str]:
    name = estimator_name(config)
    nodes = [TOKEN_CONFIGS[name]] if name in TOKEN_CONFIGS else []
    if name != "codapo" and config.algorithm.get("codapo", None):
        nodes.append("codapo")
    return nodes


def run_refusals(config, problems: list[dict], model_config=None) -> list[str]:
    """Every start-up check the run makes before its GPUs are used, all of them: returns what passed and appends
    each problem (``{"stage", "message"}``) to ``problems``. ``model_config``: the model's transformers config when
    it is on this machine (its context length), else None."""
    from omegaconf import OmegaConf

    from verl_oar.tools.check_batches import batch_problems

    passed = []
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    try:
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
        passed.append("verl's validate_config and the actor / rollout configs")
    except Exception as err:  # noqa: BLE001 - verl's checks raise assorted types; each is a refusal
        problems.append({"stage": "verl", "message": f"verl's own config check refused it: {type(err).__name__}: "
                                                     f"{_first_lines(err, 6)}"})
    found = batch_problems(config, model_config)
    problems += [{"stage": "verl workers", "message": message} for message in found]
    if not found:
        passed.append("the batch sizes and lengths verl's trainer and workers assume at their first step")

    import verl.trainer.ppo.core_algos  # noqa: F401  (the plugin registers its estimators on this import)

    from verl_oar.integration import plugin

    if plugin.LOAD_ERROR:
        problems.append({"stage": "plugin", "message": "the verl-oar plugin failed to load, so its estimators refuse "
                         f"to run: {plugin.LOAD_ERROR.strip().splitlines()[-1]}. Reinstall it (pip install -e .) in "
                         "the environment verl runs in."})
        return passed
    from verl_oar.core.config import node_problems
    from verl_oar.integration.validate import LEGACY, check_token_signals_supported

    classes = _config_classes()
    cleaned = config
    for node in _estimator_nodes(config):
        messages, good = node_problems(config.algorithm, classes[node])
        problems += [{"stage": "verl-oar", "message": m} for m in messages]
        if messages:  # check the rest of the run as if the bad keys were not there
            cleaned = OmegaConf.create(OmegaConf.to_container(cleaned, resolve=False))
            OmegaConf.update(cleaned, f"algorithm.{node}", good, merge=False, force_add=True)
    v1 = config.trainer.get("v1", None) or {}
    mode = str(v1.get("trainer_mode", "sync")) if config.trainer.get("use_v1", True) else LEGACY
    providers = ()
    try:
        providers = check_token_signals_supported(cleaned, mode)
        if providers:
            from verl_oar.integration.codapo_sampling import sampling_config
            from verl_oar.integration.memory_check import check_action

            check_action()
            sampling_config(cleaned)
            for provider in providers:
                if provider.guard is not None:
                    provider.guard(cleaned)
        from verl_oar.integration.grading import grades_answers, max_ungraded_frac

        if grades_answers(cleaned):
            max_ungraded_frac(cleaned)
    except ValueError as err:
        if not any(p["message"] == str(err) for p in problems):
            problems.append({"stage": "verl-oar", "message": str(err)})
        return passed
    if providers:
        passed.append(f"verl-oar's start-up checks of {estimator_name(config)} "
                      f"({', '.join(p.name for p in providers)}; trainer mode {mode})")
    else:
        passed.append(f"{estimator_name(config)} needs no token signal: verl's own trainer runs it")
    return passed


def local_model_config(path: str, trust_remote_code: bool):
    """(transformers config, None) from local files or the hub cache only, or (None, why not)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True), None
    except Exception as err:  # noqa: BLE001 - reported, the memory lines are skipped
        where = "a local folder without a readable config.json" if Path(os.path.expanduser(path)).is_dir() else \
            "not a local folder and not in the hub cache"
        return None, (f"{path} is {where} ({type(err).__name__}); memory lines skipped, nothing downloaded. Get its "
                      f"config.json (huggingface-cli download {path} config.json) or point the path at a local copy.")


def memory_block(config, gpu_bytes: int | None = None) -> tuple[str, list[str], str | None]:
    """(the block the driver logs at start-up, notes, the workers' verdict on a GPU of ``gpu_bytes`` or None). The
    model's shape comes from local files only; when they are missing the block keeps its estimator and cost lines
    and the note says why the memory lines are not there. Raises Refusal when the predicted verdict would stop the
    workers (``VERL_OAR_MEMORY_CHECK=error``)."""
    from verl_oar.integration.memory_check import run_plan, startup_block

    plan = run_plan(config)
    model, why = local_model_config(plan["model_path"], plan["trust_remote_code"])
    teacher, teacher_why = (None, None)
    if plan["teacher_path"]:
        teacher, teacher_why = local_model_config(plan["teacher_path"], plan["trust_remote_code"])
    notes = [n for n in (why, teacher_why) if n]
    if notes:
        # a config the block cannot use: it prints its estimator and cost lines and one 'unavailable' line (ours: the note)
        lines = startup_block(config, model_config=_NO_MODEL, teacher_config=_NO_MODEL).splitlines()
        return "\n".join(line for line in lines if not line.strip().startswith("estimate ")), notes, None
    block = startup_block(config, model_config=model, teacher_config=teacher)
    verdict = None if gpu_bytes is None else predicted_verdict(plan, model, teacher, gpu_bytes, notes)
    return block, notes, verdict


def predicted_verdict(plan: dict, model_config, teacher_config, gpu_bytes: int, notes: list[str]) -> str | None:
    """The memory check each worker makes once its models are built (``memory_check.worker_verdict``), on a GPU of
    ``gpu_bytes``, with what the worker would find allocated predicted: its fp32 parameter shard (none with
    ``param_offload``; the reference model and OPPO's teacher sit on CPU between passes)."""
    from verl_oar.core.memory_estimate import ModelShape, training_state_bytes
    from verl_oar.integration.memory_check import check_action, worker_verdict

    if plan["strategy"] == "megatron" or check_action() == "off":
        notes.append("no memory verdict: the workers do not check " +
                     ("on Megatron" if plan["strategy"] == "megatron" else "(VERL_OAR_MEMORY_CHECK=off)"))
        return None
    model = ModelShape.from_hf_config(model_config)
    teacher = ModelShape.from_hf_config(teacher_config) if teacher_config is not None else None
    world = plan["data_parallel"]
    allocated = 0 if plan["param_offload"] else training_state_bytes(model, world)[0]
    role = "actor_rollout_ref" if plan["importance_role"] == "actor" else "ref"
    decision, report = worker_verdict(plan, model, teacher, gpu_bytes, allocated, world, role)
    if decision.refuse and check_action() == "error":
        raise Refusal("memory", f"predicted for a {gpu_bytes / 2**30:g} GiB GPU (the workers check this once their "
                                f"models are built): {report}")
    return report


_NO_MODEL = object()
"""stands for a model config that is not on this machine (``startup_block`` reports it as unusable, never reads it)"""


def check(argv: Sequence[str]) -> tuple[int, dict]:
    """(exit status, report) of ``verl-oar check argv``; the report is printed by :func:`main`."""
    args, overrides = split_argv(argv)
    source = (f"{args.config_path}/{args.config_name}.yaml" if args.config_path else
              f"verl's {args.config_name or 'ppo_trainer'}")
    report: dict = {"ok": False, "config": source, "overrides": overrides, "estimator": None, "settings": {},
                    "passed": [], "refusal": None, "refusals": [], "startup_block": None, "memory_verdict": None, "notes": [],
                    "data": None, "responses": None, "gpu_only": list(GPU_ONLY)}
    try:
        with contextlib.redirect_stdout(sys.stderr):  # verl's checks print; stdout is the report's (--json)
            _check(args, overrides, report)
    except Refusal as refusal:
        report["refusals"].append({"stage": refusal.stage, "message": str(refusal)})
    except Exception as err:  # noqa: BLE001 - never a bare stack trace: say what failed and how to see more
        if args.traceback:
            traceback.print_exc()
        report["refusals"].append({"stage": "unexpected", "message": f"{type(err).__name__}: {_first_lines(err, 6)} "
                                                                     "(rerun with --traceback for the stack)"})
    if report["refusals"]:
        report["refusal"] = report["refusals"][0]
        return 1, report
    report["ok"] = True
    return 0, report


def _check(args: argparse.Namespace, overrides: list[str], report: dict) -> None:
    """Fill ``report`` stage by stage, every problem into ``report["refusals"]``; raise :class:`Refusal` only where
    nothing after it can be checked (a config that does not compose)."""
    config = compose(args.config_path, args.config_name, overrides)
    problems = report["refusals"]
    report["estimator"] = estimator_name(config)
    model = config.actor_rollout_ref.model
    model_config, _ = local_model_config(str(model.path), bool(model.get("trust_remote_code", False)))
    report["passed"] = run_refusals(config, problems, model_config)
    report["settings"] = resolved_settings(config)
    from verl_oar.integration.signals import needed_signals

    if report["settings"] or not any(p["stage"] == "verl-oar" for p in problems):
        try:
            if needed_signals(config.algorithm.adv_estimator, config.algorithm):
                gpu = None if args.gpu_memory is None else int(args.gpu_memory * 2**30)
                report["startup_block"], report["notes"], report["memory_verdict"] = memory_block(config, gpu)
        except Refusal as refusal:
            problems.append({"stage": refusal.stage, "message": str(refusal)})
    data = sample_train_file(config, args.sample)
    report["data"] = data
    if data["refusal"]:
        problems.append({"stage": "data", "message": data["refusal"]})
    if args.responses:
        try:
            texts = read_responses(args.responses, args.response_key, args.sample)
            spec = (config.algorithm.get("oar", None) or {}).get("answer_locator", None)
            report["responses"] = {"file": args.responses, **locate_answers(texts, spec)}
        except ValueError as err:
            problems.append({"stage": "responses", "message": str(err)})


def render(report: dict) -> str:
    """The report as text."""
    out = [f"verl-oar check: {report['config']}" + (f" + {len(report['overrides'])} override(s)"
                                                    if report["overrides"] else "")]
    if report["estimator"]:
        out.append(f"  estimator    algorithm.adv_estimator={report['estimator']}")
    for node, values in report["settings"].items():
        out.append(f"  settings     {node}: " + ", ".join(f"{k}={v!r}" for k, v in values.items()))
    out += [f"  passed       {p}" for p in report["passed"]]
    if report["startup_block"]:
        out += ["  " + line for line in report["startup_block"].splitlines()]
    if report.get("memory_verdict"):
        out.append(f"  GPU check    (predicted) {report['memory_verdict']}")
    out += [f"  note         {n}" for n in report["notes"]]
    data = report["data"]
    if data:
        if data["ground_truths"] is not None:
            g = data["ground_truths"]
            out.append(f"  data         {data['file']}: {data['rows']} rows read; ground truths: {g['math_verify']} "
                       f"parsed by math-verify, {g['exact_only']} gradable by exact match only, {g['missing']} missing")
        out += [f"  data         {n}" for n in data["notes"]]
    r = report["responses"]
    if r:
        out.append(f"  responses    {r['file']}: the answer locator ({r['locator']}) found {r['found']} of "
                   f"{r['responses']} answers")
    if report["ok"]:
        out.append("  GPU only     " + "; ".join(report["gpu_only"]))
        out.append("OK: the run would start (exit 0)")
    else:
        count = len(report["refusals"])
        out += [f"REFUSED ({ref['stage']}): {ref['message']}" for ref in report["refusals"]]
        out.append(f"{count} problem{'s' if count > 1 else ''}: the run would not start (exit 1)")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report (text or ``--json``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--online" not in argv:  # before transformers is imported: it reads these once (OPPO's teacher check loads
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tokenizers; the model's shape is read locally anyway)
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    status, report = check(argv)
    print(json.dumps(report, indent=2, default=str) if "--json" in argv else render(report), flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
