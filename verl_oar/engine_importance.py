"""OAR-G importance computed on verl's training engine (FSDP / FSDP2), batch in, batch out.

verl extension points: the engine's own ``prepare_micro_batches`` (micro-batching and dynamic
batch size), ``engine.prepare_model_inputs`` (packing with ``use_remove_padding`` on or off),
``engine.eval_mode`` (parameter offload in and out) and ``engine.module``; checked against verl
0.9.1. It mirrors ``FSDPEngine.forward_backward_batch`` but differentiates the outcome objective
with respect to the *input embeddings only* (``torch.autograd.grad``): no parameter gradient is
computed or accumulated, no optimizer state is touched.

Layouts: verl keeps each sample as one unpadded row of prompt + response tokens (nested, jagged).
Inside a micro-batch the engine either packs rows into (1, total_nnz [+pad]) or pads them to
(bs, max_len); every per-position mask below is built in that same layout, with ``segment``
naming the sample each position belongs to (-1 on padding).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from tensordict import TensorDict

from verl_oar.answer_span import answer_token_masks
from verl_oar.config import OARConfig
from verl_oar.importance.gradient import gradient_importance_in_forward
from verl_oar.importance.noise import sequence_noise

# Fields added to the worker's TensorDict so the engine's micro-batching splits them with the rows.
_REASONING = "oar_reasoning_full"  # (bs, seq_len) nested int64: 1 on reasoning tokens
_PREDICT = "oar_predict_full"  # (bs, seq_len) nested int64: 1 where the logits predict an answer token


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _padded(nested: torch.Tensor, pad: int = 0) -> torch.Tensor:
    return torch.nested.to_padded_tensor(nested, padding=pad)


def add_outcome_masks(data: TensorDict, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Locate each response's final answer and add full-sequence masks to ``data``.

    Reads ``prompts``, ``responses`` and ``response_mask`` (nested (bs, len)). Adds ``_REASONING``
    and ``_PREDICT`` (nested (bs, prompt_len + response_len), int64 0/1).

    Returns:
        (reasoning, answer): padded (bs, max_response_len) int64 response-level masks.
    """
    responses, response_mask = data["responses"], data["response_mask"]
    prompt_lens = data["prompts"].offsets().diff().tolist()
    response_lens = responses.offsets().diff().tolist()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    resp_mask = _padded(response_mask).bool()
    reasoning, answer, _found = answer_token_masks(_padded(responses, pad_id), resp_mask, tokenizer)
    reasoning = (reasoning & resp_mask).long()
    answer = (answer & resp_mask).long()
    reasoning_rows, predict_rows = [], []
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        full_reasoning = torch.zeros(p + r, dtype=torch.int64)
        full_reasoning[p:] = reasoning[i, :r]
        full_predict = torch.zeros(p + r, dtype=torch.int64)
        full_predict[p - 1 : p + r - 1] = answer[i, :r]  # the logits at t-1 predict token t
        reasoning_rows.append(full_reasoning)
        predict_rows.append(full_predict)
    data[_REASONING] = _nested(reasoning_rows)
    data[_PREDICT] = _nested(predict_rows)
    return reasoning, answer


def _layout(micro_batch: TensorDict, output_args: dict, use_remove_padding: bool):
    """Functions that move per-sample rows into the layout the engine feeds the model, and back.

    Returns (to_layout, unlayout, targets, segment): ``to_layout(rows, fill)`` maps a list of
    per-sample (len_i, ...) tensors to (rows, cols, ...); ``unlayout(x)`` maps (rows, cols) back to a
    nested (bs, seq_len) tensor; ``targets`` (rows, cols) long is the next input id of each position;
    ``segment`` (rows, cols) long is the sample of each position, -1 on padding.
    """
    input_ids = micro_batch["input_ids"]
    offsets = input_ids.offsets()
    lengths = offsets.diff()
    bs = lengths.numel()
    ids = list(input_ids.unbind())
    if use_remove_padding:
        pad = int(output_args.get("pad_size", 0))
        nnz = int(offsets[-1])

        def to_layout(rows, fill):
            flat = torch.cat(list(rows))
            return torch.cat([flat, flat.new_full((pad, *flat.shape[1:]), fill)]).unsqueeze(0)

        def unlayout(x):
            return torch.nested.nested_tensor_from_jagged(x[0, :nnz], offsets)

        targets = output_args["input_ids_rmpad_rolled"].reshape(1, -1)
    else:

        def to_layout(rows, fill):
            return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=fill)

        def unlayout(x):
            return _nested([x[i, : int(n)] for i, n in enumerate(lengths.tolist())])

        padded_ids = to_layout(ids, 0)
        targets = torch.zeros_like(padded_ids)
        targets[:, :-1] = padded_ids[:, 1:]
    segment = to_layout([torch.full((int(n),), i, dtype=torch.long) for i, n in enumerate(lengths.tolist())], -1)
    return to_layout, unlayout, targets, segment.to(targets.device)


