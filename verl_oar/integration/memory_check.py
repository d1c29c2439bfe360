"""The token estimator's memory at start-up: one block in the driver's log, and on each GPU a comparison with the
device that stops a run whose estimator pass cannot fit, naming the knob that brings it down.

verl extension points (checked against verl 0.9.1): none of its own. The driver calls :func:`log_startup_estimate`
when ``trainer.OARTrainerSync`` is constructed (after ``validate.check_token_signals_supported``) and
:func:`attach_memory_check` before verl builds the workers from ``config.actor_rollout_ref`` (as OPPO's teacher is
attached); each actor worker calls :func:`check_worker_memory` once verl has built its models
(``worker.OARWorkerMixin.init_model``). The formulas are ``core.memory_estimate``'s.

The driver reads the model's shape with transformers' ``AutoConfig`` from ``actor_rollout_ref.model.path`` (or
``hf_config_path``): first from local files (a directory, the hub cache), then from the hub unless offline; a
config it cannot read makes the block say why, and the run goes on (the workers still check: they hold the config).

What a GPU is compared against (``decide_fit``), and why:

- **total**: ``torch.cuda.get_device_properties(device).total_memory``.
- **resident**: what this process holds through the pass, ``torch.cuda.memory_allocated()`` right after verl's
  ``init_model`` (the sharded actor parameters; the reference model and OPPO's teacher are offloaded to CPU by
  verl's forward-only FSDP2), plus what is not allocated yet but will be during the pass: Adam's two fp32 moments
  per parameter shard, created by the first optimizer step (not with ``optimizer_offload``), and the parameter
  shard itself with ``param_offload`` (offloaded at rest, loaded for every pass).
- **the rollout**: verl 0.9's vLLM / SGLang runs as a server process of its own on the same GPUs, so nothing it
  holds is in this process's ``memory_allocated``; while the trainer computes it sleeps and frees its weights and
  KV cache (``rollout.free_cache_engine``, verl's default). Free device memory at start-up (``mem_get_info``) would
  count its ``gpu_memory_utilization`` share as taken: the wrong moment to compare. Hence: its share is counted
  only when ``free_cache_engine=false`` (it keeps it through training), and its CUDA context is in the reserve.
- **reserve**: ``RESERVE_BYTES`` or ``RESERVE_FRACTION`` of the total, whichever is larger: CUDA contexts, NCCL
  buffers, the caching allocator's fragmentation.

A run stops only when the estimator's pass is the larger of the two and does not fit; when verl's own old-log-prob
pass is estimated not to fit, the workers print a warning (that is verl's setting, and our estimate of verl's pass
is rough). ``VERL_OAR_MEMORY_CHECK`` (read by the driver): ``error`` (default: stop), ``warn`` (print, go on),
``off`` (no check). Only a GPU checks; on CPU (CPU mode, tests) the workers skip it. Megatron is not checked (the
formulas assume FSDP's layout; with tensor parallelism the per-GPU activations, caches and parameters divide by
about the TP size).
"""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from typing import Any

from verl_oar.core.memory_estimate import (
    OAR_P_MEASURED_COST,
    EstimatorSettings,
    FitDecision,
    MemoryEstimate,
    ModelShape,
    RunShape,
    decide_fit,
    estimate,
    format_bytes,
    oar_p_cost_passes,
    training_state_bytes,
)

CONFIG_NODE = "oar_memory"
"""``actor_rollout_ref.<CONFIG_NODE>``: what the workers read (set by :func:`attach_memory_check`)"""
ACTION_ENV = "VERL_OAR_MEMORY_CHECK"
ACTIONS = ("error", "warn", "off")
_DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4, "float32": 4, "float": 4}
_PREFIX = "[verl-oar]"


def check_action() -> str:
    """``VERL_OAR_MEMORY_CHECK``, validated: a wrong value stops the run at start-up."""
    action = os.environ.get(ACTION_ENV, "error").strip().lower() or "error"
    if action not in ACTIONS:
        raise ValueError(f"{ACTION_ENV}={os.environ.get(ACTION_ENV)!r} is invalid: one of {', '.join(ACTIONS)} "
                         "(error: a token estimator whose pass cannot fit its GPU stops the run at start-up; warn: "
                         "print and go on; off: no check).")
    return action


def _estimator_name(config) -> str:
    est = config.algorithm.adv_estimator
    return str(getattr(est, "value", est))


