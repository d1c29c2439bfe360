"""OAR's Megatron path on a real megatron-core ``GPTModel`` on the CPU: one rank of a 2-rank gloo group.

Run by ``tests/engine/test_megatron_real_on_cpu.py`` (``python megatron_real_check.py RANK WORLD PORT OUT``);
the process group is process-global, so the ranks are fresh interpreters. In one spawn, for fp32 and
bf16, three parallel layouts in turn: TP = 1 (data parallel 2: both ranks score the same batch), TP = 2
and TP = 2 with sequence parallelism, each a fresh ``GPTModel`` (local layer spec, CPU initialisation,
hidden 64, 2 layers, vocabulary 128; bf16 as ``params_dtype``, without verl's ``Float16Module``) built
from the same seed, so the weights are the same split differently. Through verl's own forward
(``gptmodel_forward_model_engine``, padded BSHD layout): OAR-G (``noisy_kl`` and ``loglik``, plain and
fused with verl's log-prob pass) and OAR-P (exact, chunk). First, on both ranks, each CPU patch's probe
before and after it is applied (``probes_rank{r}.pt``), and the packed layout's refusal. At TP = 1 rank 0 also computes the per-sequence references: ``core.gradient.gradient_importance``
on each sequence alone, unpadded, and the plain OAR-P loop (``tests/_oar_p_reference.py``), and a plain
log-softmax / entropy for the fused pass. Each rank writes ``{dtype}_{layout}_rank{r}.pt``.

verl's ``MegatronEngineWithLMHead`` cannot be built on the CPU (CUDA); :class:`CPUMegatronEngine`
holds what the plugin's Megatron path reads of it, with verl's own ``_lm_head_logits_processor``.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
HIDDEN, LAYERS, HEADS, VOCAB, SEED, STEP, TEMPERATURE = 64, 2, 4, 128, 1234, 5, 0.7
# (prompt, reasoning, answer) tokens; every sample ends with one more token. One sample has no answer.
SHAPES = [(4, 9, 3), (2, 5, 1), (6, 12, 2), (3, 4, 0)]
LAYOUTS = {"tp1": (1, False), "tp2": (2, False), "tp2_sp": (2, True)}
G_CASES = {  # name -> OARConfig keys, fused
    "noisy_kl": (dict(objective="noisy_kl", saliency="grad_x_input", outcome="mean"), False),
    "noisy_kl_fused": (dict(objective="noisy_kl", saliency="grad_x_input", outcome="mean"), True),
    "loglik": (dict(objective="loglik", saliency="grad_norm", outcome="mean"), False),
    "loglik_fused": (dict(objective="loglik", saliency="grad_norm", outcome="mean"), True),
}
P_CASES = {"exact": dict(perturb_mode="exact", outcome="mean"), "chunk": dict(perturb_mode="chunk", outcome="joint",
                                                                               perturb_budget=3)}


class CPUMegatronEngine:
    """What ``engines.megatron`` reads of verl's ``MegatronEngineWithLMHead`` (which needs CUDA to build):
    the model chunks, the engine and model configs, and verl's own log-prob / entropy processor."""

    def __init__(self, model, hf_config=None, pad_token_id: int = 0):
        """``hf_config``: the checkpoint's (``vocab_size``, ``hidden_size``, ``architectures``); default: this
        check's random ``GPTModel``'s."""
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

        self._processor = MegatronEngineWithLMHead._lm_head_logits_processor
        self.module = [model]
        self.engine_config = SimpleNamespace(use_remove_padding=False, pad_to_length=False, pad_to_length_bucket=None,
                                             pad_bshd_to_minibatch_max=True, dynamic_context_parallel=False,
                                             entropy_from_logits_with_chunking=False)
        if hf_config is None:
            hf_config = SimpleNamespace(vocab_size=VOCAB, hidden_size=HIDDEN, architectures=["Qwen2ForCausalLM"])
        self.model_config = SimpleNamespace(hf_config=hf_config, tokenizer=SimpleNamespace(pad_token_id=pad_token_id))

    def _lm_head_logits_processor(self, *args, **kwargs):
        return self._processor(self, *args, **kwargs)


def build_model(tp: int, sp: bool, dtype: torch.dtype):
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, normalization="RMSNorm",
    )
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                     max_sequence_length=64, position_embedding_type="rope", parallel_output=True,
                     share_embeddings_and_output_weights=False)
    return model


