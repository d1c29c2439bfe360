"""Run in its own process (torch.distributed's process group is global): ACPO's top-1 log-probs from verl's
real FSDP2 engine (``engines.fsdp.modal`` inside the worker's ``compute_log_prob``) vs. plain transformers,
and verl's own log-probs and entropy of the same pass vs. the pass without it. Prints one JSON line per case.

    VERL_PLATFORM=cpu python tests/engine/engine_modal_check.py OUT_DIR

Rows: the rollout rows of engine_privileged_check (system + user turn through the chat template, a response
and eos), scored at the rollout temperature (0.7) with verl's packing on and off, micro-batches of 6, 2 and 3,
dynamic batch size with parameter offload, in fp32 and in bf16 (verl's mixed precision: bf16 parameters,
fp32 reductions). The reference: one sequence at a time, no padding, max(z / T) - logsumexp(z / T) in fp32
on the fp32 model (in bf16 the engine is compared against it with a bf16 tolerance).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

from engine_importance_check import build_model_dir, build_worker
from engine_privileged_check import TEMPERATURE, build, rollout_rows


def _pass(worker, rows, modal: bool) -> dict[str, list[torch.Tensor]]:
    from verl.utils import tensordict_utils as tu
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.utils.padding import response_from_nested

    from verl_oar.engines.fsdp.modal import MODAL_KEY

    data = list_of_dict_to_tensordict(rows.rows)
    tu.assign_non_tensor(data, temperature=TEMPERATURE, calculate_entropy=True, compute_loss=False)
    if modal:
        tu.assign_non_tensor(data, oar_acpo_modal=True)
    output = worker.compute_log_prob(data)
    keys = ("log_probs", "entropy") + ((MODAL_KEY,) if modal else ())
    out = {k: [t.float() for t in response_from_nested(output[k], data["response_mask"]).unbind()] for k in keys}
    out["has_modal"] = MODAL_KEY in output.keys()
    return out


def reference(model_dir: str, tokenizer) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    _, prompts, responses = rollout_rows(tokenizer)
    out = []
    for p, r in zip(prompts, responses):
        with torch.no_grad():
            z = model(torch.cat([p, r])[None]).logits[0, len(p) - 1 : -1].float() / TEMPERATURE
        out.append(z.max(-1).values - torch.logsumexp(z, -1))
    return out


def main(out_dir: str) -> None:
    from transformers import AutoTokenizer

    model_dir = build_model_dir(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = reference(model_dir, tokenizer)
    rows, _ = build(tokenizer, ["identity"], float("inf"))
    cases = [
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=6, param_offload=False, param_dtype="fp32"),
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=2, param_offload=False, param_dtype="fp32"),
        dict(use_remove_padding=False, use_dynamic_bsz=False, micro_bsz=3, param_offload=False, param_dtype="fp32"),
        dict(use_remove_padding=True, use_dynamic_bsz=True, micro_bsz=1, param_offload=True, param_dtype="fp32", max_token_len=512),
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=2, param_offload=False, param_dtype="bf16"),
        dict(use_remove_padding=False, use_dynamic_bsz=False, micro_bsz=3, param_offload=False, param_dtype="bf16"),
    ]
    for case in cases:
        worker = build_worker(model_dir, **case)
        plain, fused = _pass(worker, rows, modal=False), _pass(worker, rows, modal=True)
        from verl_oar.engines.fsdp.modal import MODAL_KEY

        top1 = fused[MODAL_KEY]
        print("CASE " + json.dumps({
            **case,
            "rows": len(top1),
            "has_modal": fused["has_modal"], "plain_has_modal": plain["has_modal"],
            "log_probs_bit_identical": all(torch.equal(a, b) for a, b in zip(plain["log_probs"], fused["log_probs"], strict=True)),
            "entropy_bit_identical": all(torch.equal(a, b) for a, b in zip(plain["entropy"], fused["entropy"], strict=True)),
            "modal_max_abs_err": max(float((g - w).abs().max()) for g, w in zip(top1, want, strict=True)),
            # the top-1 log-prob is at least the sampled token's, in the same pass
            "modal_minus_sampled_min": min(float((m - s).min()) for m, s in zip(top1, fused["log_probs"], strict=True)),
            # and -log p_max <= Shannon entropy (the surrogate's lower bound)
            "entropy_minus_surrogate_min": min(float((h + m).min()) for h, m in zip(fused["entropy"], top1, strict=True)),
            "engine_restored": "prepare_model_outputs" not in worker.actor.engine.__dict__,
        }), flush=True)
        del worker


if __name__ == "__main__":
    main(sys.argv[1])
