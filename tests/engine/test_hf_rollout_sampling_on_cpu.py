"""The hf rollout's reproducible sampling, in-process (no Ray): seeded per request from the weights'
step, the prompt and the request's rank among identical prompts, so a run resumed from a checkpoint
rolls out what the uninterrupted run did (the trainer-level check is tests/e2e/test_resume_on_cpu.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

# ---------------------------------------------------------------------------------------------------
# the hf rollout's reproducible sampling (in-process, no Ray)
# ---------------------------------------------------------------------------------------------------

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


@pytest.fixture
def hf_server(cpu_workspace_dir: Path):
    from verl.workers.config import HFModelConfig, RolloutConfig

    from verl_oar.cpu.hf_rollout import HFServer

    rollout = RolloutConfig(
        name="hf", tensor_model_parallel_size=1, dtype="float32", prompt_length=64, response_length=48, seed=7
    )
    model = HFModelConfig(path=str(cpu_workspace_dir / "model"), override_config={"attn_implementation": "sdpa"})
    return HFServer(rollout, model, replica_rank=0)


def _prompts(server, questions) -> list[list[int]]:
    tok = server.model_config.tokenizer
    out = []
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def _burst(server, prompts, params=SAMPLING, *, split: int | None = None):
    """Send ``prompts`` as the agent loop does (concurrently); with ``split``, the first ``split``
    arrive, then the rest after the server has started generating. Returns the outputs in order."""

    async def run():
        first = [asyncio.ensure_future(server.generate(prompt_ids=p, sampling_params=dict(params), request_id=str(i)))
                 for i, p in enumerate(prompts[:split])]
        if split is not None:
            await asyncio.sleep(0.2)  # the first batch is closed and generating
        rest = [server.generate(prompt_ids=p, sampling_params=dict(params), request_id=str(i))
                for i, p in enumerate(prompts[split:] if split is not None else [])]
        return await asyncio.gather(*first, *rest)

    return asyncio.run(run())


def _weight_update(server, step: int) -> None:
    """What verl does before each step's rollout: send the weights with the step they come from."""
    server.update_weights({k: v.clone() for k, v in server.model.state_dict().items()}, global_steps=step)


def _pairs(prompts, outs) -> list:
    return sorted((tuple(p), tuple(o.token_ids), tuple(o.log_probs)) for p, o in zip(prompts, outs))


def test_hf_rollout_samples_the_same_responses_whatever_the_arrival_order_and_rng_history(hf_server):
    import torch

    questions, n = ("What is 3+4?", "1+1?"), 3
    prompts = [p for p in _prompts(hf_server, questions) for _ in range(n)]  # prompts x n, as GRPO sends
    _weight_update(hf_server, 5)
    first = _pairs(prompts, _burst(hf_server, prompts))
    torch.manual_seed(123)  # the global RNG plays no part
    torch.rand(1000)
    shuffled = list(reversed(prompts))
    _weight_update(hf_server, 5)  # e.g. a run resumed from step 5's checkpoint
    again = _pairs(shuffled, _burst(hf_server, shuffled))
    assert again == first  # bit-equal: same rows, same batch, same order
    # n copies of a prompt are different samples, not one sample n times
    for i in range(len(questions)):
        assert len({pair[1] for pair in first[n * i : n * (i + 1)]}) > 1
    # a second burst before the next weight update: new samples, as the same prompt sent n more times
    assert _pairs(prompts, _burst(hf_server, prompts)) != first
    # another step: other samples
    _weight_update(hf_server, 6)
    assert _pairs(prompts, _burst(hf_server, prompts)) != first
    # split into two batches: the same tokens; log-probs of another batch shape agree to float rounding
    _weight_update(hf_server, 5)
    batches, real_generate_batch = [], hf_server._generate_batch
    hf_server._generate_batch = lambda rows, key: batches.append(len(rows)) or real_generate_batch(rows, key)
    try:
        split = _pairs(shuffled, _burst(hf_server, shuffled, split=2))
    finally:
        del hf_server._generate_batch
    assert batches == [2, len(prompts) - 2]
    assert [(p, t) for p, t, _ in split] == [(p, t) for p, t, _ in first]
    for (_, _, a), (_, _, b) in zip(split, first):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_hf_rollout_seeded_sampling_follows_the_requested_distribution(hf_server):
    """top-k 1 is greedy; at temperature 1 with top-k 3 every token is one of the 3 likeliest."""
    import torch

    prompt = _prompts(hf_server, ("What is 2+5?",))[0]
    _weight_update(hf_server, 1)
    greedy = _burst(hf_server, [prompt], {**SAMPLING, "temperature": 0})[0].token_ids
    top1 = _burst(hf_server, [prompt] * 3, {**SAMPLING, "top_k": 1})
    assert all(o.token_ids == greedy for o in top1)
    for out in _burst(hf_server, [prompt] * 3, {**SAMPLING, "top_k": 3}):
        with torch.no_grad():
            logits = hf_server.model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        ranks = (logits > logits.gather(-1, torch.tensor(out.token_ids)[:, None])).sum(-1)
        assert int(ranks.max()) < 3
