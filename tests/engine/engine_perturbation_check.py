"""Run in its own process (torch.distributed's process group is global): OAR-P importance through
verl's real engine vs. the naive per-copy loop on plain transformers, for several engine settings.
Prints one JSON line per case.

    VERL_PLATFORM=cpu python tests/engine/engine_perturbation_check.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from engine_importance_check import PROMPTS, RESPONSES, build_model_dir, build_worker, make_batch, same, snapshot  # noqa: E402

# a response shorter than the padding in front of its (left-padded) prompt, and one with line breaks
EXTRA_PROMPTS = ["<|endoftext|>" * 16 + "What is 1+0?", "What is 5+5?"]
EXTRA_RESPONSES = ["1 \\boxed{1}", "5 and 5.\nThat is ten.\nSo \\boxed{10}"]


def naive_reference(model_dir, tokenizer, prompts, responses, oar: dict, temperature: float) -> list[torch.Tensor]:
    """One whole-sequence plain-transformers forward per occluded span, per sequence."""
    from _oar_p_reference import naive_perturbation_importance  # tests/ is on the path (engine_importance_check)
    from transformers import AutoModelForCausalLM

    from verl_oar.core.answer_span import line_break_tokens, locate_answer_tokens
    from verl_oar.core.config import OARConfig
    from verl_oar.core.perturbation import occlusion_spans

    cfg = OARConfig(**oar)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    neutral = cfg.perturb_token_id if cfg.perturb_token_id >= 0 else tokenizer.pad_token_id
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.cat([p, r])
        reasoning = torch.zeros(len(ids), dtype=torch.bool)
        predict = torch.zeros(len(ids), dtype=torch.bool)
        line_end = torch.zeros(len(ids), dtype=torch.bool)
        line_end[len(p):] = torch.tensor(line_break_tokens(r.tolist(), tokenizer))
        located = locate_answer_tokens(r.tolist(), tokenizer)
        if located is not None:
            reasoning[len(p):] = torch.tensor(located[0])
            predict[torch.nonzero(torch.tensor(located[1])).flatten() + len(p) - 1] = True
        span = occlusion_spans(reasoning, cfg.perturb_mode, cfg.perturb_budget, line_end)
        importance = naive_perturbation_importance(
            lambda x: model(input_ids=x).logits, ids, span, predict, neutral, cfg.outcome, temperature
        )
        out.append(importance[len(p):])
    return out


def main(out_dir: str) -> None:
    import engine_importance_check as base
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils import tensordict_utils as tu

    all_prompts, all_responses = PROMPTS + EXTRA_PROMPTS, RESPONSES + EXTRA_RESPONSES
    model_dir = build_model_dir(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cases = [
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=8, param_offload=False, outcome="mean", mode="exact"),
        dict(use_remove_padding=False, use_dynamic_bsz=False, micro_bsz=4, param_offload=False, outcome="single", mode="exact"),
        dict(use_remove_padding=True, use_dynamic_bsz=True, micro_bsz=1, param_offload=True, outcome="joint", mode="exact"),
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=2, param_offload=False, outcome="mean", mode="chunk"),
        dict(use_remove_padding=False, use_dynamic_bsz=True, micro_bsz=1, param_offload=False, outcome="mean", mode="line"),
    ]
    saved = list(base.PROMPTS), list(base.RESPONSES)  # run() swaps the shared batch; restored for later checks
    try:
        temperature = 0.8
        for case in cases:
            oar = dict(outcome=case["outcome"], perturb_mode=case["mode"], perturb_budget=3)
            settings = {k: v for k, v in case.items() if k not in ("outcome", "mode")}
            worker = build_worker(model_dir, **settings)
            engine = worker.actor.engine
            for p in engine.module.parameters():  # a real optimizer step: state and .grad to protect
                p.grad = torch.ones_like(p) * 1e-3
            engine.optimizer.step()
            before = snapshot(engine)

            def run(select=range(len(all_prompts))):
                base.PROMPTS[:] = [all_prompts[i] for i in select]
                base.RESPONSES[:] = [all_responses[i] for i in select]
                data, prompts, responses = make_batch(tokenizer, oar, step=1)
                tu.assign_non_tensor(data, oar_method="perturbation", temperature=temperature,
                                     oar_config=oar, oar_step=1)
                if len(select) != len(all_prompts):  # another micro-batch size too
                    tu.assign_non_tensor(data, micro_batch_size_per_gpu=1)
                return worker.compute_token_importance(data), prompts, responses

            output, prompts, responses = run()
            after = snapshot(engine)
            alone, _, _ = run([1])  # batch composition: the second sample alone
            reordered, _, _ = run([7, 1, 0])
            got = [t.float() for t in output["oar_importance"].unbind()]

            state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in engine.module.state_dict().items()}
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            hf.load_state_dict(state)
            ref_dir = os.path.join(out_dir, "current")
            hf.save_pretrained(ref_dir)
            tokenizer.save_pretrained(ref_dir)
            want = naive_reference(ref_dir, tokenizer, prompts, responses, oar, temperature)

            def maxdiff(a, b):
                return max(float((x - y).abs().max()) for x, y in zip(a, b))

            def rows(out):
                return [t.float() for t in out["oar_importance"].unbind()]

            print("CASE " + json.dumps({
                **case,
                "max_abs_err": maxdiff(got, want),
                "scale": max(float(w.abs().max()) for w in want),
                "alone_err": maxdiff(rows(alone), [got[1]]),
                "reordered_err": maxdiff(rows(reordered), [got[7], got[1], got[0]]),
                "state_unchanged": same(before, after),
                "answers_found": int(sum(int(a.any()) for a in output["oar_answer_mask"].unbind())),
                "nonzero_rows": int(sum(int(g.abs().sum() > 0) for g in got)),
                "distinct_values": [int(torch.unique(g[g != 0]).numel()) for g in got],
                "copies": output["oar_perturb_copies"].tolist(),
                "passes": output["oar_perturb_passes"].tolist(),
                "peak_tokens": output["oar_perturb_peak_tokens"].tolist(),
                "lengths": [len(p) + len(r) for p, r in zip(prompts, responses)],
            }), flush=True)
            del worker
    finally:
        base.PROMPTS[:], base.RESPONSES[:] = saved


if __name__ == "__main__":
    main(sys.argv[1])
