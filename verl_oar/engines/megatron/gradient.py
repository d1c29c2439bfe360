"""OAR-G on one micro-batch of verl's Megatron engine (tensor and sequence parallel, THD or BSHD).

The same importance as ``engines.fsdp.gradient`` (FSDP) and ``verl_oar.core.gradient``: Gaussian
noise on the reasoning-token embeddings, J = KL(P_final || P_final^noisy) (AS-JOINT: phi - phi~)
or J = phi (``loglik``), one backward to the embeddings, I_t = |<dJ/de_t, e_t>| or ||dJ/de_t||.
What differs on Megatron, in the order it runs:

1. layout: the micro-batch's rows go into verl's packed grid (``verl_oar.engines.megatron.layout``); masks,
   targets and the per-sequence noise (``sequence_noise``, drawn on the device for the reasoning
   tokens: the same draws as on FSDP) are built in it;
2. the embedding output is [S, B, H], sequence-first; under sequence parallelism a TP rank holds
   only its S/tp rows, so the noise and the reasoning mask are sliced to that shard;
3. the outcome comes from the logits at the predicting positions only, gathered over the TP group
   to the full vocabulary (``engines.megatron.forward``): every TP rank computes the same J;
4. ``J.backward()`` with every parameter's ``requires_grad`` switched off for the pass, so only
   the embedding leaf receives a gradient. Not ``torch.autograd.grad`` as on FSDP: Megatron's
   recomputation checkpoints refuse ``.grad()``, and its fused weight-gradient kernels write
   ``main_grad`` inside backward for any weight that requires grad. Parameters' flags and MoE
   routers' token counters (``local_tokens_per_expert``, bumped by grad-enabled forwards) are
   restored afterwards; nothing is left in ``.grad`` / ``main_grad``, the optimizer is untouched;
5. scores of the local rows are all-gathered over the TP group in rank order (sequence parallel),
   so every token gets exactly one score, the same on every TP rank, then mapped back to rows.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tensordict import TensorDict

from verl_oar.core.config import OARConfig
from verl_oar.engines.inputs import PREDICT, REASONING, nested, rollout_temperature
from verl_oar.engines.megatron.forward import MegatronLogits
from verl_oar.core.gradient import embedding_noise
from verl_oar.core.noise import sequence_noise
from verl_oar.engines.megatron.layout import token_scores
from verl_oar.core.outcome import (
    answer_log_likelihood,
    kl_to_logits,
    outcome_divergence,
    outcome_statistic,
    pooled_outcome_logits,
)


@contextmanager
def frozen_parameters(modules):
    """Switch ``requires_grad`` off on every parameter of ``modules`` that has it, restore on exit."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@contextmanager
