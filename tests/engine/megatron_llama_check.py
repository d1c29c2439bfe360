"""A Hugging Face Llama in megatron-core's ``GPTModel`` on the CPU (``verl_oar.cpu.megatron_llama``): its logits
against transformers, and OAR's importance on it against verl's FSDP2 engine on the same rows.

Run by ``tests/engine/test_megatron_llama_on_cpu.py`` (a tiny random Llama) and ``benchmarks/megatron_smollm2.py``
(SmolLM2-135M), one process per rank of a WORLD-rank gloo group (torch.distributed's group is process-global):

    python megatron_llama_check.py RANK WORLD PORT MODEL_DIR ROWS OUT [IMPORTANCE_LAYOUTS]

ROWS is a JSON file ``{"prompts": [[id, ...], ...], "responses": [[id, ...], ...]}`` (each response ending with
its end token). Every rank scores all the rows, first on verl's FSDP2 engine through the plugin's
``OARActorRolloutRefWorker`` (fp32, packed rows, parameters sharded over the WORLD ranks;
``compute_token_importance``, OAR-G and OAR-P chunk, :data:`CASES`): ``fsdp_rank{r}.pt``, and with bf16
parameters (FSDP2 mixed precision) ``fsdp_bf16_rank{r}.pt``; then, for TP = 1 (data parallel WORLD), TP = WORLD,
and TP = WORLD with sequence parallelism, in fp32 and bf16, on the checkpoint as ``megatron_llama_model`` builds
it:

1. its logits at every token of every row through the plugin's ``MegatronLogits`` (verl's padded forward, rows of
   different lengths in one call), against ``LlamaForCausalLM`` on each row alone, unpadded: the fp32 model, and in
   bf16 also transformers' own bf16 model (how far bf16 alone moves transformers' logits);
2. OAR-G (plain and fused with verl's log-prob pass) and OAR-P chunk through ``megatron_importance_pass``, on the
   masks the driver computes (``engines.inputs.add_outcome_masks``, the same call ``engines.driver`` makes before
   the engine's pass); for the fused pass's log-probs, those of transformers' fp32 logits and of the layout's own
   logits (:func:`log_probs`);
3. (fp32, TP = 1 and TP = WORLD) the two layouts a mapping gets wrong most easily, to show that the logits check
   sees them: the query/key/value rows stacked whole as transformers keeps them instead of per query group, and
   the MLP's gate and up rows split over the ranks as one block instead of each shard holding its own of both.

Each rank writes ``{dtype}_{layout}_rank{r}.pt``. IMPORTANCE_LAYOUTS (comma-separated, e.g. ``tp3,tp3_sp``) limits 2.
to those layouts (the real model's OAR-P takes a minute per layout); default all.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SEED, STEP = 1234, 5
CASES = {  # name -> (oar_method, algorithm.oar keys)
    "g": ("gradient", dict(objective="noisy_kl", saliency="grad_x_input", outcome="mean", seed=3)),
    "p_chunk": ("perturbation", dict(perturb_mode="chunk", outcome="mean")),
}


def read_rows(path: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    with open(path) as f:
        rows = json.load(f)
    return ([torch.tensor(p, dtype=torch.long) for p in rows["prompts"]],
            [torch.tensor(r, dtype=torch.long) for r in rows["responses"]])


def make_batch(prompts, responses, method: str, oar: dict):
    """The rows as verl's v1 trainer hands a worker: nested prompt + response ids, every response token in the
    masks, temperature 1, and the plugin's importance keys."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_oar.engines.inputs import nested

    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    data = TensorDict({
        "prompts": nested(prompts), "responses": nested(responses),
        "response_mask": nested([torch.ones_like(r) for r in responses]),
        "loss_mask": nested([torch.ones_like(r) for r in responses]),
        "input_ids": nested(ids), "position_ids": nested([torch.arange(len(x)) for x in ids]),
        "attention_mask": nested([torch.ones_like(x) for x in ids]),
    }, batch_size=[len(ids)])
    tu.assign_non_tensor(data, temperature=1.0, oar_config=oar, oar_step=STEP, oar_method=method)
    return data


def _response_rows(scores, prompts, responses) -> list[torch.Tensor]:
    return [row[len(p): len(p) + len(r)].double() for row, p, r in zip(scores.unbind(), prompts, responses)]