def _plain(node) -> dict:
    if node is None:
        return {}
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(node):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - verl always brings omegaconf
        pass
    return dict(node)


def estimator_settings(config) -> tuple[EstimatorSettings, str, str | None]:
    """(the estimator's settings, the model that runs its pass (``actor``, or ``ref`` under
    ``algorithm.oar.importance_model=ref``), OPPO's teacher path or None), from verl's composed config."""
    name = _estimator_name(config)
    algorithm = config.algorithm
    if name in ("oar_g", "oar_p"):
        from verl_oar.core.config import OARConfig

        oar = OARConfig.from_algorithm(algorithm)
        corr = algorithm.get("rollout_correction", None)
        bypass = bool(corr and corr.get("bypass_mode", False))
        fused = oar.fuse_log_prob and oar.importance_model == "actor" and not bypass
        model = config.actor_rollout_ref.model
        # verl's enable_gradient_checkpointing (the ref model copies the actor's model config); with activation
        # offload verl switches transformers' checkpointing off, so the OAR-G backward keeps every layer again
        checkpointing = bool(model.get("enable_gradient_checkpointing", True)) and not bool(
            model.get("enable_activation_offload", False))
        return EstimatorSettings(
            name, objective=oar.objective, fuse_log_prob=fused, gradient_checkpointing=checkpointing,
            perturb_mode=oar.perturb_mode,
            perturb_budget=oar.perturb_budget, perturb_refine_top=oar.perturb_refine_top,
            perturb_refine_unit=oar.perturb_refine_unit, perturb_max_tokens=oar.perturb_max_tokens,
            gather_params=oar.gather_params), oar.importance_model, None
    if name == "acpo":
        from verl_oar.core.acpo import ACPOConfig
        from verl_oar.engines.fsdp.modal import DEFAULT_BLOCK_BYTES

        modal = ACPOConfig.from_algorithm(algorithm).surrogate == "modal"
        return EstimatorSettings(name, acpo_modal=modal, acpo_block_bytes=DEFAULT_BLOCK_BYTES), "actor", None
    if name == "cscr":
        return EstimatorSettings(name, rescore_copies=2), "actor", None
    if name == "oppo":
        from verl_oar.core.oppo import OPPOConfig

        teacher = OPPOConfig.from_algorithm(algorithm).teacher_path
        return EstimatorSettings(name, rescore_copies=2 if teacher else 1), "actor", teacher
    return EstimatorSettings(name), "actor", None


def _budget(node, sequence: int) -> tuple[int, str, int]:
    """(tokens of one log-prob micro-batch, the key that sets it, its value) of a role's config node (``rollout``
    for the actor's old-log-prob pass, ``ref`` for the reference model's and OPPO's teacher's)."""
    if node.get("log_prob_use_dynamic_bsz", False):
        value = int(node.get("log_prob_max_token_len_per_gpu", None) or sequence)
        return max(value, sequence), "log_prob_max_token_len_per_gpu", value
    value = int(node.get("log_prob_micro_batch_size_per_gpu", None) or 1)
    return value * sequence, "log_prob_micro_batch_size_per_gpu", value


def run_plan(config) -> dict[str, Any]:
    """Everything the estimate needs from verl's config except the model's shape, as plain values (what the driver
    logs and hands the workers)."""
    settings, role, teacher = estimator_settings(config)
    aref = config.actor_rollout_ref
    data = config.get("data", None) or {}
    prompt = int(data.get("max_prompt_length", None) or aref.rollout.get("prompt_length", 0) or 0)
    response = int(data.get("max_response_length", None) or aref.rollout.get("response_length", 0) or 0)
    actor = aref.actor
    strategy = str(actor.get("strategy", "fsdp2"))
    fsdp_config = (actor.get("fsdp_config", None) or {}) if strategy in ("fsdp", "fsdp2") else {}
    dtype = str((fsdp_config.get("mixed_precision", None) or {}).get("param_dtype", "bf16"))
    override = aref.model.get("override_config", None) or {}
    node = "ref" if role == "ref" else "rollout"
    tokens, key, value = _budget(aref[node], prompt + response)
    if teacher:  # the teacher has the reference model's engine settings (integration.teacher)
        teacher_tokens, teacher_key, _ = _budget(aref.ref, prompt + response)
        settings = replace(settings, teacher_micro_batch_tokens=teacher_tokens)
    trainer = config.get("trainer", None) or {}
    return {
        "settings": asdict(settings),
        "run": asdict(RunShape(micro_batch_tokens=tokens, prompt_tokens=prompt, response_tokens=response,
                               dtype_bytes=_DTYPE_BYTES.get(dtype.lower(), 2), fsdp=strategy in ("fsdp", "fsdp2"),
                               attention=str(override.get("attn_implementation", "flash_attention_2")))),
        "dtype": dtype,
        "budget_knob": f"actor_rollout_ref.{node}.{key}",
        "budget_value": value,
        "teacher_path": teacher,
        "teacher_knob": f"actor_rollout_ref.ref.{teacher_key}" if teacher else None,
        "strategy": strategy,
        "importance_role": role,
        "data_parallel": int(trainer.get("n_gpus_per_node", 1) or 1) * int(trainer.get("nnodes", 1) or 1),
        "param_offload": bool(fsdp_config.get("param_offload", False)),
        "optimizer_offload": bool(fsdp_config.get("optimizer_offload", False)),
        "free_cache_engine": bool(aref.rollout.get("free_cache_engine", True)),
        "gpu_memory_utilization": float(aref.rollout.get("gpu_memory_utilization", 0.5) or 0.0),
        "model_path": str(aref.model.get("hf_config_path", None) or aref.model.path),
        "trust_remote_code": bool(aref.model.get("trust_remote_code", False)),
    }


