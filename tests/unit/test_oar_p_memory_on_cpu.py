"""OAR-P's memory is one model call's, whatever the number of occluded copies (``core.perturbation``).

A real ``core.hf.HFRowsModel`` over the tiny Qwen2 (vocabulary 1009, no other dimension of that size) scores a
batch of ~250 exact-mode copies in dozens of calls. Two checks:

* every logits tensor a call returns (and the tensor it is a view of) is dead, by weakref, when the next call
  starts: each call is reduced before the next one;
* every vocabulary-sized float tensor any torch op creates during the pass is tracked (a ``TorchDispatchMode``
  sees each op's outputs; a storage is live while any tensor on it is), and the peak of live vocabulary-sized
  bytes stays within a small multiple of the largest call's logits plus the per-sample clean statistics
  ((V,) float32 each), far below the copies' logits together.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from _oar_p_reference import naive_perturbation_importance
from _tiny_models import tiny_qwen2
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from verl_oar.core.hf import HFRowsModel
from verl_oar.core.perturbation import PerturbationConfig, Sample, batched_perturbation_importance, occlusion_spans

VOCAB = 1009  # prime, above every sequence length, hidden and head size here: last dim == VOCAB means logits
NEUTRAL = 0
BUDGET = 96   # tokens per call: dozens of calls
MULTIPLE = 3  # live V-sized bytes <= MULTIPLE x the largest call's logits + the clean statistics


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2(VOCAB, max_positions=256)


def _batch(seed: int = 0) -> list[Sample]:
    """4 samples (2 prompts of 6-10 tokens x 2 responses), 55-70 reasoning tokens each (exact mode: one copy
    per token), a 3-token answer, then 2 more tokens."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(2):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(6, 11, (1,), generator=g)),), generator=g)
        for _ in range(2):
            reasoning_len = int(torch.randint(55, 71, (1,), generator=g))
            ids = torch.cat([prompt, torch.randint(1, VOCAB, (reasoning_len + 5,), generator=g)])
            n, p = ids.numel(), prompt.numel()
            reasoning = torch.zeros(n, dtype=torch.bool)
            reasoning[p : p + reasoning_len] = True
            predict = torch.zeros(n, dtype=torch.bool)
            predict[n - 6 : n - 3] = True
            samples.append(Sample(ids, torch.arange(n), occlusion_spans(reasoning, "exact", 1), predict,
                                  temperature=0.7, prompt_len=p))
    return samples


class _Tracked(HFRowsModel):
    """HFRowsModel that checks, when called, that no logits an earlier call returned are alive."""

    def __init__(self, module):
        super().__init__(module, pad_id=NEUTRAL)
        self.refs: list[tuple[int, weakref.ref]] = []
        self.calls = 0
        self.largest = 0  # bytes of the largest call's logits

    def __call__(self, rows):
        alive = sorted({call for call, ref in self.refs if ref() is not None})
        assert not alive, f"call {self.calls}: logits of call(s) {alive} still alive"
        self.refs.clear()
        logits, caches = super().__call__(rows)
        bases = {id(t._base if t._base is not None else t): t._base if t._base is not None else t
                 for t in logits if t is not None}
        self.largest = max(self.largest, sum(b.numel() * b.element_size() for b in bases.values()))
        for t in [*logits, *bases.values()]:
            if t is not None:
                self.refs.append((self.calls, weakref.ref(t)))
        self.calls += 1
        return logits, caches


class _VocabSized(TorchDispatchMode):
    """Peak bytes of live storages holding float tensors whose last dimension is ``vocab`` (parameters
    excluded), over every torch op run under the mode."""

    def __init__(self, vocab: int, exclude: set[int]):
        super().__init__()
        self.vocab, self.exclude = vocab, exclude
        self.count: dict[int, int] = {}    # storage pointer -> live tensors on it
        self.nbytes: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, ptr: int) -> None:
        self.count[ptr] -= 1
        if not self.count[ptr]:
            del self.count[ptr]
            self.live -= self.nbytes.pop(ptr)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or not storage.nbytes():
            return
        if ptr not in self.count:
            self.count[ptr] = 0
            self.nbytes[ptr] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.count[ptr] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and t.is_floating_point():
                self._track(t)
        return out


def test_no_call_s_logits_are_alive_when_the_next_call_starts(model):
    samples = _batch()
    rows_model = _Tracked(model)
    got, _, total = batched_perturbation_importance(rows_model, samples, NEUTRAL, PerturbationConfig(), BUDGET)
    assert total.copies > 200 and rows_model.calls > 20
    assert all(ref() is None for _, ref in rows_model.refs)  # nor after the last call
    for sample, importance in zip(samples, got, strict=True):  # and the importance is still exact
        want = naive_perturbation_importance(lambda x: model(input_ids=x).logits, sample.ids, sample.span,
                                             sample.predict, NEUTRAL, "mean", sample.temperature)
        assert torch.allclose(importance.double(), want.double(), atol=1e-10, rtol=0)


@pytest.mark.parametrize("outcome", ["mean", "joint"])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_live_vocabulary_sized_memory_stays_within_one_call(model, outcome, share_prefix):
    samples = _batch(1)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: list[int] = []

    class Sizes(HFRowsModel):  # the largest call's logits (outside the dispatch mode's accounting: just sizes)
        def __call__(self, rows):
            logits, caches = super().__call__(rows)
            sizes.append(sum(t.numel() * t.element_size() for t in logits if t is not None))
            return logits, caches

    rows_model = Sizes(model, pad_id=NEUTRAL)
    cfg = PerturbationConfig(outcome=outcome, share_prefix=share_prefix)
    with _VocabSized(VOCAB, params) as tracker:
        _, _, total = batched_perturbation_importance(rows_model, samples, NEUTRAL, cfg, BUDGET)
    clean_statistics = len(samples) * VOCAB * 4
    all_copies = sum(sizes)
    assert total.copies > 200 and all_copies > 8 * (MULTIPLE * max(sizes) + clean_statistics)  # a decisive batch
    assert tracker.live == 0  # nothing vocabulary-sized outlives the pass
    assert tracker.peak <= MULTIPLE * max(sizes) + clean_statistics, (
        f"peak live V-sized bytes {tracker.peak} vs largest call {max(sizes)} (all calls {all_copies})")
