"""A transformers causal LM as OAR-P's :class:`~verl_oar.importance.perturbation.PrefixModel`.

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
