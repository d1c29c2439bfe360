"""The hf rollout's seeded sampler (``verl_oar.cpu.hf_rollout._SeededSampler``) against the distribution
it must draw from; the rollout's reproducibility is tests/engine/test_hf_rollout_sampling_on_cpu.py."""

from __future__ import annotations


def test_seeded_sampler_draws_from_the_tempered_softmax():
    import torch

    from verl_oar.cpu.hf_rollout import _SeededSampler

    rows = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")]]).expand(rows, -1)
    for temperature in (1.0, 0.5):
        picks = _SeededSampler(list(range(rows)), temperature, 0, 1.0)(None, logits.clone()).argmax(-1)
        freq = torch.bincount(picks, minlength=6).double() / rows
        p = torch.softmax(logits[0].double() / temperature, -1)
        assert freq[-1] == 0  # never a token of probability 0
        assert torch.all((freq - p).abs() <= 4 * (p * (1 - p) / rows).sqrt() + 1e-12), (freq, p)
    top2 = _SeededSampler(list(range(1000)), 1.0, 2, 1.0)(None, logits[:1000].clone()).argmax(-1)
    assert set(top2.tolist()) == {0, 1}
