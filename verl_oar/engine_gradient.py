"""OAR-G on one micro-batch of verl's FSDP / FSDP2 engine.

verl extension points: ``engine.prepare_model_inputs`` (packing with ``use_remove_padding`` on or
off), ``engine.prepare_model_outputs`` (log-probs when fused with the old-log-prob pass) and
``engine.module``; checked against verl 0.9.1. It mirrors ``FSDPEngine.forward_backward_batch`` but
differentiates the outcome objective with respect to the *input embeddings only*
(``torch.autograd.grad``): no parameter gradient is computed or accumulated, no optimizer state is touched.
A micro-batch with nothing to score makes no model call (``gradient_importance_in_forward`` returns
zeros); that is safe with several DP ranks because the driver runs on unsharded FSDP2 parameters
(``engine_fsdp_unshard``): forwards and this backward issue no collective.

Layouts: inside a micro-batch the engine either packs rows into (1, total_nnz [+pad]) or pads them
to (bs, max_len); every per-position mask below is built in that same layout, with ``segment``
naming the sample each position belongs to (-1 on padding).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl_oar.config import OARConfig
from verl_oar.engine_inputs import PREDICT, REASONING, autocast_context, nested
from verl_oar.importance.gradient import gradient_importance_in_forward
from verl_oar.importance.hf_prefix import accepts_logits_to_keep
from verl_oar.importance.noise import sequence_noise


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
            return nested([x[i, : int(n)] for i, n in enumerate(lengths.tolist())])

        padded_ids = to_layout(ids, 0)
        targets = torch.zeros_like(padded_ids)
        targets[:, :-1] = padded_ids[:, 1:]
    segment = to_layout([torch.full((int(n),), i, dtype=torch.long) for i, n in enumerate(lengths.tolist())], -1)
    return to_layout, unlayout, targets, segment.to(targets.device)


def gradient_micro_batch(
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
    from verl.utils.device import get_device_id

    micro_batch = micro_batch.to(get_device_id())
    model_inputs, output_args = engine.prepare_model_inputs(micro_batch=micro_batch)
    use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
    to_layout, unlayout, targets, segment = _layout(micro_batch, output_args, use_rmpad)
    reasoning = to_layout(micro_batch[REASONING].unbind(), 0).bool()
    predict = to_layout(micro_batch[PREDICT].unbind(), 0).bool()
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
    autocast = autocast_context(engine)

    # Only the predicting positions' logits are needed: let the model skip its output layer elsewhere
    # (a (T x V) matmul and buffer, the largest of the pass at a 150k vocabulary). A pass that also
    # yields log-probs needs every position.
    keep_cols = predict.any(dim=0).nonzero().squeeze(1)
    keep_only = accepts_logits_to_keep(module) and not (with_log_probs and cfg.objective == "loglik")
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


