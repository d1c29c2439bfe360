"""A transformers causal LM as OAR-G's ``logits_fn`` (:func:`make_hf_logits_fn`), as OAR-P's
:class:`~verl_oar.core.perturbation.RowsModel` (:class:`HFRowsModel`: rows of several samples per call, each
continuing its own KV cache, what the engines and :func:`hf_importance` run), as OAR-G's outcome head
(:class:`OutcomeHead`: the outcome logits computed alike in every pass), and the importance of
plain HF sequences outside training (:func:`hf_importance`: the heatmap, the testbed, benchmarks).

Works on a plain model or an FSDP-wrapped one (keyword arguments go straight through).

Prefix sharing needs every layer to attend to the whole prefix: a sliding-window layer drops
old positions from its cache, so :func:`can_share_prefix` says no for such models and the caller
recomputes prefixes instead (same result, slower).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable

import torch
from torch import Tensor

from verl_oar.core.gradient import GradientConfig, gradient_importance
from verl_oar.core.outcome import padded_predicting_positions
from verl_oar.core.perturbation import PerturbationConfig, PerturbationCost, Sample, score_samples

__all__ = ["HFRowsModel", "OutcomeHead", "accepts_logits_to_keep", "can_share_prefix",
           "checkpointed_layers", "hf_importance", "make_hf_logits_fn", "recomputed_in_backward"]

def _unwrapped(module):
    return getattr(module, "module", module)


def can_share_prefix(module) -> bool:
    """Whether the model's KV cache of a prefix can be reused: full attention in every layer."""
    config = _unwrapped(module).config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return False
    return not getattr(config, "use_sliding_window", False) and getattr(config, "attention_chunk_size", None) is None


def accepts_logits_to_keep(module) -> bool:
    """Whether the model's forward takes transformers' ``logits_to_keep`` (index tensor form)."""
    try:
        return "logits_to_keep" in inspect.signature(_unwrapped(module).forward).parameters
    except (TypeError, ValueError):
        return False


def make_hf_logits_fn(
    model: Any, attention_mask: Tensor | None = None, position_ids: Tensor | None = None, temperature: float = 1.0
) -> Callable[[Tensor], Tensor]:
    """A ``logits_fn`` for a plain transformers causal LM: inputs_embeds (B, T, H) -> logits (B, T, V).

    ``attention_mask`` (B, T) 0/1 and ``position_ids`` (B, T) long are passed through unchanged (None
    included). With ``temperature`` != 1 the logits are float32 divided by it; at 1 they are the
    model's own (dtype included)."""

    def logits_fn(inputs_embeds: Tensor) -> Tensor:
        out = model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return out.logits if temperature == 1.0 else out.logits.float() / temperature

    return logits_fn


