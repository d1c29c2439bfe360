"""Checkpoint and resume: an ``oar_g`` run resumed from its step-2 checkpoint trains steps 3-4 exactly as
the uninterrupted run did (same rollouts, importance, masks, GRPO and OAR advantages).

The hf rollout's sampling is what makes this possible (its module docstring: seeded per request from
the weights' step, the prompt and the request's rank among identical prompts); the in-process tests
below check that property directly, the slow test checks the whole trainer (two launches, minutes).
"""

from __future__ import annotations

import asyncio
import shutil
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


def test_seeded_sampler_draws_from_the_tempered_softmax():
    import torch

    from verl_oar.cpu.hf_rollout import _SeededSampler

    rows = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")]]).expand(rows, -1)
    for temperature in (1.0, 0.5):
        picks = _SeededSampler(list(range(rows)), temperature, 0, 1.0)(None, logits.clone()).argmax(-1)
        freq = torch.bincount(picks, minlength=6).double() / rows
        p = torch.softmax(logits[0].double() / temperature, -1)
        assert freq[-1] == 0  # never a token of probability 0
        assert torch.all((freq - p).abs() <= 4 * (p * (1 - p) / rows).sqrt() + 1e-12), (freq, p)
    top2 = _SeededSampler(list(range(1000)), 1.0, 2, 1.0)(None, logits[:1000].clone()).argmax(-1)
    assert set(top2.tolist()) == {0, 1}


# ---------------------------------------------------------------------------------------------------
# end to end: verl's trainer, 4 steps straight vs 2 + resume to 4
# ---------------------------------------------------------------------------------------------------

COMPARED = ("oar_importance", "oar_reasoning_mask", "oar_answer_mask", "grpo_advantages", "advantages", "weights")
"""dumped per-token fields that must agree between the two runs (all (bs, response_len), padded)"""


@pytest.mark.slow
def test_resumed_oar_g_run_trains_steps_3_and_4_like_the_uninterrupted_run(cpu_workspace_dir, tmp_path):
    """4 steps straight (checkpoints after steps 2 and 4) vs the same run resumed from its step-2
    checkpoint: steps 3 and 4 must roll out the same responses and dump bit-equal importance, masks,
    GRPO advantages, OAR weights and advantages (CPU, fp32, same seeds). verl restores the actor's
    weights, optimizer and lr scheduler, the dataloader position and the step number; the hf rollout
    seeds its sampling from the step; OAR's noise depends on (seed, step, tokens).

    Both runs use ``CONTENT_ORDERED_SAMPLER`` (_e2e.py): verl orders a training batch by the order in
    which rollouts finished, which differs between any two runs, and that order alone changes
    OAR-G's importance by ~3e-5 relative and, through the quantile weights, advantages by ~1e-2 by
    step 4."""
    from _e2e import (
        CONTENT_ORDERED_SAMPLER,
        check_reshaped_exactly_where_importance_varies,
        compare_dumped_steps,
        launch_steps,
    )

    from verl_oar.cpu.launch import read_metrics
    from verl_oar.cpu.overrides import metrics_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # run A: 4 steps straight, checkpoints after steps 2 and 4
    rc, log = launch_steps(
        cpu_workspace_dir, tmp_path / "a.log", "resume_a", 4, *CONTENT_ORDERED_SAMPLER,
        "trainer.save_freq=2", f"trainer.default_local_dir={straight / 'ckpt'}",
        f"+algorithm.oar.dump_dir={straight / 'dump'}", f"trainer.rollout_data_dir={straight / 'rollouts'}",
    )  # fmt: skip
    assert rc == 0, log[-6000:]
    checkpoint = straight / "ckpt" / "global_step_2"
    assert (checkpoint / "data.pt").exists(), sorted(p.name for p in checkpoint.parent.iterdir())
    # run B: from A's step-2 checkpoint (a copy: B writes its own step-4 checkpoint next to it) to step 4
    shutil.copytree(checkpoint, resumed / "ckpt" / "global_step_2")
    rc, log = launch_steps(
        cpu_workspace_dir, tmp_path / "b.log", "resume_b", 4, *CONTENT_ORDERED_SAMPLER,
        "trainer.save_freq=2", f"trainer.default_local_dir={resumed / 'ckpt'}",
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={resumed / 'ckpt' / 'global_step_2'}",
        f"+algorithm.oar.dump_dir={resumed / 'dump'}", f"trainer.rollout_data_dir={resumed / 'rollouts'}",
    )  # fmt: skip
    assert rc == 0, log[-6000:]
    # B resumed at step 3 (verl restored the step) and trained steps 3 and 4 only
    assert [r["step"] for r in read_metrics(metrics_file(cpu_workspace_dir, "resume_b"))] == [3, 4], log[-6000:]
    assert sorted(p.name for p in (resumed / "dump").iterdir()) == ["step_3.pt", "step_4.pt"], log[-6000:]

    # not vacuous: OAR reshaped GRPO's credit in each compared step
    for step in (3, 4):
        assert check_reshaped_exactly_where_importance_varies(resumed / "dump", steps=(step,)) > 0, step
    diffs = compare_dumped_steps(straight, resumed, steps=(3, 4), fields=COMPARED)  # bit-equal
    print("max |difference| per step and field, uninterrupted vs resumed:", diffs)
