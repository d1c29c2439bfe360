"""Build, offline, the chain_sum testbed: a tiny Qwen2 warm-started on chain_sum, verl RL data, a reward.

``build_testbed(directory, spec)`` writes into ``directory``::

    model/          byte-level tokenizer + tiny Qwen2 (as ``verl_oar.cpu.workspace``), warm-started
    data/train.parquet, data/val.parquet   chain_sum prompts in verl's RL format (``chain_sum.rl_rows``);
                    no tuple of numbers is in both
    reward.py       the reward: 1.0 if the last ``\\boxed{}`` equals the sum, else 0.0 (standard library only)
    testbed.json    spec, fingerprint, warm-start statistics (final loss, sampled parse rate and accuracy)

Reused from ``verl_oar.cpu.workspace`` by import: the tokenizer, the model constructor, the chat
template (through ``chat_prompt_ids``), parquet writing, the build lock and the thread setting. Building
again with the same spec reuses the directory (same ``fingerprint`` in ``testbed.json``).

Departures, on purpose:

1. The warm start is a plain torch loop (AdamW, next-token loss on response tokens), not verl's SFT
   trainer: a few hundred steps on canonical responses, about a minute on 2 cores.
2. It is tuned for *partial competence* only -- sampled responses at temperature 1 mostly parse
   (the oracle finds a trace) and are right sometimes, not always -- so that the answer depends on
   the trace and an importance ranking has something to find. It is not tuned on any OAR number.
3. No format bonus in the reward (unlike the CPU workspace's): chain_sum runs start from a model
   that already boxes its answers.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_oar.rewards import tiny_reward
from verl_oar.cpu.workspace import (
    all_cpu_threads,
    build_lock,
    build_tokenizer,
    chat_prompt_ids,
    new_tiny_model,
    read_manifest,
    save_model_dir,
    supervised_steps,
    write_parquet,
)
from verl_oar.testbed.chain_sum import (
    ChainSumProblem,
    make_problems,
    parse_response,
    rl_rows,
)

__all__ = ["TESTBED_VERSION", "Testbed", "TestbedSpec", "build_testbed", "sample_responses", "split_problems"]

TESTBED_VERSION = 1
"""bump when the layout or the recipe changes, so that old testbeds are rebuilt"""


@dataclass(frozen=True)
class TestbedSpec:
    """What to build; its fingerprint decides whether an existing testbed can be reused."""

    __test__ = False  # not a pytest class

    seed: int = 0
    """seeds the problems, the split, the model initialisation, the warm start and its sampling"""
    k_min: int = 3
    """fewest numbers to add"""
    k_max: int = 5
    """most numbers to add: k in 3..5 gives 2-4 steps and 55-130 character responses"""
    fillers_min: int = 2
    """fewest filler words per gap"""
    fillers_max: int = 4
    """most filler words per gap: with 2-4, a sampled trace has about 70 reasoning tokens, of which
    about 9 are numbers (chain) and 1-2 the last total (direct)"""
    n_train: int = 4000
    """prompts in data/train.parquet; the warm start trains on their canonical responses"""
    n_val: int = 200
    """prompts in data/val.parquet; their tuples of numbers are not in train"""
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    warm_start_steps: int = 600
    """supervised steps (see the module docstring, point 2). 600 x 16 at lr 5e-3, seed 0: 95% of
    sampled val responses parse, 12.5% are right, 3% have every total right (about a minute on one
    core); 1000 x 16 at lr 1e-2 (3 minutes) only reaches 98% / 16% / 19%"""
    warm_start_batch_size: int = 16
    warm_start_lr: float = 5e-3
    stats_samples: int = 64
    """val prompts sampled (temperature 1) for the warm-start statistics in testbed.json"""

    @property
    def k_range(self) -> tuple[int, int]:
        return (self.k_min, self.k_max)

    @property
    def fillers(self) -> tuple[int, int]:
        return (self.fillers_min, self.fillers_max)

    def fingerprint(self) -> str:
        import hashlib

        payload = json.dumps({"spec": asdict(self), "version": TESTBED_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(payload + reward_source().encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Testbed:
    """Paths of a built testbed, and its manifest (testbed.json)."""

    __test__ = False

    root: Path
    manifest: dict

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def train_file(self) -> Path:
        return self.root / "data" / "train.parquet"

    @property
    def val_file(self) -> Path:
        return self.root / "data" / "val.parquet"

    @property
    def reward_file(self) -> Path:
        return self.root / "reward.py"

    @property
    def spec(self) -> TestbedSpec:
        return TestbedSpec(**self.manifest["spec"])


MANIFEST = "testbed.json"
"""the manifest a finished build writes last (``cpu.workspace.read_manifest`` reads it)"""


def _log(msg: str) -> None:
    print(f"[verl-oar testbed] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------
# 1. Problems and the reward
# ---------------------------------------------------------------------------------------------------


def split_problems(spec: TestbedSpec) -> tuple[list[ChainSumProblem], list[ChainSumProblem]]:
    """(train, val) problems: val is the first ``n_val`` distinct tuples of numbers drawn with the
    seed; train is drawn from the same generator with every val tuple removed (repeats allowed)."""
    pool = make_problems(4 * (spec.n_train + spec.n_val), spec.k_range, spec.seed, spec.fillers)
    val, val_numbers = [], set()
    for problem in pool:
        if len(val) == spec.n_val:
            break
        if problem.numbers not in val_numbers:
            val.append(problem)
            val_numbers.add(problem.numbers)
    train = [p for p in pool if p.numbers not in val_numbers][: spec.n_train]
    if len(val) < spec.n_val or len(train) < spec.n_train:
        raise ValueError(
            f"chain_sum with k in {spec.k_range} gave {len(val)}/{spec.n_val} val and {len(train)}/{spec.n_train} "
            "train problems; lower n_val / n_train or widen the k range"
        )
    return train, val


_REWARD_HEADER = '''"""Reward of the chain_sum testbed (a verl ``reward.custom_reward_function``), standard library only.