def hf_importance(
    model: Any,
    ids: Tensor,
    reasoning: Tensor,
    answer: Tensor,
    cfg: GradientConfig | PerturbationConfig,
    *,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    clean_logits: Tensor | None = None,
    neutral_id: int | None = None,
    max_tokens: int = 8192,
    line_end: Tensor | None = None,
    cost: PerturbationCost | None = None,
) -> Tensor:
    """OAR-G or OAR-P importance of plain transformers sequences (prompt + response, right-padded).

    Position t predicts the answer when token t + 1 is an answer token
    (:func:`~verl_oar.core.outcome.padded_predicting_positions`).

    Args:
        model: a transformers causal LM (plain, not sharded), on ``ids``' device.
        ids: (B, L) long, prompt + response per row, positions 0..L-1.
        reasoning: (B, L) bool, the tokens scored (and, for OAR-G, noised).
        answer: (B, L) bool, the answer tokens (as input tokens).
        cfg: :class:`GradientConfig` (OAR-G: one batched gradient pass) or :class:`PerturbationConfig`
            (OAR-P: ``core.perturbation.score_samples``, copies of all rows sharing calls; ``cfg.mode`` /
            ``cfg.budget`` build the occlusion spans, ``hierarchical`` in two rounds).
        attention_mask: (B, L) 0/1; OAR-G passes it to the model as is (None included), OAR-P scores
            each row's first ``attention_mask[b].sum()`` tokens (None: all L).
        temperature: the rollout temperature; logits are divided by it.
        generator: OAR-G's noise draws (see :func:`~verl_oar.core.gradient.gradient_importance`).
        clean_logits: OAR-G ``noisy_kl``: (B, L, V) logits of the clean pass, reused (already divided
            by ``temperature``); None runs that pass.
        neutral_id: OAR-P's occlusion token id (required for OAR-P).
        max_tokens: OAR-P's padded token budget per model call (``core.perturbation.call_tokens``).
        line_end: (B, L) bool, tokens holding a line break (OAR-P ``line`` mode only).
        cost: OAR-P: the batch's model calls, copies and tokens fed are added to it.

    Returns:
        (B, L) float32 importance on ``ids``' device, 0 off ``reasoning`` (and past each row's length).
    """
    predict, targets, segment = padded_predicting_positions(ids, answer)
    if isinstance(cfg, GradientConfig):
        embeds = model.get_input_embeddings()(ids).detach()
        logits_fn = make_hf_logits_fn(model, attention_mask=attention_mask, temperature=temperature)
        return gradient_importance(
            logits_fn, embeds, reasoning, predict, targets, segment, ids.shape[0], cfg,
            generator=generator, clean_logits=clean_logits,
        )
    if not isinstance(cfg, PerturbationConfig):
        raise TypeError(f"cfg must be a GradientConfig or a PerturbationConfig, not {type(cfg).__name__}")
    if neutral_id is None:
        raise ValueError("OAR-P needs neutral_id, the token an occluded token is replaced by")
    lengths = [ids.shape[1] if attention_mask is None else int(attention_mask[b].sum()) for b in range(ids.shape[0])]
    samples, reasoning_rows = [], []
    for b, length in enumerate(lengths):
        first = reasoning[b, :length].nonzero()
        samples.append(Sample(ids[b, :length], torch.arange(length, device=ids.device), torch.full((length,), -1,
                              dtype=torch.long, device=ids.device), predict[b, :length], temperature,
                              prompt_len=int(first[0]) if first.numel() else 0))  # tokens before the first scored one
        reasoning_rows.append(reasoning[b, :length])
    rows_model = HFRowsModel(model, pad_id=neutral_id)
    cfg = replace(cfg, share_prefix=cfg.share_prefix and rows_model.shares_cache)
    line_ends = None if line_end is None else [line_end[b, :length] for b, length in enumerate(lengths)]
    importance, _, batch_cost = score_samples(rows_model, samples, reasoning_rows, neutral_id, cfg, max_tokens,
                                              line_ends)
    if cost is not None:
        cost.add(batch_cost)
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    for b, (length, row) in enumerate(zip(lengths, importance, strict=True)):
        out[b, :length] = row
    return out


def _final_hidden(output) -> Tensor:
    """The last hidden state from a transformers decoder's output (ModelOutput or tuple)."""
    return output if torch.is_tensor(output) else output[0]


