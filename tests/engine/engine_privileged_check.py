"""Run in its own process (torch.distributed's process group is global): the privileged re-scoring
pass of CSCR and OPPO through verl's real FSDP2 engine vs. plain transformers, for several engine
settings. Prints one JSON line per case.

    VERL_PLATFORM=cpu python tests/engine/engine_privileged_check.py OUT_DIR

The rows are built by ``integration.privileged_signal.privileged_rows`` with verl's rollout token
builder (what the trainer does), scored by the worker's own ``compute_log_prob`` (verl's packing,
micro-batching, dynamic batch size, offload) at the rollout temperature; the reference renders every
rewritten prompt with ``tokenizer.apply_chat_template`` (not verl's builder), shortens the question of
one past the context with ``core.privileged_prompt.fit_question`` on that rendering (a row that cannot
fit: its rollout prompt, as the pass) and scores one sequence at a time without padding. The
TransferQueue round trip around the call is covered end to end
(tests/e2e/test_privileged_e2e_on_cpu.py).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

from engine_importance_check import PROMPTS, RESPONSES, build_model_dir, build_worker

TEMPERATURE = 0.7
ANSWERS = ["7", "13", "6", "2", "6", "4.5"]


def templates() -> dict[str, str]:
    """The identity template and the methods' defaults."""
    from verl_oar.core.privileged_prompt import CSCR_NEGATIVE, CSCR_POSITIVE, OPPO_ORACLE

    return {"identity": "{question}", "cscr_pos": CSCR_POSITIVE, "cscr_neg": CSCR_NEGATIVE, "oppo": OPPO_ORACLE}


def rollout_rows(tokenizer):
    """(messages, prompt ids, response ids): the rollout's prompts rendered with the chat template."""
    messages = [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": p}] for p in PROMPTS]
    prompts = [torch.tensor(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False),
                            dtype=torch.long) for m in messages]
    responses = [torch.tensor(tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id], dtype=torch.long)
                 for r in RESPONSES]
    return messages, prompts, responses


def build(tokenizer, names: list[str], limit: float):
    """The pass's rows for ``names`` (template-major), as the trainer builds them, and its stats."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from verl_oar.integration.privileged_signal import RescoreStats, privileged_rows

    messages, prompts, responses = rollout_rows(tokenizer)
    builder = create_continuous_token_builder(tokenizer, hf_model_type="qwen2", chat_template_kwargs={})
    stats = RescoreStats()
    table = templates()
    rows = privileged_rows([table[n] for n in names], [f"k{i}" for i in range(len(PROMPTS))], messages, prompts,
                           responses, [torch.ones_like(r) for r in responses], ANSWERS, [False] * len(PROMPTS),
                           builder.build_initial_tokens, limit, "truncate", stats)
    return rows, stats


def engine_log_probs(worker, rows) -> list[torch.Tensor]:
    """The worker's compute_log_prob on the rows (a TensorDict as TransferQueue hands it), response tokens only."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.utils.padding import response_from_nested

    data = list_of_dict_to_tensordict(rows.rows)
    tu.assign_non_tensor(data, temperature=TEMPERATURE, calculate_entropy=False, compute_loss=False)
    output = worker.compute_log_prob(data)
    return [t.float() for t in response_from_nested(output["log_probs"], data["response_mask"]).unbind()]


def reference_prompts(tokenizer, names: list[str], limit: float) -> list[torch.Tensor]:
    """Per row (template-major): apply_chat_template on the rewritten messages; a prompt + response over ``limit``
    gets its question shortened from the middle (``fit_question`` with this rendering), or, when even an empty
    question does not fit, is scored on its rollout prompt (as the pass does for a row it skips)."""
    from verl_oar.core.privileged_prompt import fit_question, rewrite_messages

    def render(msgs):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    messages, prompts, responses = rollout_rows(tokenizer)
    table = templates()
    out = []
    for name in names:
        for m, rollout, r, answer in zip(messages, prompts, responses, ANSWERS):
            prompt = render(rewrite_messages(m, table[name], answer))
            if len(prompt) + len(r) > limit:
                prompt, _ = fit_question(m, table[name], answer, render, int(limit - len(r)))
            out.append(rollout if prompt is None else torch.tensor(prompt, dtype=torch.long))
    return out


def reference(model_dir: str, tokenizer, names: list[str], limit: float) -> list[torch.Tensor]:
    """Per sequence: ``reference_prompts`` + response, one sequence at a time, log-softmax(logits / T)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    _, _, responses = rollout_rows(tokenizer)
    out = []
    for prompt, r in zip(reference_prompts(tokenizer, names, limit), responses * len(names), strict=True):
        ids = torch.cat([prompt, r])[None]
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
        out.append(torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0])
    return out


def build_teacher_dir(root: str) -> str:
    """A second tiny model with the actor's tokenizer and other weights (the teacher stand-in)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor = build_model_dir(root)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    path = os.path.join(root, "teacher_model")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(actor).save_pretrained(path)
    return path