Written by ``verl_oar.testbed.workspace.build_testbed`` (the box parser is
``verl_oar/rewards/tiny_reward.py``'s); verl loads it by path with ``.name=compute_score``.
Score: 1.0 if the content of the last complete ``\\\\boxed{...}`` equals the ground truth (the sum,
spaces ignored), else 0.0.
"""

from __future__ import annotations

_BOXED = "\\\\boxed{"

'''

_REWARD_SCORE = '''

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl reward-function signature: 1.0 for the right boxed sum, else 0.0."""
    boxed = last_boxed_content(solution_str)
    return 1.0 if boxed is not None and _normalize(boxed) == _normalize(str(ground_truth)) else 0.0
'''


def reward_source() -> str:
    """Text of reward.py: a header, ``tiny_reward``'s box parser (its source), and a 1/0 score."""
    parts = [inspect.getsource(tiny_reward.last_boxed_content), inspect.getsource(tiny_reward._normalize)]
    return _REWARD_HEADER + "\n\n".join(parts) + _REWARD_SCORE


# ---------------------------------------------------------------------------------------------------
# 2. Warm start and sampling
# ---------------------------------------------------------------------------------------------------


def warm_start(model, tokenizer, problems: Sequence[ChainSumProblem], spec: TestbedSpec) -> dict:
    """Supervised steps on ``prompt -> canonical response + <|im_end|>`` (loss on response tokens).

    Plain torch loop, AdamW with 20 warm-up steps then constant lr. Returns {"steps", "final_loss"
    (mean of the last 20 steps, nats/token), "seconds"}.
    """
    rng = random.Random(f"{spec.seed}/warm_start")
    examples = [
        (chat_prompt_ids(tokenizer, p.prompt), tokenizer.encode(p.response, add_special_tokens=False) + [tokenizer.eos_token_id])
        for p in problems
    ]
    start = time.time()
    losses = supervised_steps(
        model, tokenizer, examples, rng, steps=spec.warm_start_steps, batch_size=spec.warm_start_batch_size,
        lr=spec.warm_start_lr, log=_log,
    )
    tail = losses[-20:]
    return {
        "steps": spec.warm_start_steps,
        "final_loss": round(sum(tail) / max(1, len(tail)), 4),
        "seconds": round(time.time() - start, 1),
    }


def sample_responses(
    model, tokenizer, prompts: Sequence[str], *, seed: int, max_new_tokens: int, batch_size: int = 64
) -> list[tuple[list[int], list[int]]]:
    """Sample one response per prompt at temperature 1 (no top-k/top-p), batched with left padding.

    Returns [(prompt_ids, response_ids)], each a list of token ids without padding; a response stops
    at (and keeps) ``<|im_end|>`` or after ``max_new_tokens`` tokens. Seeded with ``torch.manual_seed(seed)``.
    """
    import torch

    torch.manual_seed(seed)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    out: list[tuple[list[int], list[int]]] = []
    for first in range(0, len(prompts), batch_size):
        chunk = [chat_prompt_ids(tokenizer, p) for p in prompts[first : first + batch_size]]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, p in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            attention[row, width - len(p) :] = 1
        with torch.no_grad():
            generated = model.generate(
                ids, attention_mask=attention, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
            )
        for row, p in enumerate(chunk):
            response = generated[row, width:].tolist()
            if eos in response:
                response = response[: response.index(eos) + 1]
            out.append((p, response))
    return out


def max_response_tokens(spec: TestbedSpec) -> int:
    """Sampling budget (tokens): the longest possible canonical response (byte tokenizer: one token
    per character) plus eos and a margin of 16."""
    longest_word = 5  # "right", "hmm ", ...: at most 5 characters plus a space
    gap = spec.fillers_max * (longest_word + 1)
    step = len("+9=") + 2 + 1  # operand, two-digit total, space
    answer = len("\\boxed{}") + 2
    return 2 + (spec.k_max - 1) * (gap + step) + gap + answer + 1 + 16


def sample_statistics(model, tokenizer, problems: Sequence[ChainSumProblem], spec: TestbedSpec) -> dict:
    """Sample one response per problem; {"parse_rate" (oracle found), "accuracy" (boxed == sum),
    "arithmetic_ok" (fraction of parsed traces whose totals are right), "mean_response_tokens", "example"}."""
    from verl_oar.core.answer_span import find_answer_span

    samples = sample_responses(
        model, tokenizer, [p.prompt for p in problems], seed=spec.seed, max_new_tokens=max_response_tokens(spec)
    )
    parsed = correct = arithmetic = 0
    lengths = []
    for problem, (_, response) in zip(problems, samples):
        text = tokenizer.decode(response, skip_special_tokens=True)
        trace = parse_response(text)
        parsed += trace is not None
        arithmetic += trace is not None and trace.arithmetic_ok
        answer = find_answer_span(text)
        correct += answer is not None and text[answer.start : answer.end].strip() == problem.answer
        lengths.append(len(response))
    n = len(problems)
    first = samples[0][1] if samples else []
    return {
        "samples": n,
        "parse_rate": round(parsed / n, 3),
        "accuracy": round(correct / n, 3),
        "arithmetic_ok": round(arithmetic / max(1, parsed), 3),
        "mean_response_tokens": round(sum(lengths) / n, 1),
        "example": f"{problems[0].prompt} -> {tokenizer.decode(first, skip_special_tokens=True)!r}" if n else None,
    }


# ---------------------------------------------------------------------------------------------------
# 3. Build
# ---------------------------------------------------------------------------------------------------


def build_testbed(directory: str | os.PathLike, spec: TestbedSpec | None = None, *, force: bool = False) -> Testbed:
    """Build (or reuse, same fingerprint) the chain_sum testbed in ``directory``; return its paths."""
    import torch

    spec = spec or TestbedSpec()
    root = Path(directory).expanduser().resolve()
    fingerprint = spec.fingerprint()
    with build_lock(root):
        manifest = read_manifest(root, MANIFEST)
        if not force and manifest is not None and manifest.get("fingerprint") == fingerprint:
            _log(f"reusing {root} (fingerprint {fingerprint})")
            return Testbed(root, manifest)

        start = time.time()
        _log(f"building into {root} (fingerprint {fingerprint})")
        (root / MANIFEST).unlink(missing_ok=True)
        for stale in ("model", "data"):
            shutil.rmtree(root / stale, ignore_errors=True)

        tokenizer = build_tokenizer()
        train, val = split_problems(spec)
        write_parquet(rl_rows(train, "train"), root / "data" / "train.parquet")
        write_parquet(rl_rows(val, "val"), root / "data" / "val.parquet")
        (root / "reward.py").write_text(reward_source())

        with all_cpu_threads():
            model = new_tiny_model(spec, tokenizer)
            warm = warm_start(model, tokenizer, train, spec)
            stats = sample_statistics(model, tokenizer, val[: spec.stats_samples], spec)
        _log(f"warm start: {warm}; sampled on {stats['samples']} val prompts: {stats}")

        save_model_dir(model, tokenizer, root / "model")

        manifest = {
            "fingerprint": fingerprint,
            "version": TESTBED_VERSION,
            "spec": asdict(spec),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "n_train": len(train),
            "n_val": len(val),
            "max_response_tokens": max_response_tokens(spec),
            "warm_start": warm,
            "val_samples": stats,
            "torch": torch.__version__,
            "build_seconds": round(time.time() - start, 1),
        }
        (root / MANIFEST).write_text(json.dumps(manifest, indent=2))  # written last: marks completion
        _log(f"built in {manifest['build_seconds']} s")
        return Testbed(root, manifest)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if an identical testbed exists")
    parser.add_argument("--steps", type=int, default=TestbedSpec.warm_start_steps, help="warm-start steps")
    args = parser.parse_args()
    bed = build_testbed(args.directory, TestbedSpec(warm_start_steps=args.steps), force=args.force)
    print(json.dumps(bed.manifest, indent=2))