# -- FSDP ---------------------------------------------------------------------------------------------------------


def fsdp_importance(model_dir: str, world: int, prompts, responses, param_dtype: str = "fp32") -> dict:
    """verl's FSDP2 engine through the plugin's worker on this rank's share of the parameters (every rank scores
    all rows), as ``tests/engine/engine_importance_check.py`` builds it: packed rows, one row per micro-batch,
    parameters in ``param_dtype`` (FSDP2 mixed precision, as a bf16 run computes)."""
    sys.path.insert(0, HERE)
    from engine_importance_check import build_worker

    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    worker = build_worker(model_dir, use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=1, param_offload=False,
                          param_dtype=param_dtype, max_token_len=max(96, longest),
                          extra=(f"actor_rollout_ref.actor.ppo_mini_batch_size={world}",))   # one row per rank
    out = {}
    for name, (method, oar) in CASES.items():
        result = worker.compute_token_importance(make_batch(prompts, responses, method, oar))
        out[name] = [r.double() for r in result["oar_importance"].unbind()]
        out[f"{name}_reasoning"] = [r.clone() for r in result["oar_reasoning_mask"].unbind()]
    return out


# -- Megatron -----------------------------------------------------------------------------------------------------


def hf_logits(model, prompts, responses) -> list[torch.Tensor]:
    """(len_i, V) float32 logits of each row alone, unpadded."""
    with torch.no_grad():
        return [model(input_ids=torch.cat([p, r])[None]).logits[0].float() for p, r in zip(prompts, responses)]


def log_probs(logits: list, prompts, responses, columns: int) -> list[torch.Tensor]:
    """(len_i - 1,) log-prob of each next token from (len_i, V) ``logits``, normalised as verl's processor does on
    megatron's output: over ``columns`` >= V, the padding columns' logits being exactly 0."""
    out = []
    for z, p, r in zip(logits, prompts, responses):
        z = torch.cat([z.float(), z.new_zeros(len(z), columns - z.shape[1], dtype=torch.float32)], 1)
        out.append(torch.log_softmax(z, -1)[:-1].gather(1, torch.cat([p, r])[1:, None])[:, 0].double())
    return out


def megatron_logits(engine, prompts, responses) -> list[torch.Tensor]:
    """(len_i, V) float32 logits of every token of every row, through the plugin's ``MegatronLogits`` (all rows in
    one call, verl's padded layout)."""
    from verl_oar.engines.inputs import nested
    from verl_oar.engines.megatron.forward import MegatronLogits

    forward = MegatronLogits(engine)
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    layout = forward.layout([len(x) for x in ids])
    with torch.no_grad():
        logits, _ = forward(nested(ids), layout, layout.flat_index())
    return list(logits.float().split([len(x) for x in ids]))


def max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def importance(engine, tokenizer, prompts, responses) -> dict:
    """OAR-G and OAR-P chunk on the Megatron path, one micro-batch, with the driver's masks; OAR-G once more fused
    with verl's log-prob pass (``g_fused``, and its per-token log-probs ``g_fused_log_probs``)."""
    from verl_oar.core.answer_locator import load_answer_locator
    from verl_oar.core.config import OARConfig, neutral_token_id
    from verl_oar.engines.inputs import add_outcome_masks
    from verl_oar.engines.megatron import megatron_importance_pass

    out = {}
    for name, (method, oar) in CASES.items():
        cfg = OARConfig(**oar)
        data = make_batch(prompts, responses, method, oar)
        add_outcome_masks(data, tokenizer, load_answer_locator(cfg.answer_locator), line_ends=False)
        with megatron_importance_pass(engine, data, cfg) as engine_pass:
            if method == "gradient":
                scores, _ = engine_pass.gradient(data, cfg, STEP, False)
                again = make_batch(prompts, responses, method, oar)
                add_outcome_masks(again, tokenizer, load_answer_locator(cfg.answer_locator), line_ends=False)
                fused, outputs = engine_pass.gradient(again, cfg, STEP, True)
                out[f"{name}_fused"] = _response_rows(fused, prompts, responses)
                # every token's but the last (verl's label there wraps around: not a token's)
                out[f"{name}_fused_log_probs"] = [r[:-1].double() for r in outputs["log_probs"].unbind()]
            else:
                scores, _ = engine_pass.perturbation(data, cfg, neutral_token_id(cfg, tokenizer), None, len(prompts))
        out[name] = _response_rows(scores, prompts, responses)
    return out


