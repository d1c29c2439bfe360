"""The tiny float64 Qwen2 that the OAR-P unit tests compare against the naive loop (random weights, seed 0)."""

from __future__ import annotations

import torch


def tiny_qwen2(vocab: int = 97, max_positions: int = 256, sliding: bool = False):
    """2 layers, hidden 32, GQA 4/2 heads, SDPA, float64, eval mode; ``sliding``: an 8-token sliding window."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
        use_sliding_window=sliding, sliding_window=8 if sliding else None,
    )
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).double().eval()