def make_micro_batch():
    """Rows of prompt + reasoning + answer + one token, masks as ``engines.inputs`` builds them."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_oar.engines.inputs import PREDICT, REASONING, nested

    g = torch.Generator().manual_seed(7)
    ids, reasoning, predict = [], [], []
    for p, k, a in SHAPES:
        n = p + k + a + 1
        ids.append(torch.randint(1, VOCAB, (n,), generator=g))
        r, d = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
        if a:
            r[p : p + k] = 1
            d[p + k - 1 : p + k + a - 1] = 1
        reasoning.append(r)
        predict.append(d)
    data = TensorDict({"input_ids": nested(ids), "position_ids": nested([torch.arange(len(x)) for x in ids]),
                       REASONING: nested(reasoning), PREDICT: nested(predict)}, batch_size=[len(ids)])
    tu.assign_non_tensor(data, temperature=TEMPERATURE, calculate_entropy=True)
    return data, ids, reasoning, predict


def copy_batch(data):
    from verl.utils import tensordict_utils as tu

    out = data.clone()
    tu.assign_non_tensor(out, temperature=TEMPERATURE, calculate_entropy=True)
    return out


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def untouched(model, before) -> bool:
    after = snapshot(model)
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return same and all(p.grad is None and p.requires_grad for p in model.parameters())


def engine_results(model) -> dict:
    """Every OAR pass of the plugin's Megatron path on the micro-batch."""
    from verl_oar.core.config import OARConfig
    from verl_oar.engines.megatron import MegatronImportancePass, megatron_importance_pass

    engine = CPUMegatronEngine(model)
    data, *_ = make_micro_batch()
    out = {}
    before = snapshot(model)
    with megatron_importance_pass(engine, data, OARConfig()) as engine_pass:
        assert isinstance(engine_pass, MegatronImportancePass)
        for name, (keys, fused) in G_CASES.items():
            scores, outputs = engine_pass.gradient(copy_batch(data), OARConfig(seed=3, **keys), STEP, fused)
            out[f"g_{name}"] = [r.double() for r in scores.unbind()]
            if fused:
                out[f"g_{name}_log_probs"] = [r.double() for r in outputs["log_probs"].unbind()]
                out[f"g_{name}_entropy"] = [r.double() for r in outputs["entropy"].unbind()]
        for name, keys in P_CASES.items():
            scores, costs = engine_pass.perturbation(copy_batch(data), OARConfig(**keys), 0, None, 2)
            out[f"p_{name}"] = [r.double() for r in scores.unbind()]
    out["untouched"] = untouched(model, before)
    return out


def references(model) -> dict:
    """Per-sequence, unpadded references on the TP = 1 model."""
    sys.path.insert(0, os.path.dirname(HERE))
    from _oar_p_reference import naive_perturbation_importance

    from verl_oar.core.config import OARConfig
    from verl_oar.core.gradient import gradient_importance
    from verl_oar.core.noise import sequence_noise
    from verl_oar.core.perturbation import occlusion_spans

    _, ids, reasoning, predict = make_micro_batch()

    def logits_of(x, embeds=None):  # (T,) ids [, (1, T, H) embeddings] -> (1, T, V)
        pos = torch.arange(len(x))[None]
        return model(input_ids=x[None], position_ids=pos, attention_mask=None,
                     decoder_input=None if embeds is None else embeds.transpose(0, 1))

    out = {}
    for name, (keys, _) in G_CASES.items():
        cfg = OARConfig(seed=3, **keys)
        rows = []
        for x, r, d in zip(ids, reasoning, predict):
            embeds = model.embedding(input_ids=x[None], position_ids=torch.arange(len(x))[None]).transpose(0, 1)
            noise = sequence_noise([x], HIDDEN, cfg.seed, STEP, where=[r.bool()])[0]
            rows.append(gradient_importance(
                lambda e, x=x: logits_of(x, e).float() / TEMPERATURE, embeds.detach(), r.bool()[None],
                d.bool()[None], torch.cat([x[1:], x[:1]])[None], torch.zeros(1, len(x), dtype=torch.long), 1,
                cfg.gradient_config(), noise=noise[None].to(embeds.dtype),
            )[0].double())
        model.zero_grad(set_to_none=True)
        out[f"g_{name}"] = rows
    with torch.no_grad():
        log_probs, entropy = [], []
        for x in ids:
            z = logits_of(x)[0].float() / TEMPERATURE
            lp = torch.log_softmax(z, -1)
            log_probs.append(lp[:-1].gather(1, x[1:, None])[:, 0].double())
            entropy.append(-(lp.exp() * lp).sum(-1).double())
    out["log_probs"], out["entropy"] = log_probs, entropy
    for name, keys in P_CASES.items():
        cfg = OARConfig(**keys)
        rows = []
        for x, r, d in zip(ids, reasoning, predict):
            span = occlusion_spans(r.bool(), cfg.perturb_mode, cfg.perturb_budget)
            rows.append(naive_perturbation_importance(lambda z: logits_of(z[0]), x, span, d.bool(), 0, cfg.outcome,
                                                      temperature=TEMPERATURE).double())
        out[f"p_{name}"] = rows
    return out