def wrong_layouts(model, hf_config, hf_state, engine, prompts, responses, want) -> dict:
    """Logit errors of the two easiest layout mistakes (module docstring, 3.), each applied to ``model`` in turn
    and undone."""
    from megatron.core import parallel_state as mpu

    tp, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    layer, prefix = model.decoder.layers[0], "model.layers.0."
    qkv = torch.cat([hf_state[prefix + f"self_attn.{x}_proj.weight"] for x in "qkv"]).chunk(tp)[rank]
    fc1 = torch.cat([hf_state[prefix + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]).chunk(tp)[rank]
    out = {}
    for name, param, wrong in (("qkv_stacked_whole", layer.self_attention.linear_qkv.weight, qkv),
                               ("fc1_split_as_one_block", layer.mlp.linear_fc1.weight, fc1)):
        if name == "fc1_split_as_one_block" and tp == 1:
            continue   # one rank holds [gate; up] either way
        right = param.detach().clone()
        with torch.no_grad():
            param.copy_(wrong)
        out[name] = max_diff(megatron_logits(engine, prompts, responses), want)
        with torch.no_grad():
            param.copy_(right)
    return out


def run_rank(rank: int, world: int, port: int, model_dir: str, rows_path: str, out_dir: str,
             importance_layouts: str | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), VERL_PLATFORM="cpu")
    torch.set_num_threads(1)
    import verl  # noqa: F401  (the plugin registers the cpu platform)
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_oar.cpu.megatron_llama import megatron_llama_model
    from verl_oar.cpu.megatron_patches import apply_megatron_patches

    sys.path.insert(0, HERE)
    from megatron_real_check import CPUMegatronEngine

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    prompts, responses = read_rows(rows_path)
    start = time.perf_counter()
    fsdp = fsdp_importance(model_dir, world, prompts, responses)
    fsdp["seconds"] = time.perf_counter() - start   # the worker's construction included
    torch.save(fsdp, os.path.join(out_dir, f"fsdp_rank{rank}.pt"))
    torch.save(fsdp_importance(model_dir, world, prompts, responses, "bf16"),
               os.path.join(out_dir, f"fsdp_bf16_rank{rank}.pt"))
    apply_megatron_patches()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    hf_config, hf_state = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}
    want = {"fp32": hf_logits(hf, prompts, responses)}
    want["bf16"] = hf_logits(hf.to(torch.bfloat16), prompts, responses)
    del hf
    scale = max(float(x.abs().max()) for x in want["fp32"])
    layouts = {"tp1": (1, False), f"tp{world}": (world, False), f"tp{world}_sp": (world, True)}
    scored = set(importance_layouts.split(",")) if importance_layouts else set(layouts)
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for layout, (tp, sp) in layouts.items():
            mpu.destroy_model_parallel()
            mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
            tensor_parallel.model_parallel_cuda_manual_seed(SEED)   # patched: looked up after apply_megatron_patches
            model = megatron_llama_model(hf_config, hf_state, dtype, sp).eval()
            engine = CPUMegatronEngine(model, hf_config, tokenizer.pad_token_id)
            got = megatron_logits(engine, prompts, responses)
            result = {"vocab_columns": int(model.embedding.word_embeddings.weight.shape[0]) * tp,
                      "logits_err": max_diff(got, want["fp32"]), "logits_scale": scale}
            if layout in scored:
                start = time.perf_counter()
                result.update(importance(engine, tokenizer, prompts, responses))
                result["importance_seconds"] = time.perf_counter() - start
            if dtype_name == "bf16":
                result["logits_err_vs_hf_bf16"] = max_diff(got, want["bf16"])
                result["hf_bf16_err"] = max_diff(want["bf16"], want["fp32"])
            else:
                result["hf_log_probs"] = log_probs(want["fp32"], prompts, responses, result["vocab_columns"])
            result["own_log_probs"] = log_probs(got, prompts, responses, result["vocab_columns"])
            if dtype_name == "fp32":
                if not sp:
                    result["wrong_layouts"] = wrong_layouts(model, hf_config, hf_state, engine, prompts, responses,
                                                            want["fp32"])
            torch.save(result, os.path.join(out_dir, f"{dtype_name}_{layout}_rank{rank}.pt"))
            del model, engine
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:8])
