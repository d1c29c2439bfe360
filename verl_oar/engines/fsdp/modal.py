"""ACPO's modal (top-1) log-probability, computed inside verl's own old-log-prob pass on the FSDP engine.

``log p_max,t = max_v z_{t,v} / T - logsumexp_v(z_{t,v} / T)``: the log-probability of the most likely
next token at every position, at the pass's temperature ``T``, from the logits that pass already holds.

How (verl 0.9.1; with upstream PR logits-reducers the same reduction runs as verl's logits reducer instead,
``engines.fsdp.logits_reducer``): for the duration of one ``compute_log_prob`` call, :func:`modal_log_probs` wraps the engine's
``prepare_model_outputs`` (verl 0.9.1 ``FSDPEngineWithLMHead``): verl's method runs unchanged, so
``log_probs`` and ``entropy`` keep their bits, and the wrapper adds one key, ``MODAL_KEY``, to its output,
computed from the same raw logits and packed exactly like ``log_probs`` (one nested row per sequence,
prompt and response positions; the position of token ``t`` predicts ``t + 1``, as ``log_probs``). verl's
worker returns every key of that output, so the field reaches TransferQueue beside ``log_probs``.

Both of verl's layouts are handled: packed (``use_remove_padding``: logits (1, nnz, V), sequence-parallel
shards gathered back with verl's own helper) and padded ((bs, S, V), narrowed to each sequence's length).
Fused kernels never materialise the logits: refused at start-up (``integration.modal_signal``). Memory:
one float32 block of ``BLOCK_BYTES`` beyond verl's own (every block is written into one buffer), one (rows,) row
statistic at a time, the (N,) result and, with one temperature per row, their (N,) reciprocals (measured:
tests/unit/test_memory_estimate_on_cpu.py).
Checked against verl 0.9.1; an engine without ``prepare_model_outputs`` is refused with the fix.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["BLOCK_BYTES", "MODAL_KEY", "modal_log_probs", "top1_log_probs"]

GATHER = "verl.workers.engine.fsdp.transformer_impl.FSDPEngine._gather_and_unpad_packed"
PREPARE = "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs"
"""the verl names the wrapper depends on (``integration.compat.PRIVATE_NAMES``): the caller resolves them through
compat (this layer may not import it) and passes the gather in; a verl with PR logits-reducers needs neither
(``logits_reducer``)"""

MODAL_KEY = "acpo_modal_log_probs"
"""the extra output field of the pass: nested (bs, prompt + response) float32, like verl's ``log_probs``"""
BLOCK_BYTES = {"cpu": 2 << 20}
"""float32 bytes of one (rows, V) block per device type: on CPU a block that stays in a core's L2 cache (the
reduction is memory-bound there: 6x faster than whole-tensor ops at V=12672, measured in benchmarks/modal_cost.py);
elsewhere ``DEFAULT_BLOCK_BYTES``, few enough kernel launches"""
DEFAULT_BLOCK_BYTES = 256 << 20


def top1_log_probs(logits: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """(N,) float32 log p_max of every row of ``logits`` (N, V) at ``temperature`` ((N,) or a number, > 0).

    ``max(z/T) - logsumexp(z/T) = -log sum_v exp((z_v - max z) / T)``: one max and one exp-sum per row, in float32,
    block by block (``BLOCK_BYTES``). Every block is computed in place in one (rows, V) float32 buffer (float32 logits
    are subtracted into it, others copied into it first), so the extra memory is that buffer, never a copy of the
    logits, and no block outlives the next."""
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).clamp(min=1e-8)  # a new tensor
    unit = bool((temp == 1).all())  # verl's usual temperature: one pass over the block fewer
    inv = temp.reciprocal_()  # 1 / T in place (``1.0 / temp`` is this reciprocal too)
    inv = inv.expand(n) if inv.dim() == 0 else inv
    rows = max(1, BLOCK_BYTES.get(logits.device.type, DEFAULT_BLOCK_BYTES) // (4 * vocab))
    with torch.no_grad():
        buffer = torch.empty((min(rows, n), vocab), dtype=torch.float32, device=logits.device)
        for start in range(0, n, rows):
            z = logits[start : start + rows]
            shifted = buffer[: z.shape[0]]
            if z.dtype == torch.float32:  # never in place on the logits
                torch.sub(z, z.amax(dim=-1, keepdim=True), out=shifted)
            else:
                shifted.copy_(z)  # the float32 copy, rounded as .float()
                shifted.sub_(shifted.amax(dim=-1, keepdim=True))
            if not unit:
                shifted.mul_(inv[start : start + rows, None])
            out[start : start + rows] = shifted.exp_().sum(-1).log_().neg_()
    return out


def _full(logits):
    from torch.distributed.tensor import DTensor

    return logits.full_tensor() if isinstance(logits, DTensor) else logits  # TP shards the vocabulary


@contextmanager
def modal_log_probs(engine, gather):
    """Inside the block, ``engine``'s forward passes also return ``MODAL_KEY`` (module docstring). ``gather``:
    the engine's own ``(values (nnz [/ sp] + pad,), pad_size) -> (nnz,)`` (verl's ``GATHER``), None when it has
    none."""
    original = getattr(engine, "prepare_model_outputs", None)
    if original is None or gather is None:
        raise RuntimeError(f"algorithm.acpo.surrogate=modal needs verl's FSDP engine (prepare_model_outputs); this "
                           f"worker's engine is {type(engine).__name__}. Use +algorithm.acpo.surrogate=sampled.")

    def prepare_model_outputs(output, output_args, micro_batch, logits_processor_func):
        model_output = original(output, output_args, micro_batch, logits_processor_func)
        from verl.utils import tensordict_utils as tu

        offsets = micro_batch["input_ids"].offsets()
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            logits = _full(output.logits.squeeze(0))                               # (nnz [/ sp] + pad, V)
            top1 = top1_log_probs(logits, output_args["temperature_rmpad"])
            top1 = gather(top1, output_args["pad_size"])
        else:
            logits = _full(output.logits)                                          # (bs, S, V)
            lengths = offsets.diff().tolist()
            temperature = output_args["temperature"].float()
            top1 = torch.cat([top1_log_probs(logits[i, :n], temperature[i]) for i, n in enumerate(lengths)])
        model_output[MODAL_KEY] = torch.nested.nested_tensor_from_jagged(top1, offsets)
        return model_output

    own = engine.__dict__.get("prepare_model_outputs")  # None: the class's method
    engine.prepare_model_outputs = prepare_model_outputs
    try:
        yield
    finally:
        if own is None:
            del engine.prepare_model_outputs
        else:
            engine.prepare_model_outputs = own
