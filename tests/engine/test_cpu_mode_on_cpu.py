"""CPU mode (``verl_oar.cpu``): platform, verl patches, workspace, reward, hf rollout.

verl resolves its platform once per process, so what needs ``VERL_PLATFORM=cpu`` runs in a fresh
interpreter shared with the import-graph check (``cpu_mode_process``, tests/conftest.py); the rest runs
in-process. The trainer runs in CPU mode are tests/e2e.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from verl_oar.rewards.tiny_reward import FORMAT_BONUS, compute_score, last_boxed_content


# ---------------------------------------------------------------------------------------------------
# platform and patches
# ---------------------------------------------------------------------------------------------------


def test_cpu_platform_registers_runs_a_gloo_collective_and_finds_every_patch_target_in_a_fresh_process(
    cpu_mode_process,
):
    """``CPU_PLATFORM_CHECK`` (tests/_fresh_process.py) in the shared fresh CPU-mode interpreter."""
    assert cpu_mode_process.returncode == 0, cpu_mode_process.failure()
    assert "CPU-PLATFORM-OK" in cpu_mode_process.stdout, cpu_mode_process.failure()
    found = [line for line in cpu_mode_process.stdout.splitlines() if line.startswith("ok ")]
    assert len(found) == 5, cpu_mode_process.stdout  # the five CPU-mode patches, each target found


def test_a_missing_patch_target_fails_loudly_with_its_name():
    from verl_oar.cpu.verl_patches import VerlPatch, VerlPatchError

    ghost = VerlPatch(
        name="ghost",
        module="verl.utils.distributed",
        attribute="function_that_verl_does_not_have",
        why="test",
        apply=lambda module: None,
    )
    with pytest.raises(VerlPatchError, match="verl.utils.distributed.function_that_verl_does_not_have"):
        ghost.target()


def test_cpu_mode_refuses_without_explicit_opt_in(monkeypatch):
    from verl_oar.cpu.platform import register_cpu_platform

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    with pytest.raises(RuntimeError, match="VERL_PLATFORM=cpu"):
        register_cpu_platform()


def test_dedup_backend():
    from verl_oar.cpu.verl_patches import dedup_backend

    assert dedup_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert dedup_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"


# ---------------------------------------------------------------------------------------------------
# workspace
# ---------------------------------------------------------------------------------------------------


def test_workspace_contents(cpu_workspace_dir: Path):
    import pandas as pd

    manifest = json.loads((cpu_workspace_dir / "workspace.json").read_text())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (cpu_workspace_dir / "model" / name).exists(), name
    assert (cpu_workspace_dir / "reward.py").read_text() == Path(
        __import__("verl_oar.rewards.tiny_reward", fromlist=["x"]).__file__
    ).read_text()
    assert json.loads((cpu_workspace_dir / "model" / "config.json").read_text())["model_type"] == "qwen2"

    train = pd.read_parquet(cpu_workspace_dir / "data" / "train.parquet")
    val = pd.read_parquet(cpu_workspace_dir / "data" / "val.parquet")
    assert len(train) == manifest["spec"]["n_train"] and len(val) == manifest["spec"]["n_val"]
    row = train.iloc[0]
    assert set(train.columns) >= {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("What is ")
    a, b = row["prompt"][0]["content"][len("What is ") : -1].split("+")
    assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))
    assert not set(train["extra_info"].map(lambda e: e["question"])) & set(
        val["extra_info"].map(lambda e: e["question"])
    )

    # the warm start leaves a model that answers in \boxed{} and is sometimes right, sometimes wrong
    samples = manifest["train_samples"]
    assert samples["boxed_rate"] >= 0.7, samples
    assert 0.05 <= samples["accuracy"] <= 0.95, samples


def test_workspace_tokenizer_reloads_as_qwen2_and_round_trips(cpu_workspace_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cpu_workspace_dir / "model")
    text = "What is 3+4? Add 3 and 4: 7. \\boxed{7} — ünïcode"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert all(i < 256 for i in ids)  # bytes only
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.encode("\n", add_special_tokens=False) == [10]  # verl's Qwen chat-token builder needs this
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3+4?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"


def test_workspace_build_is_reused(cpu_workspace_dir: Path):
    from verl_oar.cpu.workspace import build_workspace

    weights = cpu_workspace_dir / "model" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    build_workspace(cpu_workspace_dir)
    assert weights.stat().st_mtime_ns == before


# ---------------------------------------------------------------------------------------------------
# reward
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("3 plus 4 makes 7. \\boxed{7}", 1.0 + FORMAT_BONUS),
        ("3 plus 4 makes 8. \\boxed{8}", FORMAT_BONUS),
        ("\\boxed{6} no wait \\boxed{7}", 1.0 + FORMAT_BONUS),  # the last box counts
        ("\\boxed{7} no wait \\boxed{6}", FORMAT_BONUS),
        ("\\boxed{ 7 }", 1.0 + FORMAT_BONUS),
        ("3 plus 4 makes 7.", 0.0),  # no final answer
        ("3 plus 4 makes 7. \\boxed{7", 0.0),  # truncated
        ("\\boxed{7} then truncated \\boxed{", 1.0 + FORMAT_BONUS),  # earlier complete box
        ("", 0.0),
    ],
)
def test_reward_scores_hand_written_responses(response: str, expected: float):
    assert compute_score("verl_oar/tiny_arithmetic", response, "7") == pytest.approx(expected)


def test_last_boxed_content_handles_nested_braces():
    assert last_boxed_content("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert last_boxed_content("nothing here") is None


# ---------------------------------------------------------------------------------------------------
# hf rollout server (in-process, no Ray)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_server(cpu_workspace_dir: Path):
    from verl.workers.config import HFModelConfig, RolloutConfig

    from verl_oar.cpu.hf_rollout import HFServer

    rollout = RolloutConfig(
        name="hf", tensor_model_parallel_size=1, dtype="float32", prompt_length=64, response_length=48
    )
    model = HFModelConfig(path=str(cpu_workspace_dir / "model"), override_config={"attn_implementation": "sdpa"})
    return HFServer(rollout, model, replica_rank=0)


def _prompt_ids(server, question: str) -> list[int]:
    tok = server.model_config.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _generate(server, prompt_ids, **params):
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    sampling.update(params)
    return asyncio.run(server.generate(prompt_ids=prompt_ids, sampling_params=sampling, request_id="t"))


def test_hf_rollout_log_probs_match_a_full_forward(hf_server):
    import torch

    prompt = _prompt_ids(hf_server, "What is 3+4?")
    out = _generate(hf_server, prompt)
    assert 1 <= len(out.token_ids) <= 48 and len(out.log_probs) == len(out.token_ids)
    with torch.no_grad():
        logits = hf_server.model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-5)


def test_hf_rollout_batches_concurrent_requests_without_changing_them(hf_server):
    """Requests sent at once (as the agent loop sends a step's prompts x n) are generated as one
    left-padded batch; each row's log-probs still equal a full forward of that sequence alone, and
    greedy answers equal the unbatched ones."""
    import torch

    prompts = [_prompt_ids(hf_server, q) for q in ("What is 3+4?", "What is 12+30?", "1+1?", "What is 7+8+9?")]
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    batches = []
    real_generate_batch = hf_server._generate_batch

    def counting(prompts_, key):
        batches.append(len(prompts_))
        return real_generate_batch(prompts_, key)

    async def burst(params):
        return await asyncio.gather(
            *[hf_server.generate(prompt_ids=p, sampling_params=dict(params), request_id=str(i)) for i, p in enumerate(prompts)]
        )

    hf_server._generate_batch = counting
    try:
        outs = asyncio.run(burst(sampling))
        greedy = asyncio.run(burst({**sampling, "temperature": 0}))
    finally:
        del hf_server._generate_batch
    assert batches == [len(prompts), len(prompts)]
    for prompt, out in zip(prompts, outs):
        assert 1 <= len(out.token_ids) <= 48 and len(out.log_probs) == len(out.token_ids)
        with torch.no_grad():
            logits = hf_server.model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-5)
        assert all(t not in hf_server.eos_token_ids for t in out.token_ids[:-1])
    for prompt, out in zip(prompts, greedy):
        assert out.token_ids == _generate(hf_server, prompt, temperature=0).token_ids


def test_hf_rollout_respects_max_tokens_eos_and_greedy(hf_server):
    prompt = _prompt_ids(hf_server, "What is 2+5?")
    short = _generate(hf_server, prompt, max_tokens=5)
    assert len(short.token_ids) == 5
    greedy_a = _generate(hf_server, prompt, temperature=0)
    greedy_b = _generate(hf_server, prompt, temperature=0)
    assert greedy_a.token_ids == greedy_b.token_ids
    assert greedy_a.token_ids[-1] in hf_server.eos_token_ids  # a warm-started model stops by itself
    assert hf_server.eos_token_ids.count(greedy_a.token_ids[-1]) == 1
    assert all(t not in hf_server.eos_token_ids for t in greedy_a.token_ids[:-1])
    no_logprobs = _generate(hf_server, prompt, logprobs=False)
    assert no_logprobs.log_probs is None


def test_hf_rollout_takes_weight_updates(hf_server):
    import torch

    prompt = _prompt_ids(hf_server, "What is 1+1?")
    original = {k: v.clone() for k, v in hf_server.model.state_dict().items()}
    try:
        # a full update (what verl sends) whose output embedding is zero: every token equally likely
        zeroed = dict(original)
        output_name = "lm_head.weight" if "lm_head.weight" in zeroed else "model.embed_tokens.weight"
        zeroed[output_name] = torch.zeros_like(original[output_name])
        info = hf_server.update_weights(zeroed, global_steps=3)
        assert info["loaded"] == len(zeroed) and hf_server.global_steps == 3
        out = _generate(hf_server, prompt, max_tokens=4, ignore_eos=True)  # uniform: EOS could come early
        vocab = hf_server.model.config.vocab_size
        assert out.log_probs == pytest.approx([-float(torch.log(torch.tensor(float(vocab))))] * 4, abs=1e-5)
        with pytest.raises(RuntimeError, match="unexpected"):
            hf_server.update_weights({**original, "not.a.parameter": torch.zeros(1)})
        with pytest.raises(RuntimeError, match="missing"):  # partial updates would leave stale weights
            hf_server.update_weights({output_name: original[output_name]})
    finally:
        hf_server.model.load_state_dict(original)


def test_cpu_mode_refuses_a_process_whose_verl_platform_is_already_another_device(tmp_path):
    """verl creates its platform once per process: registering the cpu platform after verl resolved another one
    (here its fallback, nvidia) would leave verl on that device, so it is refused, naming the fix."""
    import os
    import subprocess
    import sys

    code = (
        "import os\n"
        "from verl.plugin.platform import get_platform\n"
        "assert get_platform().device_name == 'cuda'\n"
        "os.environ['VERL_PLATFORM'] = 'cpu'\n"
        "from verl_oar.cpu.platform import register_cpu_platform\n"
        "try:\n"
        "    register_cpu_platform()\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED verl's platform was already initialised as 'cuda'" in proc.stdout, proc.stdout
    assert "set VERL_PLATFORM=cpu before importing verl" in proc.stdout
