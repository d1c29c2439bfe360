"""A transformers causal LM as OAR-P's :class:`~verl_oar.core.perturbation.PrefixModel`, and
as OAR-G's outcome head (:class:`OutcomeHead`: the outcome logits computed alike in every pass).

The clean pass returns its KV cache as per-layer (key, value) tensors of one row; a later call
slices the first ``past_len`` positions, repeats them for its ``m`` rows, and feeds only the new
tokens. Works on a plain model or an FSDP-wrapped one (keyword arguments go straight through).

Prefix sharing needs every layer to attend to the whole prefix: a sliding-window layer drops
old positions from its cache, so :func:`can_share_prefix` says no for such models and the caller
recomputes prefixes instead (same result, slower).
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch
from torch import Tensor


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


class HFPrefixModel:
    """Call a transformers causal LM on rows that share a cached prefix (see ``PrefixModel``)."""

    def __init__(self, module, context: Callable[[], AbstractContextManager] = nullcontext):
        """``module``: the causal LM (``model(input_ids=..., past_key_values=...)`` returns ``.logits``
        and ``.past_key_values``); ``context``: entered around every call (e.g. autocast)."""
        self.module = module
        self.context = context
        self.keep_supported = accepts_logits_to_keep(module)

    def __call__(
        self, ids: Tensor, positions: Tensor, keep: Tensor, past: Any = None, past_len: int = 0, cache: bool = False
    ) -> tuple[Tensor, Any]:
        from transformers import DynamicCache

        rows = ids.shape[0]
        kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": positions, "use_cache": cache}
        if past is not None and past_len > 0:
            prefix = [(k[:, :, :past_len].expand(rows, -1, -1, -1), v[:, :, :past_len].expand(rows, -1, -1, -1))
                      for k, v in past]
            kwargs["past_key_values"] = DynamicCache(ddp_cache_data=prefix)
            kwargs["use_cache"] = True
        if self.keep_supported:
            kwargs["logits_to_keep"] = keep
        with self.context():
            out = self.module(**kwargs)
        logits = out.logits if self.keep_supported else out.logits[:, keep]
        new_cache = None
        if cache:
            new_cache = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return logits, new_cache


def _final_hidden(output) -> Tensor:
    """The last hidden state from a transformers decoder's output (ModelOutput or tuple)."""
    return output if torch.is_tensor(output) else output[0]


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
        try:
            with self.autocast:
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