def _settings(plan: dict, teacher: ModelShape | None = None) -> tuple[EstimatorSettings, RunShape]:
    return EstimatorSettings(**{**plan["settings"], "teacher": teacher}), RunShape(**plan["run"])


def read_model_config(path: str, trust_remote_code: bool = False):
    """A transformers config from local files, else (unless offline) from the hub; raises OSError / ValueError."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError):
        if any(os.environ.get(key, "0") not in ("0", "") for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
            raise
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def _mode_line(s: EstimatorSettings, run: RunShape) -> str:
    """The estimator, its mode and what its pass costs, in a line (needs no model shape)."""
    if s.name == "oar_g":
        passes = "fused into verl's old-log-prob pass (its clean forward shared)" if s.fuse_log_prob else \
            "a pass of its own"
        extra = "its forward with grad, + 1 input-gradient backward" if s.objective == "loglik" and s.fuse_log_prob \
            else "+ 1 forward with grad + 1 input-gradient backward"
        return f"OAR-G, objective={s.objective}, {passes}: {extra}"
    if s.name == "oar_p":
        k = {"exact": "every reasoning token", "chunk": f"K={s.perturb_budget}", "line": f"K={s.perturb_budget}",
             "hierarchical": f"K={s.perturb_budget}, m={s.perturb_refine_top}, u={s.perturb_refine_unit}"}
        line = (f"OAR-P (occlusion), perturb_mode={s.perturb_mode}, {k[s.perturb_mode]}: "
                f"~{oar_p_cost_passes(run, s):.1f} log-prob passes of tokens per response (derived from the scoring "
                f"stages at {run.prompt_tokens} + {run.response_tokens} tokens)")
        key = f"{s.perturb_mode} K={s.perturb_budget}"
        measured = OAR_P_MEASURED_COST.get(key)
        line += f"; measured time: {measured:.1f}x a log-prob pass" if measured else "; GPU time not measured"
        return line
    if s.name == "acpo":
        return ("ACPO, surrogate=modal: the top-1 log-prob inside verl's old-log-prob pass" if s.acpo_modal else
                "ACPO, surrogate sampled / shannon: verl's own log-probs / entropy")
    if s.name == "cscr":
        return "CSCR: verl's compute_log_prob over 2 x the batch (the two privileged templates)"
    if s.name == "oppo":
        if s.teacher_micro_batch_tokens:
            return "OPPO, oracle=teacher: the frozen teacher's log-probs over 2 x the batch (rollout, oracle prompt)"
        return "OPPO, oracle=self: verl's compute_log_prob over 1 x the batch (the oracle prompt)"
    return "CoDaPO: verl's old log-probs, no pass of its own"


def _terms(terms) -> str:
    return ", ".join(f"{'~' if t.rough else ''}{t.name} {format_bytes(t.bytes)}" for t in terms if t.bytes) or "-"


def _shape_line(model: ModelShape) -> str:
    return (f"{model.parameters() / 1e9:.2f}B parameters: hidden {model.hidden}, {model.layers} layers, "
            f"{model.heads}/{model.kv_heads} heads x {model.head_dim}, MLP {model.intermediate}, vocab {model.vocab}"
            f"{', tied embeddings' if model.tied else ''}")


def estimate_lines(plan: dict, model: ModelShape, teacher: ModelShape | None = None) -> list[str]:
    """The estimate's lines of the block (model, budget, both passes, extra, training state)."""
    settings, run = _settings(plan, teacher)
    est = estimate(model, run, settings)
    dp = plan["data_parallel"]
    params, adam = training_state_bytes(model, dp)
    lines = [
        f"  model        {plan['model_path']}: {_shape_line(model)}; computes in {plan['dtype']}",
        f"  budget       {run.tokens} tokens per log-prob micro-batch ({plan['budget_knob']}="
        f"{plan['budget_value']}); sequences of {run.sequence} ({run.prompt_tokens} + {run.response_tokens}): "
        f"{run.samples} per micro-batch",
        f"  verl's old-log-prob pass  {format_bytes(est.verl_bytes):>9}  ({_terms(est.verl_terms)})",
    ]
    if est.pass_terms:
        lines.append(f"  {settings.name} pass{' ' * (21 - len(settings.name))}{format_bytes(est.pass_bytes):>9}  "
                     f"({_terms(est.pass_terms)})")
    lines.append(f"  extra over verl's pass    {format_bytes(est.extra_bytes):>9}  -> peak "
                 f"{format_bytes(est.peak_bytes)} per GPU above the training state")
    adam = 0 if plan["optimizer_offload"] else adam
    lines.append(f"  training state per GPU    {format_bytes(params + adam):>9}  (fp32 parameter shard "
                 f"{format_bytes(params)}, Adam {format_bytes(adam)}; {dp} GPU{'s' if dp > 1 else ''}"
                 f"{', parameters offloaded between passes' if plan['param_offload'] else ''}"
                 f"{', Adam offloaded' if plan['optimizer_offload'] else ''})")
    lines += [f"  note         {note}" for note in est.notes]
    if plan["strategy"] == "megatron":
        lines.append(f"  note         Megatron: these are FSDP's formulas; with tensor parallelism the activations, "
                     "caches and parameters per GPU divide by about its size")
    return lines


