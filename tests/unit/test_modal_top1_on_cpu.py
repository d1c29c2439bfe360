"""ACPO's top-1 log-probability reduction (``engines.fsdp.modal.top1_log_probs``) against a per-row float64
reference ``max(z/T) - logsumexp(z/T)``, on fresh random logits: float32 and bfloat16 inputs, one temperature or
one per row, blocks of one row, a few rows and the whole tensor (the block size must not change a value)."""

from __future__ import annotations

import pytest
import torch

from verl_oar.engines.fsdp import modal


def _reference(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    out = []
    for row, t in zip(logits.double(), temperature.double()):
        z = row / t
        out.append(z.max() - torch.logsumexp(z, 0))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
@pytest.mark.parametrize("block_bytes", [1, 3 * 4 * 997, 1 << 30])  # one row, three rows, all rows
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_a_per_row_reference(monkeypatch, dtype, tolerance, block_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(37, 997, generator=g) * 4).to(dtype)
    logits[5, 17] = 60.0  # a peaked row: p_max ~ 1, log p_max ~ 0
    temperature = torch.rand(37, generator=g) * 1.5 + 0.2
    monkeypatch.setitem(modal.BLOCK_BYTES, "cpu", block_bytes)
    got = modal.top1_log_probs(logits, temperature)
    # the reference sees the same (rounded) inputs: bf16 logits are exact in float64
    want = _reference(logits, temperature)
    assert got.dtype == torch.float32 and got.shape == (37,)
    assert torch.allclose(got.double(), want, atol=tolerance, rtol=0), (got.double() - want).abs().max()
    assert (got <= 0).all() and got[5] > -1e-6


@pytest.mark.parametrize("temperature", [0.7, 1.0])  # 1.0 skips the division
def test_one_temperature_for_all_rows_and_logits_untouched(temperature):
    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(3)) * 3
    before = logits.clone()
    got = modal.top1_log_probs(logits, temperature)
    assert torch.equal(logits, before)
    assert torch.allclose(got.double(), _reference(logits, torch.full((9,), temperature)), atol=2e-6, rtol=0)


def test_uniform_logits_give_minus_log_vocab():
    got = modal.top1_log_probs(torch.zeros(4, 128), torch.ones(4))
    assert torch.allclose(got, torch.full((4,), -torch.log(torch.tensor(128.0)).item()), atol=1e-6)


def _out_of_place(logits: torch.Tensor, temperature, rows: int) -> torch.Tensor:
    """The same float32 math written as plain expressions, block by block (a new tensor per step): what the
    in-place buffer must reproduce bit for bit."""
    temp = torch.as_tensor(temperature, dtype=torch.float32).clamp(min=1e-8).expand(logits.shape[0])
    out = []
    for start in range(0, logits.shape[0], rows):
        z = logits[start : start + rows].float()
        shifted = z - z.amax(dim=-1, keepdim=True)
        if not bool((temp == 1).all()):
            shifted = shifted * (1.0 / temp[start : start + rows, None])
        out.append(-shifted.exp().sum(-1).log())
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("temperature", ["per-row", 0.7, 1.0])
def test_one_reused_block_gives_the_bits_of_the_out_of_place_math(monkeypatch, dtype, rows, temperature):
    """Every block is computed in place in one reused buffer (the memory fix: no block outlives the next, measured
    in tests/unit/test_memory_estimate_on_cpu.py); the values are bit-identical to the plain expressions, and the
    logits are never written (float32 logits are subtracted into the buffer, never in place)."""
    g = torch.Generator().manual_seed(rows)
    logits = (torch.randn(37, 997, generator=g) * 4).to(dtype)
    temp = torch.rand(37, generator=g) * 1.5 + 0.2 if temperature == "per-row" else temperature
    before = logits.clone()
    monkeypatch.setitem(modal.BLOCK_BYTES, "cpu", rows * 4 * 997)
    got = modal.top1_log_probs(logits, temp)
    assert torch.equal(logits, before)
    assert torch.equal(got, _out_of_place(logits, temp, rows))
