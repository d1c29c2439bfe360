"""Tiny random Qwen2s of the unit tests: the float64 one the OAR-P tests compare against the naive loop (seed 0), and
the float32 one with the CPU workspace's byte tokenizer that the heatmap tests save and read."""

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


def byte_qwen2(seed: int):
    """(model, tokenizer): 2 layers, hidden 32, GQA 4/2 heads, tied embeddings, float32, random weights from ``seed``,
    with the CPU workspace's byte tokenizer (one token per character)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_oar.cpu.workspace import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float(), tokenizer
