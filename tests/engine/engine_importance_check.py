"""Run in its own process (torch.distributed's process group is global): OAR-G importance through
verl's real engine vs. plain transformers, for several engine settings, with verl's default gradient
checkpointing (``enable_gradient_checkpointing=true``: OAR-G's pass recomputes the layers in its backward)
and once more without it. Prints one JSON line per case.

    VERL_PLATFORM=cpu python tests/engine/engine_importance_check.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _verl_config

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


os.environ.setdefault("VERL_PLATFORM", "cpu")
for key, val in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
    os.environ.setdefault(key, val)

RESPONSES = [  # real-looking math responses; the first tokens of the tokenized prompt precede each
    "3 plus 4: count 3, then 4 more, 5, 6, 7. So the sum is \\boxed{7}",
    "We add the units: 8+5=13, carry 1, so \\boxed{13}.",
    "I am not sure about this one",  # no answer: zero importance, fallback downstream
    "\\boxed{2}",  # answer first: no reasoning tokens
    "Ten minus four is six.\n#### 6",
    "Half of 9 is 4.5 and the answer is 4.5",
]
PROMPTS = ["What is 3+4?", "What is 8+5?", "What is 2*3?", "What is 1+1?", "What is 10-4?", "Half of 9?"]


def build_model_dir(root: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_oar.cpu.workspace import build_tokenizer

    path = os.path.join(root, "tiny_model")
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, torch_dtype="float32",
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_batch(tokenizer, oar: dict, step: int):
    """A TensorDict shaped like what verl's v1 trainer hands a worker from TransferQueue."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    prompts = [torch.tensor(tokenizer.encode(p), dtype=torch.long) for p in PROMPTS]
    responses = [torch.tensor(tokenizer.encode(r) + [tokenizer.eos_token_id], dtype=torch.long) for r in RESPONSES]
    nested = lambda rows: torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    input_ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    data = TensorDict(
        {
            "prompts": nested(prompts),
            "responses": nested(responses),
            "response_mask": nested([torch.ones_like(r) for r in responses]),
            "loss_mask": nested([torch.ones_like(r) for r in responses]),
            "input_ids": nested(input_ids),
            "position_ids": nested([torch.arange(len(x)) for x in input_ids]),
            "attention_mask": nested([torch.ones_like(x) for x in input_ids]),
        },
        batch_size=[len(prompts)],
    )
    tu.assign_non_tensor(data, temperature=1.0, oar_config=oar, oar_step=step)
    return data, prompts, responses


def hf_reference(model_dir: str, tokenizer, prompts, responses, oar: dict, step: int) -> list[torch.Tensor]:
    """Per-sequence plain-transformers reference (one sequence at a time, no padding, no packing)."""
    from transformers import AutoModelForCausalLM

    from verl_oar.core.answer_span import locate_answer_tokens
    from verl_oar.core.config import OARConfig
    from verl_oar.core.gradient import gradient_importance
    from verl_oar.core.hf import make_hf_logits_fn
    from verl_oar.core.noise import sequence_noise

    cfg = OARConfig(**oar)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    model.eval()
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.cat([p, r])
        located = locate_answer_tokens(r.tolist(), tokenizer)
        reasoning = torch.zeros(len(ids), dtype=torch.bool)
        predict = torch.zeros(len(ids), dtype=torch.bool)
        if located is not None:
            reasoning[len(p):] = torch.tensor(located[0])
            answer_positions = torch.nonzero(torch.tensor(located[1])).flatten() + len(p)
            predict[answer_positions - 1] = True
        targets = torch.cat([ids[1:], ids[:1]])
        noise = sequence_noise([ids], model.config.hidden_size, cfg.seed, step, where=[reasoning])[0]
        importance = gradient_importance(
            make_hf_logits_fn(model), model.get_input_embeddings()(ids[None]).detach(), reasoning[None], predict[None],
            targets[None], torch.zeros(1, len(ids), dtype=torch.long), 1, cfg.gradient_config(), noise=noise[None],
        )[0]
        out.append(importance[len(p):])
    return out