def _outcome(probe) -> str:
    try:
        probe()
    except Exception as exc:  # noqa: BLE001 - the probe records what the unpatched call raises
        return f"raised {type(exc).__name__}: {exc}"[:300]
    return "ran"


def patch_probes() -> dict:
    """Each patch of ``verl_oar.cpu.megatron_patches`` in turn: the call it is for, before and after it
    is applied ("raised ..." before: still needed; "ran" after: it works); applied in ``PATCHES`` order."""
    import dataclasses

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.utils import get_default_causal_mask  # noqa: F401 (imported before patching)

    from verl_oar.cpu.megatron_patches import PATCHES

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                               masked_softmax_fusion=False, attention_dropout=0.0)
    q = torch.randn(5, 2, 2, 4)   # [S, B, heads, head dim]
    keep = torch.ones(2, 5, dtype=torch.bool)

    def rng():
        tensor_parallel.model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            torch.rand(1)

    def norm():
        sp = dataclasses.replace(config, tensor_model_parallel_size=2, sequence_parallel=True)
        assert all(p.sequence_parallel for p in WrappedTorchNorm(sp, 8).parameters())

    def attention():
        attn = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        assert torch.equal(attn(q, q, q, keep), attn(q, q, q, None))   # no padding: [B, S] = causal only

    def causal_mask():
        import megatron.core.transformer.utils as utils

        assert torch.equal(utils.get_default_causal_mask(3), torch.ones(3, 3, dtype=torch.bool).triu(1))

    def rotary():   # asks torch.cuda.current_device() for its inverse frequencies' device
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        assert RotaryEmbedding(kv_channels=4, rotary_percent=1.0)(5).device.type == "cpu"

    probes = {"rng_tracker_on_cpu": rng, "current_device_is_cpu": rotary,
              "causal_mask_on_cpu": causal_mask, "torch_norm_with_sequence_parallel": norm,
              "padded_attention_mask": attention}
    mpu.initialize_model_parallel(tensor_model_parallel_size=1)
    out = {}
    for patch in PATCHES:
        before = _outcome(probes[patch.name])
        patch.apply(importlib.import_module(patch.module))
        out[patch.name] = {"before": before, "after": _outcome(probes[patch.name]), "applied": patch.applied()}
    mpu.destroy_model_parallel()
    return out


def thd_refusal() -> str:
    """What the plugin's Megatron path says to the packed layout on the CPU."""
    from verl_oar.engines.megatron.forward import MegatronLogits

    engine = CPUMegatronEngine(build_model(1, False, torch.float32))
    engine.engine_config.use_remove_padding = True
    return _outcome(lambda: MegatronLogits(engine))


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), VERL_PLATFORM="cpu")
    torch.set_num_threads(1)
    import verl  # noqa: F401  (the plugin registers the cpu platform)

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.save(patch_probes(), os.path.join(out_dir, f"probes_rank{rank}.pt"))
    from verl_oar.cpu.megatron_patches import apply_megatron_patches

    apply_megatron_patches()   # again: idempotent
    refused = thd_refusal()
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for layout, (tp, sp) in LAYOUTS.items():
            model = build_model(tp, sp, dtype)
            result = engine_results(model)
            if layout == "tp1" and rank == 0:
                result["reference"] = references(model)
            result["thd_refusal"] = refused
            torch.save(result, os.path.join(out_dir, f"{dtype_name}_{layout}_rank{rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