def teacher_cases(out_dir: str, tokenizer, names: list[str]) -> None:
    """OPPO's teacher oracle: the worker builds the teacher from ``actor_rollout_ref.oar_teacher`` beside the
    actor, with the reference model's engine settings (here fp32: verl's ref default is bf16);
    ``compute_teacher_log_prob`` equals plain transformers on the teacher's weights (not the actor's)."""
    model_dir = build_model_dir(out_dir)
    teacher_dir = build_teacher_dir(out_dir)
    for case in (dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=2, param_offload=False),
                 dict(use_remove_padding=True, use_dynamic_bsz=True, micro_bsz=1, param_offload=True, max_token_len=512)):
        ref = (["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=512"]
               if case["use_dynamic_bsz"] else [f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={case['micro_bsz']}"])
        fp32 = "+actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
        worker = build_worker(model_dir, **case, extra=(f"+actor_rollout_ref.oar_teacher.path={teacher_dir}", fp32, *ref))
        rows, _ = build(tokenizer, names, float("inf"))
        from verl.utils import tensordict_utils as tu
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict
        from verl.workers.utils.padding import response_from_nested

        data = list_of_dict_to_tensordict(rows.rows)
        tu.assign_non_tensor(data, temperature=TEMPERATURE, calculate_entropy=False, compute_loss=False)
        output = worker.compute_teacher_log_prob(data)
        got = [t.float() for t in response_from_nested(output["log_probs"], data["response_mask"]).unbind()]
        want = reference(teacher_dir, tokenizer, names, float("inf"))
        actor = reference(model_dir, tokenizer, names, float("inf"))
        print("CASE " + json.dumps({
            **case, "teacher": True,
            "full_max_abs_err": max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)),
            "teacher_vs_actor_min_max_diff": min(float((w - a).abs().max()) for w, a in zip(want, actor, strict=True)),
            "separate_engine": worker.oar_teacher is not None and worker.oar_teacher is not worker.actor,
        }), flush=True)
        del worker


def main(out_dir: str) -> None:
    from transformers import AutoTokenizer

    model_dir = build_model_dir(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    names = ["identity", "cscr_pos", "cscr_neg", "oppo"]
    _, prompts, responses = rollout_rows(tokenizer)
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    cases = [
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=6, param_offload=False),
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=2, param_offload=False),
        dict(use_remove_padding=False, use_dynamic_bsz=False, micro_bsz=3, param_offload=False),
        dict(use_remove_padding=True, use_dynamic_bsz=True, micro_bsz=1, param_offload=True, max_token_len=512),
    ]
    for case in cases:
        worker = build_worker(model_dir, **case)  # dynamic: a few rows per micro-batch of <= 512 tokens
        result = dict(case)
        # longest + 40: some privileged prompts fit whole, some only with a shortened question, some not at all
        for limit_name, limit in (("full", float("inf")), ("truncated", float(longest + 40))):
            rows, stats = build(tokenizer, names, limit)
            got = engine_log_probs(worker, rows)
            want = reference(model_dir, tokenizer, names, limit)
            errs = [float((g - w).abs().max()) for g, w in zip(got, want, strict=True)]
            result[f"{limit_name}_max_abs_err"] = max(errs)
            result[f"{limit_name}_prompts_equal"] = all(
                torch.equal(row["prompts"], p) for row, p in zip(rows.rows, reference_prompts(tokenizer, names, limit), strict=True))
            result[f"{limit_name}_truncated_rows"] = stats.truncated
            result[f"{limit_name}_skipped_rows"] = stats.skipped
            result[f"{limit_name}_scored_rows"] = sum(rows.scored)
            result[f"{limit_name}_rows"] = stats.rows
            result[f"{limit_name}_prompt_tokens_added"] = stats.prompt_tokens_added
            if limit_name == "full":
                # identity template: the rollout's own prompt, so the same log-probs as the rollout rows scored alone
                n = len(PROMPTS)
                plain = engine_log_probs(worker, type(rows)(rows.keys[:n], [
                    {**row, "prompts": p, "input_ids": torch.cat([p, r]), "position_ids": torch.arange(len(p) + len(r))}
                    for row, p, r in zip(rows.rows[:n], prompts, responses)], rows.tags[:n], rows.scored[:n]))
                result["identity_vs_rollout_max_abs_err"] = max(float((a - b).abs().max()) for a, b in zip(got[:n], plain))
                result["identity_prompt_equal"] = all(torch.equal(row["prompts"], p) for row, p in zip(rows.rows[:n], prompts))
        print("CASE " + json.dumps(result), flush=True)
        del worker
    teacher_cases(out_dir, tokenizer, names)


if __name__ == "__main__":
    main(sys.argv[1])