def build_worker(model_dir: str, *, use_remove_padding: bool, use_dynamic_bsz: bool, micro_bsz: int, param_offload: bool,
                 param_dtype: str = "fp32", max_token_len: int = 96, extra: tuple[str, ...] = ()):
    from _verl_config import compose_ppo_config

    from verl_oar.integration.worker import OARActorRolloutRefWorker

    config = compose_ppo_config([
        "algorithm.adv_estimator=oar_g",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.use_remove_padding={use_remove_padding}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={{param_dtype:{param_dtype},reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"actor_rollout_ref.actor.fsdp_config.param_offload={param_offload}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_bsz}",
        f"actor_rollout_ref.actor.use_dynamic_bsz={use_dynamic_bsz}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_token_len}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_bsz}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={max_token_len}",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        *extra,
    ])
    worker = OARActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def snapshot(engine) -> dict:
    """Parameters, their grads and the optimizer state, as plain CPU tensors."""
    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone().cpu()

    params = {n: local(p) for n, p in engine.module.named_parameters()}
    grads = {n: (None if p.grad is None else local(p.grad)) for n, p in engine.module.named_parameters()}
    requires = {n: p.requires_grad for n, p in engine.module.named_parameters()}
    state = engine.optimizer.state_dict()["state"] if engine.optimizer is not None else {}
    opt = {f"{k}.{kk}": local(v) for k, d in state.items() for kk, v in d.items() if torch.is_tensor(v)}
    return {"params": params, "grads": grads, "requires": requires, "opt": opt}


def same(a: dict, b: dict) -> bool:
    for key in a:
        for name in a[key]:
            x, y = a[key][name], b[key][name]
            if torch.is_tensor(x) or torch.is_tensor(y):
                if x is None or y is None or not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return True


def maxdiff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a.unbind(), b.unbind()))


def bitwise_equal(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))


def fused_vs_verl(worker, tokenizer, oar: dict, step: int) -> dict:
    """verl's own old-log-prob pass vs the fused one (which also yields importance)."""
    from verl.utils import tensordict_utils as tu

    plain_data, _, _ = make_batch(tokenizer, oar, step)
    fused_data, _, _ = make_batch(tokenizer, oar, step)
    for d in (plain_data, fused_data):
        tu.assign_non_tensor(d, calculate_entropy=True, compute_loss=False)
    tu.assign_non_tensor(fused_data, oar_fused=True)
    plain = worker.compute_log_prob(plain_data)
    fused = worker.compute_log_prob(fused_data)
    return {
        "fused_log_prob_identical": bitwise_equal(fused["log_probs"], plain["log_probs"]),
        "fused_entropy_identical": bitwise_equal(fused["entropy"], plain["entropy"]),
        "fused_log_prob_err": maxdiff(fused["log_probs"], plain["log_probs"]),
        "fused_entropy_err": maxdiff(fused["entropy"], plain["entropy"]),
        "log_prob_dtype": str(plain["log_probs"].dtype),
        "fused_importance": fused["oar_importance"],
    }


def without_checkpointing(worker, tokenizer, oar: dict, step: int) -> dict:
    """The importance pass again with the engine model's gradient checkpointing switched off (the layers' flag that
    ``gradient_checkpointing_enable()`` set, which ``core.hf.OutcomeHead`` reads), then on again; and whether it
    was on (verl's default ``enable_gradient_checkpointing=true``)."""
    from verl_oar.core.hf import checkpointed_layers

    layers = checkpointed_layers(worker.actor.engine.module)
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        data, _, _ = make_batch(tokenizer, oar, step)
        output = worker.compute_token_importance(data)
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True
    return {"gradient_checkpointing": bool(layers), "importance": output["oar_importance"]}


def zero_noise_importance(worker, tokenizer, step: int) -> float:
    """The largest OAR-G importance (noisy KL, AS-MEAN, gradient norm) when the noise is zero: the
    clean and the noisy outcome are then the same computation, so J and dJ/de must be exactly 0."""
    from verl_oar.engines.fsdp import gradient as engine_gradient

    real = engine_gradient.layout_noise
    engine_gradient.layout_noise = lambda *a, **k: torch.zeros_like(real(*a, **k))
    try:
        oar = dict(objective="noisy_kl", saliency="grad_norm", outcome="mean")
        data, _, _ = make_batch(tokenizer, oar, step)
        output = worker.compute_token_importance(data)
        fused_data, _, _ = make_batch(tokenizer, oar, step)
        from verl.utils import tensordict_utils as tu
        tu.assign_non_tensor(fused_data, calculate_entropy=True, compute_loss=False, oar_fused=True)
        fused = worker.compute_log_prob(fused_data)
    finally:
        engine_gradient.layout_noise = real
    return max(float(output["oar_importance"].values().abs().max()), float(fused["oar_importance"].values().abs().max()))