def kept_router_counters(modules):
    """Restore MoE routers' ``local_tokens_per_expert`` (aux-loss-free load balancing statistics
    that a grad-enabled forward adds to) to their values on entry."""
    saved = [
        (m, m.local_tokens_per_expert.detach().clone())
        for module in modules
        for m in module.modules()
        if isinstance(getattr(m, "local_tokens_per_expert", None), torch.Tensor)
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, value in saved:
                m.local_tokens_per_expert.copy_(value)


def megatron_gradient_micro_batch(
    engine, micro_batch: TensorDict, cfg: OARConfig, step: int, with_log_probs: bool
) -> tuple[torch.Tensor, dict | None]:
    """Importance of one micro-batch: nested (bs, seq_len) float32, 0 outside reasoning tokens.

    With ``with_log_probs`` the pass is also verl's old-log-prob pass: the output carries verl's
    own ``log_probs`` (and ``entropy`` if the batch asks for it), nested (bs, seq_len), from the
    clean logits (``noisy_kl``) or from the one pass (``loglik``).
    """
    from verl.utils.device import get_device_id

    micro_batch = micro_batch.to(get_device_id())
    return gradient_in_megatron_forward(MegatronLogits(engine), list(engine.module), micro_batch, cfg, step, with_log_probs)


def gradient_in_megatron_forward(
    forward: MegatronLogits, modules: list, micro_batch: TensorDict, cfg: OARConfig, step: int, with_log_probs: bool
) -> tuple[torch.Tensor, dict | None]:
    """:func:`megatron_gradient_micro_batch` given the forward adaptor and the model chunks whose
    parameters are frozen for the pass (separate so that it runs on the CPU with a simulated
    tensor-parallel forward in tests); ``micro_batch`` is already on the model's device."""
    from verl.utils import tensordict_utils as tu

    input_ids = micro_batch["input_ids"]
    ids_rows = list(input_ids.unbind())
    forced_max_seqlen = tu.get_non_tensor_data(micro_batch, key="forced_max_seqlen", default=None)  # BSHD only
    layout = forward.layout([len(r) for r in ids_rows], forced_max_seqlen)
    device = ids_rows[0].device
    num = len(ids_rows)

    reasoning = layout.to_layout(list(micro_batch[REASONING].unbind()), 0).bool()  # (B, S)
    predict = layout.to_layout(list(micro_batch[PREDICT].unbind()), 0).bool()
    targets = layout.to_layout([torch.cat([r[1:], r[:1]]) for r in ids_rows], 0)   # next token (wraps: never read)
    segment = layout.to_layout(
        [torch.full((len(r),), i, dtype=torch.long, device=device) for i, r in enumerate(ids_rows)], -1
    )
    select = predict.flatten().nonzero().squeeze(1)        # predicting positions, row-major like the logits
    seg, tgt = segment.flatten()[select], targets.flatten()[select]
    temp = rollout_temperature(micro_batch)
    temp = (temp.to(device)[:num] if isinstance(temp, torch.Tensor)
            else torch.full((num,), temp, dtype=torch.float32, device=device))[seg].unsqueeze(1)  # (N, 1)
    log_prob_batch = micro_batch if with_log_probs else None
    gcfg = cfg.gradient_config()
    outputs: dict = {}

    def rows(grid_sb: torch.Tensor) -> torch.Tensor:
        return nested([r.detach().float().cpu() for r in layout.from_layout(grid_sb.transpose(0, 1))])

    if select.numel() == 0 or not bool(reasoning.any()):   # nothing to differentiate (same on every TP rank)
        if with_log_probs:
            with torch.no_grad():
                _, outputs = forward(input_ids, layout, select, log_prob_batch=micro_batch)
        zeros = torch.zeros(layout.cols, layout.rows)
        return rows(zeros), _cpu(outputs) if with_log_probs else None

    reasoning_local = forward.local_rows(reasoning.transpose(0, 1))   # [S_local, B]
    noise_local = None
    if gcfg.objective == "noisy_kl":
        draws = sequence_noise(ids_rows, forward.hidden_size, cfg.seed, step,
                               where=list(micro_batch[REASONING].unbind()), device=device)
        noise_local = forward.local_rows(layout.to_layout(draws, 0.0).transpose(0, 1))  # [S_local, B, H]

    clean = None
    if gcfg.objective == "noisy_kl":   # the clean outcome (and, fused, verl's log-probs)
        with torch.no_grad():
            logits, out = forward(input_ids, layout, select, log_prob_batch=log_prob_batch)
            outputs.update(out)
            clean = outcome_statistic(_upcast(logits) / temp, tgt, seg, num, gcfg.outcome)
            del logits

    seen: dict[str, torch.Tensor] = {}

    def perturb(e: torch.Tensor) -> torch.Tensor:
        base = e.detach()
        leaf = base.detach().requires_grad_(True)
        seen["base"], seen["leaf"] = base, leaf
        if noise_local is None:
            return leaf
        return leaf + embedding_noise(base, noise_local, reasoning_local, gcfg)

    with frozen_parameters(modules), kept_router_counters(modules), torch.enable_grad():
        fused_here = with_log_probs and gcfg.objective == "loglik"
        logits, out = forward(
            input_ids, layout, select, transform=perturb, log_prob_batch=micro_batch if fused_here else None
        )
        outputs.update(out)
        z = _upcast(logits) / temp
        del logits
        if gcfg.objective == "loglik":
            objective = answer_log_likelihood(z, tgt, seg, num).sum()
        elif gcfg.outcome == "joint":
            objective = outcome_divergence(clean, outcome_statistic(z, tgt, seg, num, gcfg.outcome), gcfg.outcome).sum()
        else:  # exact gradient softmax(z) - P, as on FSDP
            objective = kl_to_logits(clean, pooled_outcome_logits(z, seg, num, gcfg.outcome)).sum()
        del z
        if "leaf" not in seen:
            raise RuntimeError("the embedding hook did not run: GPTModel.embedding was not called")
        objective.backward()   # parameters are frozen: only the embedding leaf gets a gradient
    grad = seen["leaf"].grad
    if grad is None:
        raise RuntimeError("no gradient reached the input embeddings")
    local = token_scores(grad, seen["base"], gcfg.saliency)            # [S_local, B]
    local = torch.where(reasoning_local, local, 0.0).to(torch.float32)
    seen.clear()
    full = forward.gather_rows(local)                                   # [S, B], one score per position
    return rows(full), _cpu(outputs) if with_log_probs else None


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32 at least (bf16 upcast; float64 kept)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _cpu(outputs: dict) -> dict:
    return {k: v.detach().cpu() for k, v in outputs.items()}