def startup_block(config, model_config=None, teacher_config=None) -> str:
    """The block the driver logs: the estimator, its mode, the memory estimate per GPU. ``model_config`` (a
    transformers config) is read from ``actor_rollout_ref.model.path`` when not given; if that fails the block says
    the estimate is unavailable and why. Never raises for an unreadable model config."""
    plan = run_plan(config)
    settings, run = _settings(plan)
    head = [f"{_PREFIX} memory estimate per GPU (rough terms marked ~; bytes above the training state):",
            f"  estimator    {settings.name}: {_mode_line(settings, run)}"]
    try:
        if model_config is None:
            model_config = read_model_config(plan["model_path"], plan["trust_remote_code"])
        model, teacher = ModelShape.from_hf_config(model_config), None
        if plan["teacher_path"]:
            teacher = ModelShape.from_hf_config(teacher_config or read_model_config(plan["teacher_path"],
                                                                                    plan["trust_remote_code"]))
        lines = estimate_lines(plan, model, teacher)
    except Exception as err:  # noqa: BLE001 - any failure to read or to use the config is reported, never fatal
        paths = " or ".join(repr(p) for p in (plan["model_path"], plan["teacher_path"]) if p)
        lines = [f"  estimate     unavailable: the model config at {paths} could not be read or used "
                 f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). The workers still compare "
                 "their GPU with the estimate once they have loaded the model."]
    action = os.environ.get(ACTION_ENV, "error")
    tail = (f"  check        the workers compare this with their GPU after loading the model ({ACTION_ENV}={action})"
            if plan["strategy"] != "megatron" else "  check        not on Megatron (the formulas assume FSDP's layout)")
    return "\n".join(head + lines + [tail])


def log_startup_estimate(config) -> str:
    """Print :func:`startup_block` (never stops the run: any failure is printed instead) and return it."""
    try:
        block = startup_block(config)
    except Exception as err:  # noqa: BLE001 - a start-up log must not stop a run the refusals allow
        block = f"{_PREFIX} memory estimate unavailable: {type(err).__name__}: {err}"
    print(block, flush=True)
    return block