def _accepts_logits_to_keep(module) -> bool:
    """Whether the model's forward takes transformers' ``logits_to_keep`` (index tensor form)."""
    import inspect

    forward = getattr(getattr(module, "module", module), "forward", None)
    try:
        return "logits_to_keep" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def _micro_batch_importance(
    engine, micro_batch: TensorDict, cfg: OARConfig, step: int, with_log_probs: bool
) -> tuple[torch.Tensor, dict | None]:
    """Importance of one micro-batch: nested (bs, seq_len) float32, 0 outside reasoning tokens.

    With ``with_log_probs`` the pass also yields verl's log-prob outputs (``log_probs``, and
    ``entropy`` if the batch asks for it, nested (bs, seq_len)), computed by the engine's own
    ``prepare_model_outputs`` from the clean logits: the old-log-prob pass and importance share
    one clean forward (``noisy_kl``) or the whole pass (``loglik``).
    """
    from types import SimpleNamespace

    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name

    micro_batch = micro_batch.to(get_device_id())
    model_inputs, output_args = engine.prepare_model_inputs(micro_batch=micro_batch)
    use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
    to_layout, unlayout, targets, segment = _layout(micro_batch, output_args, use_rmpad)
    reasoning = to_layout(micro_batch[_REASONING].unbind(), 0).bool()
    predict = to_layout(micro_batch[_PREDICT].unbind(), 0).bool()
    noise = None
    if cfg.objective == "noisy_kl":
        hidden = engine.model_config.hf_config.hidden_size
        rows = sequence_noise(micro_batch["input_ids"].unbind(), hidden, cfg.seed, step)
        noise = to_layout(rows, 0.0).to(reasoning.device)

    temperature = micro_batch["temperature"]
    if isinstance(temperature, torch.Tensor) and temperature.numel() > 1:
        temp = temperature.to(torch.float32)[segment.clamp(min=0)][predict].unsqueeze(-1)  # (N, 1)
    else:
        temp = float(temperature.item() if isinstance(temperature, torch.Tensor) else temperature)

    module = engine.module
    embedding = getattr(module, "module", module).get_input_embeddings()
    autocast_dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    autocast = (
        nullcontext()
        if autocast_dtype == torch.float32
        else torch.autocast(device_type=get_device_name(), dtype=autocast_dtype)
    )

    # Only the predicting positions' logits are needed: let the model skip its output layer elsewhere
    # (a (T x V) matmul and buffer, the largest of the pass at a 150k vocabulary). A pass that also
    # yields log-probs needs every position.
    keep_cols = predict.any(dim=0).nonzero().squeeze(1)
    keep_only = _accepts_logits_to_keep(module) and not (with_log_probs and cfg.objective == "loglik")
    keep = {"logits_to_keep": keep_cols} if keep_only else {}
    outputs: dict = {}

    def run(transform, extra):
        handle = embedding.register_forward_hook(lambda _m, _i, out: transform(out))
        try:
            with autocast:
                return module(**model_inputs, use_cache=False, **extra)
        finally:
            handle.remove()

    def log_prob_outputs(raw) -> dict:
        with torch.no_grad():
            detached = SimpleNamespace(logits=raw.logits.detach())
            return engine.prepare_model_outputs(detached, output_args, micro_batch, logits_processor_func=None)

    def forward(transform):
        """The model with input embeddings replaced by ``transform(clean)``: (N, V) float32
        logits at the predicting positions, divided by the temperature."""
        raw = run(transform, keep)
        if with_log_probs and not outputs:  # loglik: this pass is the old-log-prob pass
            outputs.update(log_prob_outputs(raw))
        logits = raw.logits
        picked = logits[predict[:, keep_cols]] if keep else logits[predict]
        return picked.float() / temp

    clean_logits = None
    if with_log_probs and cfg.objective == "noisy_kl":  # the clean pass is the old-log-prob pass
        with torch.no_grad():
            raw = run(lambda e: e, {})
        outputs.update(log_prob_outputs(raw))
        clean_logits = raw.logits[predict].float() / temp
        del raw

    importance = gradient_importance_in_forward(
        forward,
        reasoning_mask=reasoning,
        predict_mask=predict,
        targets=targets,
        segment=segment,
        num_segments=int(micro_batch["input_ids"].offsets().numel() - 1),
        cfg=cfg.gradient_config(),
        noise=noise,
        clean_logits=clean_logits,
    )
    if with_log_probs and not outputs:  # nothing to differentiate: no forward ran yet
        with torch.no_grad():
            outputs.update(log_prob_outputs(run(lambda e: e, {})))
    log_probs = {k: v.detach().cpu() for k, v in outputs.items()} if with_log_probs else None
    return unlayout(importance.detach().float().cpu()), log_probs