def checkpointed_layers(model) -> list:
    """The layers of ``model`` that transformers would checkpoint in training mode: its
    ``GradientCheckpointingLayer`` modules (decoder layers) whose ``gradient_checkpointing`` flag
    ``gradient_checkpointing_enable()`` set (verl calls it for
    ``actor_rollout_ref.model.enable_gradient_checkpointing``).
    Empty when checkpointing is off, and for models that checkpoint in their own forward loop (remote code written
    before transformers 4.52's ``GradientCheckpointingLayer``): those keep every activation in OAR-G's pass."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52
        return []
    return [m for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing is True]


@contextmanager
def recomputed_in_backward(layers: list):
    """Inside the block, a call of each of ``layers`` keeps only its inputs for the backward and recomputes its
    activations there (``torch.utils.checkpoint``, non-reentrant: ``torch.autograd.grad`` works through it).

    How: the layer's ``forward`` is shadowed by an instance attribute, so ``nn.Module.__call__`` and its hooks
    (FSDP's gathers, transformers' output capture) run as before and only the layer's own computation is
    checkpointed; the recomputation calls the original ``forward`` directly, with the autocast state and RNG state of
    the forward, so the backward sees the same bits. Mode flags (``training``) are not touched: dropout and every
    other train/eval difference stay as the caller set them. Restored on exit (the backward may run after it)."""
    from torch.utils.checkpoint import checkpoint

    shadowed = []
    try:
        for layer in layers:
            own = layer.__dict__.get("forward")  # an instance forward someone else set: wrapped, then put back
            original = layer.forward

            def checkpointed(*args, _original=original, **kwargs):
                return checkpoint(_original, *args, use_reentrant=False, **kwargs)

            layer.forward = checkpointed
            shadowed.append((layer, own))
        yield
    finally:
        for layer, own in shadowed:
            if own is None:
                del layer.forward
            else:
                layer.forward = own


class OutcomeHead:
    """The outcome logits of a transformers causal LM, computed the same way in every OAR-G pass.

    ``run`` calls the model exactly as verl's ``forward_step`` does (``module(**inputs, use_cache=False)``
    under the engine's autocast) and, in a forward hook on its decoder (inside the model's forward,
    where FSDP has the output layer's parameters gathered), computes ``lm_head(h[predict])`` from the
    decoder's final hidden states h; returned as float32, divided by the temperature. The clean and the noisy
    pass therefore share the selection and the kernel of the outcome logits: with zero noise they are
    bit-identical whatever else differs between the two calls (full logits for verl's log-probs in
    the fused pass, ``logits_to_keep=1`` otherwise so the model skips its (T x V) output layer).
    Models that post-process ``lm_head``'s output are supported when they say so in their config
    (``final_logit_softcapping``: Gemma-2/3; ``logit_scale``: Cohere; ``logits_scaling``: Granite);
    any other difference is caught by :meth:`check` on passes that compute full logits.

    Gradient checkpointing: verl runs the pass in eval mode, where transformers' own checkpointing does nothing
    (its layers checkpoint only when ``training``). A call with grad enabled therefore checkpoints the layers
    whose ``gradient_checkpointing`` flag is set (:func:`checkpointed_layers`, :func:`recomputed_in_backward`):
    the backward keeps each layer's input, (T, H) per layer, and recomputes one layer's activations at a time
    instead of keeping every layer's. The forward's values are the same computation; the recomputation is the
    same kernels on the same inputs, so importance is bit-identical to the pass without it (CPU tests, fp32 and
    bf16). Calls without grad (the clean pass, verl's log-probs) are untouched.
    """

    def __init__(self, module, predict: Tensor, temperature: Tensor | float, autocast: AbstractContextManager):
        """``module``: the causal LM (plain or FSDP-wrapped); ``predict``: (rows, cols) bool predicting
        positions in the layout of the model's input; ``temperature``: float or (N, 1) per position;
        ``autocast``: the engine's mixed-precision context (re-entered on every call)."""
        model = _unwrapped(module)
        self.module = module
        self.decoder = model.get_decoder()
        self.embedding = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        if self.decoder is model or self.lm_head is None:
            raise ValueError(
                f"OAR-G needs a causal LM with a decoder and an output layer (get_decoder() / "
                f"get_output_embeddings()); {type(model).__name__} has none. Use algorithm.adv_estimator=grpo."
            )
        config = model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.scale = getattr(text, "logit_scale", None)
        self.divide = getattr(text, "logits_scaling", None)
        self.predict = predict
        self.temperature = temperature
        self.autocast = autocast
        self.slim = {"logits_to_keep": 1} if accepts_logits_to_keep(module) else {}
        self.checkpointed = checkpointed_layers(model)
        """layers recomputed in the backward of a call with grad (empty: gradient checkpointing is off)"""

    def logits(self, hidden: Tensor) -> Tensor:
        """(N, H) final hidden states -> (N, V) logits in the model's compute dtype."""
        logits = self.lm_head(hidden)
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def run(self, model_inputs: dict, transform: Callable[[Tensor], Tensor] | None, full_logits: bool):
        """One model call with the input embeddings replaced by ``transform(e)`` (None: unchanged).

        Returns (the model's raw output, (N, V) float32 outcome logits / temperature). With
        ``full_logits`` the raw output holds every position's logits (verl's call, for log-probs);
        otherwise the model computes logits at one position only (when it takes ``logits_to_keep``).
        """
        captured: dict[str, Tensor] = {}

        def outcome(_module, _inputs, out) -> None:
            # inside the model's forward: the output layer's parameters are gathered there (FSDP)
            captured["logits"] = self.logits(_final_hidden(out)[self.predict])

        hooks = [self.decoder.register_forward_hook(outcome)]
        if transform is not None:
            hooks.append(self.embedding.register_forward_hook(lambda _m, _i, out: transform(out)))
        recompute = self.checkpointed if torch.is_grad_enabled() else []
        try:
            with self.autocast, recomputed_in_backward(recompute):
                raw = self.module(**model_inputs, use_cache=False, **({} if full_logits else self.slim))
            if "logits" not in captured:
                raise RuntimeError(f"{type(self.decoder).__name__} was not called by the model's forward")
            logits = captured.pop("logits")
        finally:
            for hook in hooks:
                hook.remove()
        if full_logits:
            self.check(raw.logits, logits)
        return raw, logits.float() / self.temperature

    def check(self, full: Tensor, outcome: Tensor) -> None:
        """Raise if the model's own logits at the predicting positions are not what :meth:`logits`
        computes (a model that post-processes its logits in a way this class does not know)."""
        mine, theirs = outcome.detach().float(), full.detach()[self.predict].float()
        tolerance = 1e-4 if full.dtype in (torch.float32, torch.float64) else 5e-2
        if mine.numel() and not torch.allclose(mine, theirs, rtol=tolerance, atol=tolerance * theirs.abs().max().item()):
            raise RuntimeError(
                f"OAR-G's outcome logits (lm_head of the final hidden states) differ from "
                f"{type(_unwrapped(self.module)).__name__}'s own logits by up to "
                f"{(mine - theirs).abs().max().item():.3g}: the model post-processes its logits in a way verl-oar "
                "does not reproduce. Use algorithm.adv_estimator=oar_p or grpo for this model, and report it."
            )


class HFRowsModel:
    """A transformers causal LM as OAR-P's :class:`~verl_oar.core.perturbation.RowsModel`.

    One call pads its rows to the right edge twice: each row's cached prefix is right-aligned in ``P`` cache
    slots (P = the longest prefix) and its new tokens in ``N`` columns, with a (rows, P + N) attention mask
    that is 1 on real slots and explicit position ids. So every row's last positions are the same columns
    (one ``logits_to_keep``), a padding column still sees its row's real prefix, and flash-attention's unpadding,
    sdpa and eager masks all give each row exactly its own sequence. A row's cache is a pair (keys, values),
    each (layers, kv_heads, length, head_dim): all layers move in one copy per row."""

    def __init__(self, module, context: Callable[[], AbstractContextManager] = nullcontext, pad_id: int = 0):
        """``module``: the causal LM (plain or FSDP-wrapped); ``context``: entered around every call (e.g.
        autocast); ``pad_id``: the token id in padding columns (never attended to)."""
        self.module = module
        self.context = context
        self.pad_id = pad_id
        self.keep_supported = accepts_logits_to_keep(module)
        self.shares_cache = can_share_prefix(module)

    def prefix(self, cache, length: int):
        keys, values = cache
        return keys[:, :, :length], values[:, :, :length]

    def __call__(self, rows):
        from transformers import DynamicCache

        device = rows[0].ids.device
        m = len(rows)
        P, N = max(r.past_len for r in rows), max(r.ids.numel() for r in rows)
        keep = max(max(r.keep for r in rows), 1)
        ids = torch.full((m, N), self.pad_id, dtype=torch.long, device=device)
        positions = torch.zeros((m, N), dtype=torch.long, device=device)
        mask = torch.zeros((m, P + N), dtype=torch.long, device=device)
        for j, r in enumerate(rows):
            n = r.ids.numel()
            ids[j, N - n :] = r.ids
            positions[j, N - n :] = r.positions
            positions[j, : N - n] = r.positions[0]
            mask[j, P - r.past_len : P] = 1
            mask[j, P + N - n :] = 1
        kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": positions, "attention_mask": mask,
                                  "use_cache": any(r.cache for r in rows)}
        if P > 0:
            k0, v0 = next(r.past for r in rows if r.past is not None)
            keys = k0.new_zeros((k0.shape[0], m, k0.shape[1], P, k0.shape[3]))      # (layers, m, kv_heads, P, d)
            values = v0.new_zeros((v0.shape[0], m, v0.shape[1], P, v0.shape[3]))
            for j, r in enumerate(rows):
                if r.past_len:
                    keys[:, j, :, P - r.past_len :] = r.past[0]
                    values[:, j, :, P - r.past_len :] = r.past[1]
            kwargs["past_key_values"] = DynamicCache(ddp_cache_data=list(zip(keys.unbind(0), values.unbind(0))))
            kwargs["use_cache"] = True
        if self.keep_supported:
            kwargs["logits_to_keep"] = keep
        with self.context():
            out = self.module(**kwargs)
        logits = out.logits[:, -keep:]
        got_logits = [logits[j, keep - r.keep :] if r.keep else None for j, r in enumerate(rows)]
        caches: list = [None] * m
        if any(r.cache for r in rows):
            layers = out.past_key_values.layers
            all_keys = torch.stack([layer.keys for layer in layers])                 # (layers, m, kv_heads, P + N, d)
            all_values = torch.stack([layer.values for layer in layers])
            for j, r in enumerate(rows):
                if r.cache:
                    n = r.ids.numel()
                    caches[j] = tuple(torch.cat([x[:, j, :, P - r.past_len : P], x[:, j, :, P + N - n :]], dim=2)
                                      for x in (all_keys, all_values))
        return got_logits, caches