def attach_memory_check(config) -> None:
    """Put what the workers' check needs into ``actor_rollout_ref.oar_memory`` (before verl builds the workers)."""
    from omegaconf import open_dict

    plan = {**run_plan(config), "action": check_action()}
    with open_dict(config.actor_rollout_ref):
        config.actor_rollout_ref[CONFIG_NODE] = plan


def knobs(plan: dict, model: ModelShape, usable: int, teacher: ModelShape | None = None) -> list[str]:
    """The settings that bring the estimator's pass within ``usable`` bytes, each with the value that does (pure)."""
    settings, run = _settings(plan, teacher)
    name, out = settings.name, []

    def fits(s: EstimatorSettings = settings, r: RunShape = run) -> bool:
        return estimate(model, r, s).pass_bytes <= usable

    if settings.gather_params and fits(replace(settings, gather_params=False)):
        out.append("algorithm.oar.gather_params=false (FSDP's per-layer gathers instead of the whole model: "
                   f"{format_bytes(model.parameters() * run.dtype_bytes)} less)")
    if name == "oar_p":
        budgets = list(range(256, run.tokens + 1, 256))
        best = _largest(budgets, lambda v: fits(replace(settings, perturb_max_tokens=v)))
        if best is not None and best < (settings.perturb_max_tokens or run.tokens):
            out.append(f"algorithm.oar.perturb_max_tokens={best} (tokens per OAR-P model call; now "
                       f"{settings.perturb_max_tokens or run.tokens})")
        if settings.perturb_mode != "chunk" and fits(replace(settings, perturb_mode="chunk")):
            out.append(f"algorithm.oar.perturb_mode=chunk (K={settings.perturb_budget} copies per response instead of "
                       f"{settings.perturb_mode}'s)")
    if name == "oar_g" and settings.objective == "loglik" and settings.fuse_log_prob \
            and fits(replace(settings, fuse_log_prob=False)):
        out.append("algorithm.oar.fuse_log_prob=false (objective=loglik fused keeps verl's full logits beside the "
                   "activations)")
    if name in ("oar_g", "oar_p", "acpo"):
        knob = plan["budget_knob"]
        if knob.endswith("max_token_len_per_gpu"):
            values = list(range(run.sequence, run.tokens + 1, 256))
            best = _largest(values, lambda v: fits(r=replace(run, micro_batch_tokens=v)))
        else:
            values = list(range(1, plan["budget_value"] + 1))
            best = _largest(values, lambda v: fits(r=replace(run, micro_batch_tokens=v * run.sequence)))
        if best is not None and best < plan["budget_value"]:
            out.append(f"{knob}={best} (now {plan['budget_value']}; verl's own old-log-prob pass shrinks with it)")
        elif best is None:
            out.append(f"{knob}: even one sequence of {run.sequence} tokens does not fit; shorter sequences "
                       "(data.max_response_length) or a GPU with more memory")
    if name == "oar_g":
        oar_p = estimate(model, run, EstimatorSettings("oar_p")).pass_bytes
        if not settings.gradient_checkpointing and fits(replace(settings, gradient_checkpointing=True)):
            out.append("actor_rollout_ref.model.enable_gradient_checkpointing=true (and enable_activation_offload="
                       "false): the OAR-G backward then keeps each layer's input, not its activations")
        out.append(f"algorithm.adv_estimator=oar_p (no backward; its pass ~{format_bytes(oar_p)})")
    if name == "acpo" and settings.acpo_modal:
        out.append("+algorithm.acpo.surrogate=sampled (reads verl's log-probs, no block of its own)")
    if name == "oppo" and teacher is not None:
        values = list(range(run.sequence, max(settings.teacher_micro_batch_tokens, run.sequence) + 1, 256))
        best = _largest(values, lambda v: fits(replace(settings, teacher_micro_batch_tokens=v)))
        if best is not None and best < settings.teacher_micro_batch_tokens:
            out.append(f"{plan['teacher_knob']}: {best} tokens per teacher micro-batch (now "
                       f"{settings.teacher_micro_batch_tokens})")
        out.append("+algorithm.oppo.oracle=self (no teacher)")
    return out


def _largest(values: list[int], fits) -> int | None:
    """The largest of ``values`` (ascending) that ``fits``, by bisection (memory grows with each value)."""
    lo, hi, best = 0, len(values) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(values[mid]):
            best, lo = values[mid], mid + 1
        else:
            hi = mid - 1
    return best