def token_importance_on_training_worker(worker, data: TensorDict, with_log_probs: bool = False) -> TensorDict | None:
    """OAR-G importance for a batch on one rank of a ``TrainingWorker``.

    With ``with_log_probs`` it is also verl's old-log-prob pass: the output carries ``log_probs``
    and ``entropy`` exactly as ``TrainingWorker.infer_batch`` returns them.

    Args:
        worker: verl ``TrainingWorker`` (the actor's or the reference model's).
        data: the rank's shard: nested ``input_ids``/``position_ids`` (prompt + response, unpadded),
            ``prompts``, ``responses``, ``response_mask``, and non-tensor ``oar_config``, ``oar_step``,
            ``temperature``.

    Returns:
        On ranks that report outputs, a TensorDict of nested (bs, response_len) fields
        ``oar_importance`` (float32), ``oar_reasoning_mask`` and ``oar_answer_mask`` (int64), in the
        order of ``data``; ``None`` on other ranks (as verl's ``infer_batch``).
    """
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import restore_dynamic_batch
    from verl.workers.engine.utils import prepare_micro_batches

    started = time.perf_counter()
    engine = worker.engine
    cfg = OARConfig(**tu.get(data, key="oar_config"))
    step = int(tu.get(data, key="oar_step", default=0))
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

    reasoning, answer = add_outcome_masks(data, worker.model_config.tokenizer)

    with engine.eval_mode(), (engine.disable_adapter() if no_lora_adapter else nullcontext()):
        micro_batches, indices = prepare_micro_batches(
            data=data, dp_group=engine.get_data_parallel_group(), same_micro_num_in_dp=True
        )
        rows, model_outputs = [], {}
        for micro_batch in micro_batches:
            importance, outputs = _micro_batch_importance(engine, micro_batch, cfg, step, with_log_probs)
            rows.extend(importance.unbind())
            for key, value in (outputs or {}).items():
                model_outputs.setdefault(key, []).extend(value.unbind())
    dynamic = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
    importance = _nested(rows)
    model_outputs = {key: _nested(value) for key, value in model_outputs.items()}
    if dynamic:
        importance = restore_dynamic_batch(importance, indices)
        model_outputs = {key: restore_dynamic_batch(value, indices) for key, value in model_outputs.items()}

    prompt_lens = data["prompts"].offsets().diff().tolist()
    response_lens = data["responses"].offsets().diff().tolist()
    resp_rows = [row[p : p + r] for row, p, r in zip(importance.unbind(), prompt_lens, response_lens, strict=True)]
    for key in (_REASONING, _PREDICT):
        del data[key]
    if not engine.is_mp_src_rank_with_outputs():
        return None
    out = TensorDict(
        {
            "oar_importance": _nested(resp_rows),
            "oar_reasoning_mask": _nested([reasoning[i, :r] for i, r in enumerate(response_lens)]),
            "oar_answer_mask": _nested([answer[i, :r] for i, r in enumerate(response_lens)]),
            **model_outputs,
        },
        batch_size=[len(resp_rows)],
    )
    tu.assign_non_tensor(out, metrics={"oar/timing_s/importance_worker": time.perf_counter() - started})
    return out
