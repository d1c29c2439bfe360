"""Token importance on verl's training engine (FSDP / FSDP2 or Megatron), batch in, batch out.

The driver shared by both methods and both engines: ``gradient`` (OAR-G) and ``perturbation`` (OAR-P), one
micro-batch at a time through the engine's :class:`~verl_oar.engines.backend.ImportancePass`
(``engines.backend``: the driver never reaches into ``engines.fsdp`` or ``engines.megatron``; the FSDP2
pass keeps the ranks' model calls equal, so its parameters stay sharded). verl extension points: the
engine's own ``prepare_micro_batches`` (micro-batching and dynamic batch size, restored to the caller's
order afterwards; the same number of micro-batches on every data-parallel rank) and ``engine.eval_mode``
(parameter offload in and out); checked against verl 0.9.1.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from tensordict import TensorDict

from verl_oar.core.answer_locator import load_answer_locator
from verl_oar.core.config import OARConfig, neutral_token_id
from verl_oar.engines.backend import importance_pass
from verl_oar.engines.inputs import add_outcome_masks, nested, remove_masks
from verl_oar.engines.rank_dump import dump_rank_rows, rank_dump_dir
from verl_oar.engines.rank_errors import raised_on_every_rank

METHODS = ("gradient", "perturbation")
"""How importance is measured: OAR-G (one input gradient) or OAR-P (occlusion)."""


def _perturbation_budget(data: TensorDict, cfg: OARConfig) -> tuple[int | None, int]:
    """(tokens, rows) per OAR-P model call, from ``algorithm.oar.perturb_max_tokens`` or verl's own
    log-prob micro-batching: ``max_token_len_per_gpu`` under dynamic batch size, else the micro-batch
    size (in sequences)."""
    from verl.utils import tensordict_utils as tu

    rows = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=1) or 1)
    if cfg.perturb_max_tokens > 0:
        return cfg.perturb_max_tokens, rows
    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=False):
        return int(tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=0)), rows
    return None, rows


def token_importance_on_training_worker(worker, data: TensorDict, with_log_probs: bool = False) -> TensorDict | None:
    """Token importance for a batch on one rank of a ``TrainingWorker``.

    With ``with_log_probs`` (OAR-G only) it is also verl's old-log-prob pass: the output carries
    ``log_probs`` and ``entropy`` exactly as ``TrainingWorker.infer_batch`` returns them.

    Args:
        worker: verl ``TrainingWorker`` (the actor's or the reference model's).
        data: the rank's shard: nested ``input_ids``/``position_ids`` (prompt + response, unpadded),
            ``prompts``, ``responses``, ``response_mask``, and non-tensor ``oar_config``, ``oar_step``,
            ``temperature``, ``oar_method`` (one of :data:`METHODS`, default ``gradient``).

    Returns:
        On ranks that report outputs, a TensorDict in the order of ``data`` with nested
        (bs, response_len) fields ``oar_importance`` (float32), ``oar_reasoning_mask`` and
        ``oar_answer_mask`` (int64); (bs,) int64 ``oar_answer_source`` (where each answer came from,
        ``engines.inputs.add_outcome_masks``); for OAR-P also (bs,) float32 ``oar_perturb_copies`` (occluded
        copies scored), ``oar_perturb_passes`` (tokens fed to the model / sequence length) and
        ``oar_perturb_peak_tokens`` (the sample's largest model call, rows x tokens);
        ``None`` on other ranks (as verl's ``infer_batch``).
    """
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import restore_dynamic_batch
    from verl.workers.engine.utils import prepare_micro_batches

    engine = worker.engine
    cfg = OARConfig(**tu.get(data, key="oar_config"))
    step = int(tu.get(data, key="oar_step", default=0))
    method = tu.get(data, key="oar_method", default="gradient")
    if method not in METHODS:
        raise ValueError(f"oar_method={method!r} is invalid: must be one of {METHODS}")
    if with_log_probs and method != "gradient":
        raise ValueError("only OAR-G importance can be fused with the old-log-prob pass")
    no_lora_adapter = tu.pop(data, key="no_lora_adapter", default=False)
    defaults = dict(
        use_remove_padding=worker.model_config.get("use_remove_padding", False),
        use_dynamic_bsz=worker.engine_config.use_dynamic_bsz,
        max_token_len_per_gpu=worker.engine_config.infer_max_token_len_per_gpu,
        micro_batch_size_per_gpu=worker.engine_config.infer_micro_batch_size_per_gpu,
        use_fused_kernels=False,
    )
    for key, val in defaults.items():
        if key not in data.keys():
            tu.assign_non_tensor(data, **{key: val})
    tu.assign_non_tensor(data, sp_size=getattr(engine, "ulysses_sequence_parallel_size", 1))

    tokenizer = worker.model_config.tokenizer
    perturb = method == "perturbation"
    with raised_on_every_rank():  # the rank's own rows (and locator), before the pass's first collective
        reasoning, answer, answer_source = add_outcome_masks(
            data, tokenizer, load_answer_locator(cfg.answer_locator), line_ends=perturb and cfg.perturb_mode == "line"
        )
    if perturb:
        neutral = neutral_token_id(cfg, tokenizer)
        token_budget, rows_budget = _perturbation_budget(data, cfg)

    with (engine.eval_mode(), (engine.disable_adapter() if no_lora_adapter else nullcontext()),
          importance_pass(engine, data, cfg) as engine_pass):
        micro_batches, indices = prepare_micro_batches(
            data=data, dp_group=engine.get_data_parallel_group(), same_micro_num_in_dp=True
        )
        rows, model_outputs, copies, passes, peaks = [], {}, [], [], []
        for micro_batch in micro_batches:
            if perturb:
                importance, costs = engine_pass.perturbation(micro_batch, cfg, neutral, token_budget, rows_budget)
                lengths = micro_batch["input_ids"].offsets().diff().tolist()
                copies.extend(float(c.copies) for c in costs)
                passes.extend(c.tokens / max(n, 1) for c, n in zip(costs, lengths, strict=True))
                peaks.extend(float(c.peak_call_tokens) for c in costs)
                outputs = None
            else:
                importance, outputs = engine_pass.gradient(micro_batch, cfg, step, with_log_probs)
            rows.extend(importance.unbind())
            for key, value in (outputs or {}).items():
                model_outputs.setdefault(key, []).extend(value.unbind())
    dynamic = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
    importance = nested(rows)
    model_outputs = {key: nested(value) for key, value in model_outputs.items()}
    per_sample = {}
    if perturb:
        per_sample = {"oar_perturb_copies": torch.tensor(copies), "oar_perturb_passes": torch.tensor(passes),
                      "oar_perturb_peak_tokens": torch.tensor(peaks)}
    if dynamic:
        importance = restore_dynamic_batch(importance, indices)
        model_outputs = {key: restore_dynamic_batch(value, indices) for key, value in model_outputs.items()}
        per_sample = {key: restore_dynamic_batch(value, indices) for key, value in per_sample.items()}

    prompt_lens = data["prompts"].offsets().diff().tolist()
    response_lens = data["responses"].offsets().diff().tolist()
    resp_rows = [row[p : p + r] for row, p, r in zip(importance.unbind(), prompt_lens, response_lens, strict=True)]
    remove_masks(data)
    reasoning_rows = [reasoning[i, :r] for i, r in enumerate(response_lens)]
    answer_rows = [answer[i, :r] for i, r in enumerate(response_lens)]
    if rank_dump_dir():  # every rank's own rows, for debugging (off unless $VERL_OAR_RANK_DUMP_DIR is set)
        dump_rank_rows(rank_dump_dir(), engine, data, step=step, method=method, fused=with_log_probs,
                       importance=resp_rows, reasoning=reasoning_rows, answer=answer_rows)
    if not engine.is_mp_src_rank_with_outputs():
        return None
    out = TensorDict(
        {
            "oar_importance": nested(resp_rows),
            "oar_reasoning_mask": nested(reasoning_rows),
            "oar_answer_mask": nested(answer_rows),
            "oar_answer_source": answer_source,
            **per_sample,
            **model_outputs,
        },
        batch_size=[len(resp_rows)],
    )
    return out
