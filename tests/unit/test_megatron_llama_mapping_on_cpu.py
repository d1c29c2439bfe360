"""``verl_oar.cpu.megatron_llama.megatron_state_dict`` on hand-built tensors whose every row says where it came from:
each TP rank's query/key/value rows per query group, its gate and up rows, its columns of the output projections,
the zero-padded vocabulary; and the TP sizes megatron cannot split a model over. That the layout is right for a
real forward (logits equal transformers') is ``tests/engine/test_megatron_llama_on_cpu.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_oar.cpu.megatron_llama import megatron_state_dict, padded_vocab_size

# 4 heads in 2 query groups, head dim 1, hidden 3, MLP 4, vocabulary 5, one layer
CONFIG = SimpleNamespace(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=1, hidden_size=3,
                         intermediate_size=4, vocab_size=5, tie_word_embeddings=True)


def _rows(first: float, n: int, width: int = 3) -> torch.Tensor:
    """(n, width): row i is all ``first + i``."""
    return (first + torch.arange(n, dtype=torch.float32))[:, None].expand(n, width).clone()


def checkpoint(tied: bool = True) -> dict:
    layer = "model.layers.0."
    state = {
        "model.embed_tokens.weight": _rows(1, 5),
        layer + "input_layernorm.weight": torch.tensor([1.0, 2.0, 3.0]),
        layer + "self_attn.q_proj.weight": _rows(100, 4),   # heads 0..3
        layer + "self_attn.k_proj.weight": _rows(200, 2),   # groups 0, 1
        layer + "self_attn.v_proj.weight": _rows(300, 2),
        layer + "self_attn.o_proj.weight": _rows(0, 3, 4) * 0 + torch.arange(4.0),   # column j holds j
        layer + "post_attention_layernorm.weight": torch.tensor([4.0, 5.0, 6.0]),
        layer + "mlp.gate_proj.weight": _rows(10, 4),
        layer + "mlp.up_proj.weight": _rows(20, 4),
        layer + "mlp.down_proj.weight": _rows(0, 3, 4) * 0 + torch.arange(4.0),
        "model.norm.weight": torch.tensor([7.0, 8.0, 9.0]),
    }
    if not tied:
        state["lm_head.weight"] = _rows(50, 5)
    return state


def _first_column(t: torch.Tensor) -> list[float]:
    return t[:, 0].tolist()


def test_each_tp_rank_holds_its_query_groups_heads_then_key_then_value():
    ranks = [megatron_state_dict(checkpoint(), CONFIG, r, 2) for r in range(2)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert _first_column(ranks[0][qkv]) == [100, 101, 200, 300]   # group 0: heads 0, 1, its key, its value
    assert _first_column(ranks[1][qkv]) == [102, 103, 201, 301]
    whole = megatron_state_dict(checkpoint(), CONFIG, 0, 1)
    assert _first_column(whole[qkv]) == [100, 101, 200, 300, 102, 103, 201, 301]   # TP = 1: group after group


def test_each_tp_rank_holds_its_gate_rows_then_its_up_rows_and_its_columns_of_the_projections():
    ranks = [megatron_state_dict(checkpoint(), CONFIG, r, 2) for r in range(2)]
    layer = "decoder.layers.0."
    assert _first_column(ranks[0][layer + "mlp.linear_fc1.weight"]) == [10, 11, 20, 21]
    assert _first_column(ranks[1][layer + "mlp.linear_fc1.weight"]) == [12, 13, 22, 23]
    assert ranks[1][layer + "mlp.linear_fc2.weight"][0].tolist() == [2, 3]   # columns of MLP units 2, 3
    assert ranks[1][layer + "self_attention.linear_proj.weight"][0].tolist() == [2, 3]   # of heads 2, 3
    assert ranks[0][layer + "pre_mlp_layernorm.weight"].tolist() == [4, 5, 6]   # transformers' post-attention norm
    assert ranks[1][layer + "input_layernorm.weight"].tolist() == [1, 2, 3]


@pytest.mark.parametrize("tied", [True, False])
def test_the_vocabulary_is_split_in_rank_order_after_zero_padding_and_an_untied_head_like_it(tied):
    assert padded_vocab_size(5, 2) == 6 and padded_vocab_size(49152, 3) == 49152
    config = SimpleNamespace(**{**vars(CONFIG), "tie_word_embeddings": tied})
    ranks = [megatron_state_dict(checkpoint(tied), config, r, 2) for r in range(2)]
    embedding = "embedding.word_embeddings.weight"
    assert _first_column(ranks[0][embedding]) == [1, 2, 3]
    assert _first_column(ranks[1][embedding]) == [4, 5, 0]   # the padding row: its logit is exactly 0
    if tied:
        assert "output_layer.weight" not in ranks[0]   # GPTModel's output layer reads the embedding
    else:
        assert _first_column(ranks[1]["output_layer.weight"]) == [53, 54, 0]


def test_a_tp_size_that_does_not_divide_the_query_groups_is_refused_naming_one_that_does():
    smollm2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                              hidden_size=576, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 must divide.*divides 3"):
        megatron_state_dict({}, smollm2, 0, 2)
    with pytest.raises(ValueError, match="tp_rank=2 is not in a group of 2"):
        megatron_state_dict(checkpoint(), CONFIG, 2, 2)