def main(out_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from transformers import AutoTokenizer

    model_dir = build_model_dir(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cases = [
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=6, param_offload=False, objective="noisy_kl"),
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=2, param_offload=False, objective="loglik"),
        dict(use_remove_padding=False, use_dynamic_bsz=False, micro_bsz=3, param_offload=False, objective="noisy_kl"),
        dict(use_remove_padding=True, use_dynamic_bsz=True, micro_bsz=1, param_offload=True, objective="noisy_kl"),
        # bf16 mixed precision, as real runs: verl's log-prob pass vs the fused one, and zero noise
        dict(use_remove_padding=True, use_dynamic_bsz=False, micro_bsz=3, param_offload=False, objective="noisy_kl",
             param_dtype="bf16"),
        dict(use_remove_padding=False, use_dynamic_bsz=False, micro_bsz=6, param_offload=False, objective="loglik",
             param_dtype="bf16"),
    ]
    step = 3
    for index, case in enumerate(cases):
        oar = dict(objective=case["objective"], saliency="grad_x_input", outcome="mean")
        bf16 = case.get("param_dtype", "fp32") == "bf16"
        worker = build_worker(model_dir, **{k: v for k, v in case.items() if k != "objective"})
        engine = worker.actor.engine
        # one real optimizer step first, so that there is optimizer state and a .grad to protect
        for p in engine.module.parameters():
            p.grad = torch.ones_like(p) * 1e-3
        engine.optimizer.step()
        before = snapshot(engine)
        data, prompts, responses = make_batch(tokenizer, oar, step)
        output = worker.compute_token_importance(data)
        after = snapshot(engine)
        got = [t.float() for t in output["oar_importance"].unbind()]
        fused = fused_vs_verl(worker, tokenizer, oar, step)
        after_fused = snapshot(engine)
        checkpointing = without_checkpointing(worker, tokenizer, oar, step)
        from verl_oar.engines.inputs import autocast_dtype

        result = {
            **case,
            # the plugin derives the dtype from the engine's public config; verl keeps it in a private attribute
            "autocast_dtype": str(autocast_dtype(engine)), "verl_autocast_dtype": str(engine._autocast_dtype),
            "gradient_checkpointing": checkpointing["gradient_checkpointing"],
            "checkpointed_importance_identical": bitwise_equal(checkpointing["importance"], output["oar_importance"]),
            "state_unchanged": same(before, after) and same(before, after_fused),
            "fused_importance_identical": bitwise_equal(fused.pop("fused_importance"), output["oar_importance"]),
            **fused,
            "reasoning_tokens": int(output["oar_reasoning_mask"].values().sum()),
            "answers_found": int(sum(int(a.any()) for a in output["oar_answer_mask"].unbind())),
            "nonzero_rows": int(sum(int(g.abs().sum() > 0) for g in got)),
        }
        if index in (0, 4):
            result["zero_noise_max_importance"] = zero_noise_importance(worker, tokenizer, step)
        if not bf16:  # plain-transformers reference with the engine's current weights
            ref_dir = os.path.join(out_dir, "current")
            state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                     for n, p in engine.module.state_dict().items()}
            from transformers import AutoModelForCausalLM
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            hf.load_state_dict(state)
            hf.save_pretrained(ref_dir)
            tokenizer.save_pretrained(ref_dir)
            want = hf_reference(ref_dir, tokenizer, prompts, responses, oar, step)
            result["max_abs_err"] = max(float((g - w).abs().max()) for g, w in zip(got, want))
            result["scale"] = max(float(w.abs().max()) for w in want)
        print("CASE " + json.dumps(result), flush=True)
        del worker


if __name__ == "__main__":
    main(sys.argv[1])
