"""A Hugging Face Llama checkpoint as megatron-core's ``GPTModel`` with the local layer spec, at any TP size (CPU mode).

What runs megatron-core on the CPU (``verl_oar.cpu.megatron_patches``) needs a model with real weights. verl 0.9.1's
own route from a Hugging Face checkpoint to Megatron was tried piece by piece (megatron-core 0.16.1, Python 3.11,
no TransformerEngine, no Megatron-Bridge):

- the config: ``verl.models.mcore.registry.hf_to_mcore_config`` (``hf_to_mcore_config_dense`` for
  ``LlamaForCausalLM``) works with the local spec and is used here, with the CPU's overrides (CPU initialisation, no
  fused kernels, no dropout) and the sequence parallelism asked for (verl's default: on whenever TP > 1);
- the model: verl's ``init_mcore_model`` builds TransformerEngine's layer spec (``get_gpt_decoder_block_spec(...,
  use_transformer_engine=True)``) and fails without it (``NameError: name 'TENorm' is not defined``); here
  ``get_gpt_layer_local_spec`` with the arguments verl's ``DenseModel`` passes ``GPTModel`` (rotary embeddings with
  ``get_hf_rope_theta``'s base, ``share_embeddings_and_output_weights`` from ``tie_word_embeddings``);
- the weights: verl's ``load_state_dict_to_megatron_gptmodel`` writes TransformerEngine's fused names
  (``linear_qkv.layer_norm_weight``), so on the local spec, whose norms are modules of their own, it fails
  (``AttributeError: 'ColumnParallelLinear' object has no attribute 'layer_norm_weight'``);
  :func:`megatron_state_dict` is its counterpart for the local spec, with the same tensor layouts.

The mapping (layer ``i``; ``tp`` tensor-parallel ranks, this one ``r``; ``G`` query groups (= key/value heads),
``d`` the head dimension, ``F`` the MLP width, ``V`` the vocabulary padded to ``Vp``, a multiple of ``tp``)::

    HF LlamaForCausalLM                      megatron-core GPTModel (local spec)        rank r holds
    model.embed_tokens.weight   (V, H)       embedding.word_embeddings.weight (Vp/tp, H)   rows [r Vp/tp, (r+1) Vp/tp)
                                                                                        of the zero-padded table
    layers.i.input_layernorm.weight          decoder.layers.i.input_layernorm.weight       all
    layers.i.self_attn.{q,k,v}_proj.weight   decoder.layers.i.self_attention.linear_qkv.weight
                                             (G/tp (heads/G + 2) d, H): per query group g of the rank,
                                             its heads/G query heads, then k_g, then v_g   groups [r G/tp, (r+1) G/tp)
    layers.i.self_attn.o_proj.weight         decoder.layers.i.self_attention.linear_proj.weight  columns of its heads
    layers.i.post_attention_layernorm.weight decoder.layers.i.pre_mlp_layernorm.weight     all
    layers.i.mlp.{gate,up}_proj.weight       decoder.layers.i.mlp.linear_fc1.weight (2F/tp, H):
                                             [gate rows of the rank; up rows of the rank]  (the GLU's two halves)
    layers.i.mlp.down_proj.weight            decoder.layers.i.mlp.linear_fc2.weight        columns [r F/tp, (r+1) F/tp)
    model.norm.weight                        decoder.final_layernorm.weight                all
    lm_head.weight (untied models only)      output_layer.weight (Vp/tp, H)                as the embedding

Megatron splits attention heads and query groups over the TP ranks, so ``tp`` must divide both (SmolLM2-135M, 9
heads in 3 groups: TP = 1 or 3). The vocabulary need not split: it is padded with zero rows (whose logits are
exactly 0) to a multiple of ``tp``; ``engines.megatron.forward.MegatronLogits`` drops those columns (verl's own
log-prob processor would count them: verl builds ``GPTModel`` with the unpadded vocabulary). RMSNorm's epsilon,
SwiGLU (``gated_linear_unit`` with SiLU), no biases (``attention_bias`` false), the head dimension and GQA come from
verl's config converter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["megatron_llama_config", "megatron_llama_model", "megatron_state_dict", "padded_vocab_size"]

CPU_OVERRIDES = dict(
    use_cpu_initialization=True, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
    bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
    attention_dropout=0.0, hidden_dropout=0.0,
)
"""what verl's config converter sets for a GPU that the CPU cannot run (fused kernels, CUDA initialisation)"""


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp_size`` (megatron's vocab-parallel embedding splits it evenly)."""
    if vocab_size < 1 or tp_size < 1:
        raise ValueError(f"vocab_size={vocab_size} and tp_size={tp_size} must be >= 1")
    return -(-vocab_size // tp_size) * tp_size


def _split_rows(x: Tensor, rank: int, parts: int) -> Tensor:
    return x.chunk(parts, dim=0)[rank]


def _check_splits(hf_config: Any, tp_size: int) -> tuple[int, int, int]:
    """(query heads, query groups, head dimension); raise unless ``tp_size`` divides heads, groups and the MLP."""
    heads, groups = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    bad = {name: n for name, n in (("num_attention_heads", heads), ("num_key_value_heads", groups),
                                   ("intermediate_size", int(hf_config.intermediate_size))) if n % tp_size}
    if bad or heads % groups:
        raise ValueError(
            f"tensor_model_parallel_size={tp_size} must divide the attention heads, the key/value heads (megatron's "
            f"query groups) and the MLP width, and the key/value heads the heads; this model has {bad or ''} "
            f"heads={heads}, groups={groups}: use a TP size that divides {groups}"
        )
    return heads, groups, head_dim


def megatron_state_dict(hf_state: dict[str, Tensor], hf_config: Any, tp_rank: int, tp_size: int) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s share of a Llama checkpoint, under the local spec's names (the table above).

    Args:
        hf_state: ``LlamaForCausalLM.state_dict()`` (``model.*``; ``lm_head.weight`` is read only when the
            embeddings are not tied).
        hf_config: its config: ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` (default hidden / heads), ``hidden_size``, ``intermediate_size``, ``vocab_size``,
            ``tie_word_embeddings``.
        tp_rank, tp_size: this rank and the tensor-parallel size.

    Returns:
        name -> tensor (new tensors, the checkpoint's dtype), every parameter of the rank's ``GPTModel``.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is not in a group of {tp_size}")
    heads, groups, d = _check_splits(hf_config, tp_size)
    per_group = heads // groups
    vocab = int(hf_config.vocab_size)

    def vocab_rows(table: Tensor) -> Tensor:
        padded = table.new_zeros(padded_vocab_size(vocab, tp_size), table.shape[1])
        padded[:vocab] = table[:vocab]
        return _split_rows(padded, tp_rank, tp_size).clone()

    out = {"embedding.word_embeddings.weight": vocab_rows(hf_state["model.embed_tokens.weight"])}
    for i in range(int(hf_config.num_hidden_layers)):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf_state[hf + "self_attn.q_proj.weight"].unflatten(0, (groups, per_group * d))
        k = hf_state[hf + "self_attn.k_proj.weight"].unflatten(0, (groups, d))
        v = hf_state[hf + "self_attn.v_proj.weight"].unflatten(0, (groups, d))
        qkv = torch.cat([q, k, v], dim=1)   # (G, (heads/G + 2) d, H): each group's queries, key, value
        out[mc + "input_layernorm.weight"] = hf_state[hf + "input_layernorm.weight"].clone()
        out[mc + "self_attention.linear_qkv.weight"] = _split_rows(qkv, tp_rank, tp_size).flatten(0, 1).clone()
        out[mc + "self_attention.linear_proj.weight"] = (
            hf_state[hf + "self_attn.o_proj.weight"].chunk(tp_size, dim=1)[tp_rank].clone())
        out[mc + "pre_mlp_layernorm.weight"] = hf_state[hf + "post_attention_layernorm.weight"].clone()
        gate = _split_rows(hf_state[hf + "mlp.gate_proj.weight"], tp_rank, tp_size)
        up = _split_rows(hf_state[hf + "mlp.up_proj.weight"], tp_rank, tp_size)
        out[mc + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[mc + "mlp.linear_fc2.weight"] = hf_state[hf + "mlp.down_proj.weight"].chunk(tp_size, dim=1)[tp_rank].clone()
    out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"].clone()
    if not getattr(hf_config, "tie_word_embeddings", False):
        out["output_layer.weight"] = vocab_rows(hf_state["lm_head.weight"])
    return out


def megatron_llama_config(hf_config: Any, dtype: torch.dtype, sequence_parallel: bool):
    """megatron-core's ``TransformerConfig`` for the model, from verl's own converter (``hf_to_mcore_config``) with
    the CPU's overrides; the parallel sizes are read from ``megatron.core.parallel_state`` (initialise it first)."""
    from verl.models.mcore.registry import hf_to_mcore_config

    return hf_to_mcore_config(hf_config, dtype, sequence_parallel=sequence_parallel, **CPU_OVERRIDES)


def megatron_llama_model(hf_config: Any, hf_state: dict[str, Tensor], dtype: torch.dtype = torch.float32,
                         sequence_parallel: bool = False):
    """This rank's ``GPTModel`` (local spec, ``parallel_output``) holding the checkpoint's weights in ``dtype``.

    Call on every rank of the tensor-parallel group after ``parallel_state.initialize_model_parallel`` and, on the
    CPU, ``apply_megatron_patches()``. The vocabulary is padded to a multiple of the TP size (logit columns from
    ``hf_config.vocab_size`` on are padding, exactly 0).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from verl.utils.megatron_utils import get_hf_rope_theta

    tp_size, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    _check_splits(hf_config, tp_size)
    config = megatron_llama_config(hf_config, dtype, sequence_parallel and tp_size > 1)
    if config.normalization != "RMSNorm" or not config.gated_linear_unit or config.add_bias_linear:
        raise ValueError(f"not a Llama: normalization={config.normalization}, gated_linear_unit="
                         f"{config.gated_linear_unit}, add_bias_linear={config.add_bias_linear}")
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":   # transformers 5: rope_scaling aliases it
        raise ValueError(f"RoPE scaling {rope} is not mapped: only the default rotary embedding is")
    model = GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm),
        vocab_size=padded_vocab_size(int(hf_config.vocab_size), tp_size),
        max_sequence_length=int(hf_config.max_position_embeddings), position_embedding_type="rope",
        rotary_base=get_hf_rope_theta(hf_config), parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
    state = megatron_state_dict(hf_state, hf_config, tp_rank, tp_size)
    expected = {k for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    if set(state) != expected:
        raise RuntimeError(f"the mapping and GPTModel disagree: only mapped {sorted(set(state) - expected)}, "
                           f"only in GPTModel {sorted(expected - set(state))}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model
