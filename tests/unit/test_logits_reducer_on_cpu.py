"""ACPO's modal log-prob as verl's logits reducer (``engines.fsdp.logits_reducer``, upstream PR logits-reducers):
the reducer sees the logits after verl's own temperature scaling, ``logits / T`` with ``T`` cast to the logits'
dtype (verl 0.9.1 ``transformer_impl._scale_logits_by_temperature``), where the worker's wrapper
(``engines.fsdp.modal``) scales in float32. Against a float64 reference on fresh random logits: fp32 agrees to
float32 rounding, bf16 stays within the bound the module states (one bf16 rounding of T and of each z / T:
``2 * 2**-8 * max|z / T|`` nats per token), and at T = 1 the two paths are bit-identical.
The same comparison through verl's real FSDP2 engine is tests/engine/engine_modal_check.py (run through the
reducer against a patched verl: see the report of issue 29)."""

from __future__ import annotations

import pytest
import torch

from verl_oar.engines.fsdp.logits_reducer import MODAL_KEY, available, modal_reducer
from verl_oar.engines.fsdp.modal import top1_log_probs


def _verl_scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """verl's scaling: the temperature cast to the logits' dtype, then one division in that dtype."""
    return z / torch.tensor(temperature).clamp(min=1e-8).to(z.dtype)


def _reference(z: torch.Tensor, temperature: float) -> torch.Tensor:
    s = z.double() / temperature
    return s.amax(-1) - torch.logsumexp(s, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_the_reducer_after_verls_scaling_matches_float64_within_the_stated_bound(dtype, temperature):
    g = torch.Generator().manual_seed(int(temperature * 10) + (dtype == torch.bfloat16))
    z = (torch.randn(96, 1531, generator=g) * 4).to(dtype)  # 1531: not a multiple of any block size
    z[0, 7] = 40.0                                           # one confident row (p_max near 1)
    got = modal_reducer(_verl_scaled(z, temperature))
    want = _reference(z, temperature)
    assert got.dtype == torch.float32 and got.shape == (96,)
    err = (got.double() - want).abs()
    if dtype == torch.float32:
        assert float(err.max()) <= 1e-5
        torch.testing.assert_close(got, top1_log_probs(z, temperature), atol=1e-5, rtol=0)  # the wrapper's value
    else:
        bound = 2 * 2**-8 * (z.double() / temperature).abs().amax(-1)
        assert bool((err <= bound + 1e-6).all()), float((err - bound).max())
    if temperature == 1.0:  # verl does not scale at T = 1: the reducer is the wrapper, bit for bit
        assert torch.equal(got, top1_log_probs(z, 1.0))


def test_the_reducer_writes_the_wrappers_field_and_is_inert_on_a_verl_without_patch_0008():
    assert MODAL_KEY == "acpo_modal_log_probs"  # what integration.modal_signal reads from TransferQueue
    assert available() is False                 # the installed verl 0.9.1: the worker's wrapper is used
