"""OAR-G on one micro-batch of verl's FSDP / FSDP2 engine.

verl extension points: ``engine.prepare_model_inputs`` (packing with ``use_remove_padding`` on or
off), ``engine.prepare_model_outputs`` (log-probs when fused with the old-log-prob pass) and
``engine.module``; checked against verl 0.9.1. It mirrors ``FSDPEngine.forward_backward_batch`` but
differentiates the outcome objective with respect to the *input embeddings only*
(``torch.autograd.grad``): no parameter gradient is computed or accumulated, no optimizer state is touched.
A micro-batch with nothing to score makes no model call (``gradient_importance_in_forward`` returns
zeros), unless another rank's micro-batch has something (``peers``, ``engines.fsdp.lockstep``): FSDP2 then
gathers in every forward and in the backward, so this rank makes the same calls on a stand-in (one
predicting and one scored position: the same forwards, the same backward through every layer) and
returns zeros; with ``with_log_probs`` its log-probs are the real ones (they do not depend on the masks).

Gradient checkpointing: verl calls ``gradient_checkpointing_enable()`` on the model for
``actor_rollout_ref.model.enable_gradient_checkpointing=true`` (its default), but runs this pass inside
``engine.eval_mode()``, where transformers' layers do not checkpoint (only when ``training``): the backward kept
every layer's activations (tens of GiB at the recipes' 6-16k-token budgets). ``core.hf.OutcomeHead`` therefore
checkpoints the layers whose flag is set itself, in its call with grad: each layer's ``forward`` is shadowed for
that call by ``torch.utils.checkpoint`` (non-reentrant) around the original, so the backward keeps each layer's
input and recomputes its activations. Chosen over putting the layers in training mode, which would also switch on
any layer-level dropout (OPT, Falcon, ... read ``self.training`` in their layer's forward) and any other
train/eval difference; shadowing ``forward`` changes nothing but what autograd keeps. Exact: the recomputation runs
the same kernels on the same inputs under the forward's autocast, so importance is bit-identical to the pass
without it (fp32 and bf16, tests), and the clean and verl's log-prob forwards (no grad) are untouched. FSDP2: the
shadowed ``forward`` runs inside the layer's ``__call__``, after FSDP2's pre-forward all-gather; in the backward
FSDP2's pre-backward hook all-gathers the layer as it does without checkpointing and the recomputation reads those
unsharded parameters (FSDP2's own forward hooks do not run again), so every rank makes the same all-gathers as
before, as many with checkpointing as without (tests/engine/test_engine_multirank_on_cpu.py).

Layouts: inside a micro-batch the engine either packs rows into (1, total_nnz [+pad]) or pads them
to (bs, max_len); every per-position mask below is built in that same layout, with ``segment``
naming the sample each position belongs to (-1 on padding).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl_oar.core.config import OARConfig
from verl_oar.engines.inputs import PREDICT, REASONING, autocast_context, nested, rollout_temperature
from verl_oar.core.gradient import gradient_importance_in_forward
from verl_oar.core.hf import OutcomeHead
from verl_oar.core.noise import layout_noise


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


def _stand_in(mask: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) bool mask that is True at the first position only (sample 0's first token in both
    layouts)."""
    out = torch.zeros_like(mask)
    out[0, 0] = True
    return out


def gradient_micro_batch(
    engine, micro_batch: TensorDict, cfg: OARConfig, step: int, with_log_probs: bool, peers=None, errors=None
) -> tuple[torch.Tensor, dict | None]:
    """Importance of one micro-batch: nested (bs, seq_len) float32, 0 outside reasoning tokens.

    ``peers`` (an ``engines.fsdp.lockstep.Lockstep``, or None on one rank / with gathered parameters):
    every rank asks it once per micro-batch whether any rank differentiates; if one does, so does this
    rank (on a stand-in when it has nothing to score). ``errors`` (an ``engines.rank_errors.RankErrors``, or
    None): :meth:`OutcomeHead.check` on this rank's rows is deferred to it, so that a failing rank makes the same
    calls as the others until the pass's end, where every rank raises.

    With ``with_log_probs`` the pass also yields verl's log-prob outputs (``log_probs``, and
    ``entropy`` if the batch asks for it, nested (bs, seq_len)), exactly as verl's ``forward_step``
    computes them: the same model call and the engine's ``prepare_model_outputs``, both inside the
    engine's autocast context. The old-log-prob pass and importance share one clean forward
    (``noisy_kl``) or the whole pass (``loglik``).

    Every pass computes the outcome logits the same way (:class:`OutcomeHead` on the final hidden
    states at the predicting positions), so that with zero noise the clean and the noisy outcome are
    bit-identical: J = 0 and dJ/de = 0 exactly, in bf16 as in fp32.
    """
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
        noise = layout_noise(micro_batch["input_ids"].unbind(), micro_batch[REASONING].unbind(), reasoning,
                             hidden, cfg.seed, step)
    scoring = bool(predict.any()) and bool(reasoning.any())  # else core makes no model call
    stand_in = peers is not None and peers.anyone(scoring) and not scoring
    if stand_in:  # the same calls as the ranks that differentiate (zero noise); the result is discarded
        reasoning, predict = _stand_in(reasoning), _stand_in(predict)
    temp = rollout_temperature(micro_batch)  # per predicting position (N, 1), or one float
    if isinstance(temp, torch.Tensor):
        temp = temp[segment.clamp(min=0)][predict].unsqueeze(-1)
    head = OutcomeHead(engine.module, predict, temp, autocast_context(engine))
    if errors is not None:  # shadows the method on this instance: ``head.run`` calls ``self.check``
        head.check = errors.deferred(head.check)
    outputs: dict = {}

    def log_prob_outputs(raw) -> dict:
        """verl's forward_step post-processing of the model output (inside the engine's autocast)."""
        with torch.no_grad(), autocast_context(engine):
            return engine.prepare_model_outputs(raw, output_args, micro_batch, logits_processor_func=None)

    def forward(transform):
        """The model with input embeddings replaced by ``transform(clean)``: (N, V) float32
        outcome logits at the predicting positions, divided by the temperature."""
        fused_here = with_log_probs and cfg.objective == "loglik" and not outputs
        raw, logits = head.run(model_inputs, transform, full_logits=fused_here)
        if fused_here:  # loglik: this pass is the old-log-prob pass
            outputs.update(log_prob_outputs(raw))
        return logits

    clean_logits = None
    if with_log_probs and cfg.objective == "noisy_kl":  # the clean pass is the old-log-prob pass
        with torch.no_grad():
            raw, clean_logits = head.run(model_inputs, None, full_logits=True)
            outputs.update(log_prob_outputs(raw))
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
    if stand_in:
        importance = torch.zeros_like(importance)
    if with_log_probs and not outputs:  # nothing to differentiate: no forward ran yet
        with torch.no_grad():
            raw, _ = head.run(model_inputs, None, full_logits=True)
            outputs.update(log_prob_outputs(raw))
    log_probs = {k: v.detach().cpu() for k, v in outputs.items()} if with_log_probs else None
    return unlayout(importance.detach().float().cpu()), log_probs