def fit_report(plan: dict, model: ModelShape, decision: FitDecision, est: MemoryEstimate, total: int, resident: int,
               rollout_held: int, teacher: ModelShape | None = None) -> str:
    """The worker's verdict: the numbers, and when the pass does not fit, the knobs that bring it down (pure)."""
    name = plan["settings"]["name"]
    rollout = f" - rollout engine {format_bytes(rollout_held)}" if rollout_held else ""
    numbers = (f"GPU {format_bytes(total)} - training state {format_bytes(resident)}{rollout} - reserve "
               f"{format_bytes(decision.reserve)} = {format_bytes(decision.usable)} usable; {name}'s pass needs "
               f"{format_bytes(est.pass_bytes)} ({_terms(est.pass_terms)}), verl's old-log-prob pass "
               f"{format_bytes(est.verl_bytes)}")
    if decision.refuse:
        fixes = knobs(plan, model, decision.usable, teacher)
        listed = "".join(f"\n  - {fix}" for fix in fixes) or "\n  - none of verl-oar's settings: a GPU with more memory"
        return (f"{_PREFIX} algorithm.adv_estimator={name} cannot fit this GPU: {numbers}. Bring it down with one of:"
                f"{listed}\n(The estimate is verl_oar/core/memory_estimate.py's; {ACTION_ENV}=warn runs anyway.)")
    verdict = "fits" if decision.verl_fits else ("fits beside verl's pass, but verl's own old-log-prob pass is "
                                                 "estimated not to fit (rough; its budget is verl's setting)")
    return f"{_PREFIX} memory check: {name} {verdict}: {numbers}."


def worker_verdict(plan: dict, model: ModelShape, teacher: ModelShape | None, total: int, allocated: int,
                   world: int, role: str) -> tuple[FitDecision, str]:
    """The decision and its report for a GPU of ``total`` bytes on which this process holds ``allocated`` bytes
    after verl's ``init_model``, in a data-parallel group of ``world`` ranks, for a worker of verl role ``role``
    (module docstring: what is added to ``allocated``, and when the rollout's share counts). Pure."""
    settings, run = _settings(plan, teacher)
    est = estimate(model, run, settings)
    params, adam = training_state_bytes(model, world)
    resident = allocated + (params if plan["param_offload"] else 0) + (0 if plan["optimizer_offload"] else adam)
    rollout_held = 0
    if "rollout" in role and not plan["free_cache_engine"]:
        rollout_held = int(plan["gpu_memory_utilization"] * total)
    decision = decide_fit(est, total, resident, rollout_held)
    return decision, fit_report(plan, model, decision, est, total, resident, rollout_held, teacher)


def check_worker_memory(worker) -> str | None:
    """On a CUDA worker that runs the estimator's pass: compare the estimate with the device (:func:`worker_verdict`);
    raise RuntimeError naming the knobs when the pass cannot fit (``VERL_OAR_MEMORY_CHECK=error``), else print the
    verdict (rank 0). Returns the verdict, or None where nothing was checked (no plan, CPU, Megatron, a worker that
    does not run the pass). Only reachable on a GPU: the device numbers are CUDA's."""
    plan = worker.config.get(CONFIG_NODE, None)
    if not plan:
        return None
    plan = _plain(plan)
    role = str(getattr(worker, "role", "actor_rollout_ref"))
    if plan.get("action", "error") == "off" or plan["strategy"] == "megatron" or plan["importance_role"] not in role:
        return None
    import torch

    if not torch.cuda.is_available():  # CPU mode: nothing to compare against
        return None
    trainer = getattr(worker, plan["importance_role"], None) or getattr(worker, "actor", None)  # LoRA: ref = actor
    if trainer is None:
        return None
    hf_config = trainer.model_config.hf_config
    attention = getattr(hf_config, "_attn_implementation", None) or plan["run"]["attention"]
    plan["run"] = {**plan["run"], "attention": attention}
    teacher = getattr(worker, "oar_teacher", None)
    teacher = ModelShape.from_hf_config(teacher.model_config.hf_config) if teacher is not None else None
    device = torch.cuda.current_device()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else plan["data_parallel"]
    decision, report = worker_verdict(plan, ModelShape.from_hf_config(hf_config), teacher,
                                      torch.cuda.get_device_properties(device).total_memory,
                                      torch.cuda.memory_allocated(device), world, role)
    if decision.refuse and plan.get("action", "error") == "error":
        raise RuntimeError(report)
    if decision.refuse or getattr(worker, "rank", 0) == 0:
        print(report, flush=True)
    return report
