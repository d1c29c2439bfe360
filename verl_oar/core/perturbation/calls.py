"""OAR-P's model calls: a call is a list of :class:`Row` (new tokens continuing a row's own cached prefix), run by a
:class:`RowsModel`, and :func:`plan_calls` packs rows of different samples, prefix lengths and lengths into calls.

Rows are ordered by length and packed into calls while ``rows x longest new part <= max_tokens`` (tokens through the
model, padded: the caller passes verl's log-prob token budget), ``rows x longest prefix <= CACHE_FACTOR x
max_tokens`` (cached tokens gathered for the call) and the padding stays within ``WASTE_FRACTION`` of the rows' own
work; a row alone over the budget is called alone. The model adapters are ``core.hf.HFRowsModel`` (transformers,
per-row KV caches) and ``engines.megatron.perturbation.MegatronRowsModel`` (packed rows, no cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

__all__ = ["CACHE_FACTOR", "WASTE_FRACTION", "Row", "RowsModel", "cached_tokens", "call_tokens", "plan_calls"]


@dataclass
class Row:
    """One row of a model call: ``ids`` continue a cached prefix of ``past_len`` tokens (``past``)."""

    ids: Tensor
    """(n,) long, the new tokens"""
    positions: Tensor
    """(n,) long, their position ids"""
    past: Any = None
    """the model's cache of this row's first ``past_len`` tokens (from an earlier row's ``cache=True``), or None"""
    past_len: int = 0
    keep: int = 0
    """how many of the last positions' logits to return (0: none)"""
    cache: bool = False
    """return this row's cache of all its ``past_len + n`` tokens"""


class RowsModel(Protocol):
    """A causal LM that runs rows with prefixes of their own in one call."""

    shares_cache: bool
    """whether a row's cache can be continued (False: every row must start at position 0)"""

    def __call__(self, rows: list[Row]) -> tuple[list[Tensor | None], list[Any]]:
        """Per row: (keep, V) logits of its last ``keep`` positions (None if ``keep`` is 0) and its cache (None
        unless ``cache``). The lists are the caller's: the model keeps no reference to the logits, which the
        caller frees (it empties the list) before its next call."""
        ...

    def prefix(self, cache: Any, length: int) -> Any:
        """The cache of the first ``length`` tokens of a row's cache."""
        ...


CACHE_FACTOR = 4
"""Cached prefix tokens a call may gather, per token of its budget. A cached token holds 2 x layers x kv_heads x
head_dim values (28 KB in bf16 for Qwen2.5-Math-1.5B, 57 KB for 7B), a token of verl's log-prob pass at least its
float32 logits (600 KB at a 152k vocabulary): 4x the budget in cached tokens stays under a fifth of that pass's
logits memory."""

WASTE_FRACTION = 0.25
"""The padding a call may add: its padded new tokens (rows x longest new part, what the linear layers compute)
and its padded attention area (rows x longest new part x (longest prefix + longest new part)) each stay within
this fraction above the rows' own."""


def call_tokens(rows: list[Row]) -> int:
    """Tokens a call feeds through the model, padded: rows x longest new part."""
    return len(rows) * max(r.ids.numel() for r in rows)


def cached_tokens(rows: list[Row]) -> int:
    """Cached tokens a call gathers, padded: rows x longest prefix."""
    return len(rows) * max(r.past_len for r in rows)


class _Call:
    """A call being filled: its rows and the running sums :func:`plan_calls` checks."""

    def __init__(self, i: int, row: Row):
        n = row.ids.numel()
        self.rows, self.new, self.past = [i], n, row.past_len
        self.new_sum, self.area_sum = n, n * (row.past_len + n)

    def admits(self, row: Row, max_tokens: int) -> bool:
        n = row.ids.numel()
        count, new, past = len(self.rows) + 1, max(self.new, n), max(self.past, row.past_len)
        return (count * new <= max_tokens and count * past <= CACHE_FACTOR * max_tokens
                and count * new <= (1 + WASTE_FRACTION) * (self.new_sum + n)
                and count * new * (past + new) <= (1 + WASTE_FRACTION) * (self.area_sum + n * (row.past_len + n)))

    def add(self, i: int, row: Row) -> None:
        n = row.ids.numel()
        self.rows.append(i)
        self.new, self.past = max(self.new, n), max(self.past, row.past_len)
        self.new_sum += n
        self.area_sum += n * (row.past_len + n)


def plan_calls(rows: list[Row], max_tokens: int) -> list[list[int]]:
    """Indices of ``rows`` per model call. Rows are ordered by total length (prefix + new), then new part,
    longest first, so rows of one sample and of samples of similar length are neighbours; a call takes the
    next row while it stays within ``max_tokens`` fed, ``CACHE_FACTOR x max_tokens`` cached (padded, see
    :func:`call_tokens`, :func:`cached_tokens`) and ``WASTE_FRACTION`` of padding; a single row always fits."""
    order = sorted(range(len(rows)), key=lambda i: (-(rows[i].past_len + rows[i].ids.numel()),
                                                    -rows[i].ids.numel(), i))
    calls: list[_Call] = []
    for i in order:
        if calls and calls[-1].admits(rows[i], max_tokens):
            calls[-1].add(i, rows[i])
        else:
            calls.append(_Call(i, rows[i]))
    return [call.rows for call in calls]
