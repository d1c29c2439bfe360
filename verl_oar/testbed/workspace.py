"""The pick_max testbed: a tiny Qwen2 warm-started on pick_max, verl RL data and a reward, committed.

The demo starts from the committed testbed (``committed_testbed()``: ``verl_oar/testbed/start/``) on
every machine, because a warm start is not bit-identical across CPUs. ``build_testbed(directory,
spec)`` is the script that rebuilt it (``python -m verl_oar.testbed.workspace DIR``) and writes::

    model/          byte-level tokenizer + tiny Qwen2 (as ``verl_oar.cpu.workspace``), warm-started
    teacher/        OPPO's teacher, built from model/ by ``verl_oar.testbed.teacher`` (not by this script)
    data/train.parquet, data/val.parquet   pick_max prompts in verl's RL format (``pick_max.rl_rows``);
                    no prompt is in both
    reward.py       the reward: 1.0 if the last ``\\boxed{}`` holds the larger digit of every pair, else 0.0
    testbed.json    spec, fingerprint, warm-start statistics, and the machine that built it

Reused from ``verl_oar.cpu.workspace`` by import: the tokenizer, the model constructor, the chat
template (through ``chat_prompt_ids``), parquet writing, the build lock and the thread setting.

The warm start is a plain torch loop (AdamW, next-token loss on response tokens), not verl's SFT
trainer, on responses whose picks are right only part of the time (``pick_max.warm_start_response``):
docs/testbed.md gives the decision and its reasons. No format bonus in the reward: the model already
boxes its answers.
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
from verl_oar.rewards import tiny_reward
from verl_oar.testbed.machine import machine_info
from verl_oar.testbed.pick_max import PickMaxProblem, make_problems, parse_response, rl_rows, warm_start_response

__all__ = [
    "COMMITTED",
    "TESTBED_VERSION",
    "Testbed",
    "TestbedSpec",
    "build_testbed",
    "check_spec",
    "committed_testbed",
    "context_tokens",
    "copy_testbed",
    "is_right",
    "max_response_tokens",
    "sample_responses",
    "sample_statistics",
    "split_problems",
]

TESTBED_VERSION = 3
"""3: pick_max with repeated-letter gaps in the warm start (2: without; 1 was chain_sum)"""
COMMITTED = Path(__file__).parent / "start"
"""the committed testbed the demo starts from"""
MANIFEST = "testbed.json"
"""the manifest a finished build writes last (``cpu.workspace.read_manifest`` reads it)"""


@dataclass(frozen=True)
class TestbedSpec:
    """What to build; its fingerprint decides whether an existing testbed can be reused."""

    __test__ = False  # not a pytest class

    seed: int = 0
    """seeds the problems, the split, the model initialisation, the warm start and its sampling"""
    pairs: int = 2
    """pairs of digits per prompt: the pivotal decisions of a response"""
    pick_max_prob: float = 0.4
    """warm-start data: probability that a pick is the pair's larger digit (else its first digit)"""
    filler_words: int = 2
    """filler words per gap (before each pick and after the last)"""
    word_length: int = 3
    """letters per filler word, each uniform over a..z"""
    filler_repeat_prob: float = 0.15
    """warm-start data: probability that a gap is one letter repeated (``"qqq qqq"``): puts greedy
    decoding's repeated-letter context in distribution (``pick_max.filler_gap``)"""
    n_train: int = 4000
    n_val: int = 200
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    warm_start_steps: int = 4000
    warm_start_batch_size: int = 32
    warm_start_lr: float = 3e-3
    stats_samples: int = 64
    """val prompts sampled (temperature 1) and decoded greedily for the statistics in testbed.json"""
    init_from: str = ""
    """"": the warm start begins from a fresh model; else the fingerprint of the committed start
    (``testbed/start``), whose model begins it (the long-filler variants, ``testbed.variants``: the
    start already picks and copies, the warm start then teaches the longer gaps)"""

    def record(self) -> dict:
        """The spec as testbed.json and the fingerprint record it: every field, except those added after
        version 3 (``init_from``) while at their default, so the committed start's record and
        fingerprint are what they were."""
        fields = asdict(self)
        for name in _ADDED_AFTER_V3:
            if fields[name] == TestbedSpec.__dataclass_fields__[name].default:
                del fields[name]
        return fields

    def fingerprint(self) -> str:
        import hashlib

        payload = json.dumps({"spec": self.record(), "version": TESTBED_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(payload + reward_source().encode()).hexdigest()[:16]


_ADDED_AFTER_V3 = ("init_from",)


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
    def teacher_dir(self) -> Path:
        """OPPO's teacher for this start (``testbed.teacher``; built separately, checked by fingerprint)"""
        return self.root / "teacher"

    @property
    def spec(self) -> TestbedSpec:
        return TestbedSpec(**self.manifest["spec"])


def _log(msg: str) -> None:
    print(f"[verl-oar testbed] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------
# 1. Problems and the reward
# ---------------------------------------------------------------------------------------------------


def split_problems(spec: TestbedSpec) -> tuple[list[PickMaxProblem], list[PickMaxProblem]]:
    """(train, val): val is the first ``n_val`` distinct prompts drawn with the seed; train is drawn
    from the same generator with every val prompt removed (repeats allowed)."""
    pool = make_problems(4 * (spec.n_train + spec.n_val), spec.pairs, spec.seed, pick_max_prob=spec.pick_max_prob,
                         words=spec.filler_words, word_length=spec.word_length, repeat_prob=spec.filler_repeat_prob)
    val, val_pairs = [], set()
    for problem in pool:
        if len(val) == spec.n_val:
            break
        if problem.pairs not in val_pairs:
            val.append(problem)
            val_pairs.add(problem.pairs)
    train = [p for p in pool if p.pairs not in val_pairs][: spec.n_train]
    if len(val) < spec.n_val or len(train) < spec.n_train:
        raise ValueError(f"pick_max with {spec.pairs} pairs gave {len(val)}/{spec.n_val} val and {len(train)}/"
                         f"{spec.n_train} train problems; lower n_val / n_train or add pairs")
    return train, val


_REWARD_HEADER = '''"""Reward of the pick_max testbed (a verl ``reward.custom_reward_function``), standard library only.

Written by ``verl_oar.testbed.workspace.build_testbed`` (the box parser is
``verl_oar/rewards/tiny_reward.py``'s); verl loads it by path with ``.name=compute_score``.
Score: 1.0 if the content of the last complete ``\\\\boxed{...}`` equals the ground truth (the larger
digit of every pair, concatenated; spaces ignored), else 0.0.
"""

from __future__ import annotations

_BOXED = "\\\\boxed{"

'''

_REWARD_SCORE = '''

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl reward-function signature: 1.0 for the right boxed answer, else 0.0."""
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


def warm_start(model, tokenizer, problems: Sequence[PickMaxProblem], spec: TestbedSpec) -> dict:
    """Supervised steps on ``prompt -> warm-start response + <|im_end|>`` (loss on response tokens).

    Every example is the prompt of a train problem (cycled) with a *freshly drawn* warm-start response
    (``pick_max.warm_start_response``: new filler words, new coin flips for the picks), one example per
    sequence trained on (``warm_start_steps x warm_start_batch_size``): with a fixed response per prompt
    the model memorises the train prompts' picks and fillers (an earlier build, 6000 steps over 4000 fixed
    responses, picked the larger digit 14% of the time on held-out prompts instead of 40%).
    Returns {"steps", "examples", "final_loss" (mean of the last 20 steps, nats/token), "seconds"}.
    """
    rng = random.Random(f"{spec.seed}/warm_start")
    text_rng = random.Random(f"{spec.seed}/warm_start_responses")
    prompt_ids = {p.prompt: chat_prompt_ids(tokenizer, p.prompt) for p in problems}
    examples = []
    for i in range(spec.warm_start_steps * spec.warm_start_batch_size):
        p = problems[i % len(problems)]
        response = warm_start_response(p.pairs, spec.pick_max_prob, spec.filler_words, spec.word_length, text_rng,
                                       spec.filler_repeat_prob)
        examples.append((prompt_ids[p.prompt], tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]))
    start = time.time()
    losses = supervised_steps(model, tokenizer, examples, rng, steps=spec.warm_start_steps,
                              batch_size=spec.warm_start_batch_size, lr=spec.warm_start_lr, log=_log)
    tail = losses[-20:]
    return {"steps": spec.warm_start_steps, "examples": len(examples), "final_loss": round(sum(tail) / max(1, len(tail)), 4),
            "seconds": round(time.time() - start, 1)}


def sample_responses(
    model, tokenizer, prompts: Sequence[str], *, seed: int, max_new_tokens: int, batch_size: int = 64,
    greedy: bool = False,
) -> list[tuple[list[int], list[int]]]:
    """One response per prompt: sampled at temperature 1 (no top-k/top-p) or greedy, batched with
    left padding.

    Returns [(prompt_ids, response_ids)], each a list of token ids without padding; a response stops
    at (and keeps) ``<|im_end|>`` or after ``max_new_tokens`` tokens. Seeded with ``torch.manual_seed(seed)``.
    """
    import torch

    torch.manual_seed(seed)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
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
            generated = model.generate(ids, attention_mask=attention, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                       pad_token_id=pad, **sampling)
        for row, p in enumerate(chunk):
            response = generated[row, width:].tolist()
            if eos in response:
                response = response[: response.index(eos) + 1]
            out.append((p, response))
    return out


def max_response_tokens(spec: TestbedSpec) -> int:
    """Sampling budget (tokens): a warm-start response's length (byte tokenizer: one token per
    character; every such response has the same length) plus eos and a margin of 16."""
    gap = spec.filler_words * (spec.word_length + 1)
    answer = len("\\boxed{}") + spec.pairs
    return (spec.pairs + 1) * gap + spec.pairs * 2 + answer + 1 + 16


def context_tokens(spec: TestbedSpec, tokenizer=None) -> int:
    """Longest prompt (chat template, every prompt of ``spec.pairs`` single digits has the same length)
    plus :func:`max_response_tokens`: the positions a rollout or a warm-start example can reach."""
    tokenizer = tokenizer or build_tokenizer()
    prompt = PickMaxProblem(((1, 2),) * spec.pairs, "").prompt
    return len(chat_prompt_ids(tokenizer, prompt)) + max_response_tokens(spec)


def check_spec(spec: TestbedSpec, tokenizer=None) -> None:
    """Refuse a spec whose longest prompt + response does not fit ``max_position_embeddings`` (the
    rollout would cut responses at the model's context: no answer, reward 0), naming the fix."""
    needed = context_tokens(spec, tokenizer)
    if needed > spec.max_position_embeddings:
        raise ValueError(
            f"pick_max testbed: a prompt of {spec.pairs} pairs plus a response of {max_response_tokens(spec)} tokens "
            f"({spec.filler_words} filler words of {spec.word_length} letters per gap) needs {needed} positions, but "
            f"max_position_embeddings is {spec.max_position_embeddings}; raise max_position_embeddings to at least "
            f"{needed} (or lower filler_words / pairs)")


def sample_statistics(model, tokenizer, problems: Sequence[PickMaxProblem], spec: TestbedSpec) -> dict:
    """Per problem one sampled (temperature 1) and one greedy response. Returns {"samples",
    "sampled_accuracy", "greedy_accuracy", "answer_rate" (sampled responses with a boxed answer),
    "copies_picks" (of those, the answer is exactly the picks), "pick_max_rate" (sampled picks where
    the second digit is the larger: how often the pick is it), "filler_entropy" and "pick_entropy"
    (mean policy entropy, nats, over non-causal and causal reasoning tokens of the sampled responses),
    "filler_tokens" (non-causal reasoning tokens per response), "example"}."""
    import torch

    from verl_oar.testbed.pick_max import oracle_token_masks

    limit = max_response_tokens(spec)
    prompts = [p.prompt for p in problems]
    sampled = sample_responses(model, tokenizer, prompts, seed=spec.seed, max_new_tokens=limit)
    greedy = sample_responses(model, tokenizer, prompts, seed=spec.seed, max_new_tokens=limit, greedy=True)
    right = greedy_right = answered = copies = second_larger = picked_max = 0
    filler, pivotal = [], []
    for problem, (prompt, response), (_, greedy_response) in zip(problems, sampled, greedy):
        greedy_right += is_right(tokenizer.decode(greedy_response, skip_special_tokens=True), problem)
        text = tokenizer.decode(response, skip_special_tokens=True)
        right += is_right(text, problem)
        masks = oracle_token_masks(response, tokenizer)
        if masks is None:
            continue
        answered += 1
        copies += masks.trace.copies_picks
        if len(masks.trace.picks) == len(problem.pairs):
            for (a, b), (s, e) in zip(problem.pairs, masks.trace.picks):
                if b > a:
                    second_larger += 1
                    picked_max += text[s:e] == str(b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, -1)
        entropy = -(logp.exp() * logp).sum(-1)
        filler += entropy[masks.reasoning & ~masks.causal].tolist()
        pivotal += entropy[masks.causal].tolist()
    n = len(problems)
    return {
        "samples": n,
        "sampled_accuracy": round(right / n, 4),
        "greedy_accuracy": round(greedy_right / n, 4),
        "answer_rate": round(answered / n, 4),
        "copies_picks": round(copies / max(1, answered), 4),
        "pick_max_rate": round(picked_max / max(1, second_larger), 4),
        "filler_entropy": round(sum(filler) / max(1, len(filler)), 4),
        "pick_entropy": round(sum(pivotal) / max(1, len(pivotal)), 4),
        "filler_tokens": round(len(filler) / max(1, answered), 2),
        "example": f"{problems[0].prompt} -> {tokenizer.decode(sampled[0][1], skip_special_tokens=True)!r}" if n else None,
    }


def is_right(text: str, problem: PickMaxProblem) -> bool:
    """Whether a response text boxes the problem's answer (the larger digit of every pair)."""
    trace = parse_response(text)
    return trace is not None and text[trace.answer.start : trace.answer.end].strip() == problem.answer


# ---------------------------------------------------------------------------------------------------
# 3. Build, the committed testbed, copies
# ---------------------------------------------------------------------------------------------------


_SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def initial_model(spec: TestbedSpec, tokenizer, init: Testbed | None = None):
    """The model the warm start begins from: fresh (``cpu.workspace.new_tiny_model``), or with
    ``spec.init_from`` the weights of the built testbed ``init`` (default: the committed start), whose fingerprint
    it must be, in a model of ``spec``'s context (RoPE has no position parameters: a longer
    ``max_position_embeddings`` takes the same weights)."""
    model = new_tiny_model(spec, tokenizer)
    if not spec.init_from:
        return model
    from transformers import AutoModelForCausalLM

    start = init if init is not None else committed_testbed()
    if start.manifest["fingerprint"] != spec.init_from:
        raise ValueError(f"pick_max testbed: init_from={spec.init_from} names a start that is not the one given "
                         f"({start.manifest['fingerprint']} in {start.root}); set init_from to that testbed's "
                         f"fingerprint and rebuild (testbed.variants does so: python -m verl_oar.testbed.variants NAME --force)")
    differs = [f"{k} {getattr(start.spec, k)} vs {getattr(spec, k)}" for k in _SHAPE if getattr(start.spec, k) != getattr(spec, k)]
    if differs:
        raise ValueError(f"pick_max testbed: init_from needs the start's model shape; differs in {', '.join(differs)}: "
                         f"use the start's shape or init_from=''")
    weights = AutoModelForCausalLM.from_pretrained(start.model_dir, dtype="float32").state_dict()
    model.load_state_dict(weights)
    return model


def build_testbed(directory: str | os.PathLike, spec: TestbedSpec | None = None, *, force: bool = False,
                  init: Testbed | None = None) -> Testbed:
    """Build (or reuse, same fingerprint) the pick_max testbed in ``directory``; return its paths. ``init``: the
    built testbed whose model a spec with ``init_from`` starts from (default: the committed start)."""
    import torch

    spec = spec or TestbedSpec()
    check_spec(spec)
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
        for stale in ("model", "data", "teacher"):  # the teacher is taught from model/: stale with it
            shutil.rmtree(root / stale, ignore_errors=True)

        tokenizer = build_tokenizer()
        train, val = split_problems(spec)
        write_parquet(rl_rows(train, "train"), root / "data" / "train.parquet")
        write_parquet(rl_rows(val, "val"), root / "data" / "val.parquet")
        (root / "reward.py").write_text(reward_source())

        with all_cpu_threads():
            model = initial_model(spec, tokenizer, init)
            warm = warm_start(model, tokenizer, train, spec)
            stats = sample_statistics(model, tokenizer, val[: spec.stats_samples], spec)
            warm["torch_threads"] = torch.get_num_threads()
        _log(f"warm start: {warm}; on {stats['samples']} val prompts: {stats}")
        save_model_dir(model, tokenizer, root / "model")

        manifest = {
            "fingerprint": fingerprint,
            "version": TESTBED_VERSION,
            "spec": spec.record(),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "n_train": len(train),
            "n_val": len(val),
            "max_response_tokens": max_response_tokens(spec),
            "warm_start": warm,
            "val_samples": stats,
            "machine": machine_info(),
            "build_seconds": round(time.time() - start, 1),
        }
        (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # written last: marks completion
        _log(f"built in {manifest['build_seconds']} s")
        return Testbed(root, manifest)


def committed_testbed() -> Testbed:
    """The committed testbed (read-only: runs use a :func:`copy_testbed`)."""
    manifest = read_manifest(COMMITTED, MANIFEST)
    if manifest is None:
        raise FileNotFoundError(
            f"the committed testbed is missing ({COMMITTED / MANIFEST}); restore it from git "
            f"(git checkout -- {COMMITTED}) or rebuild it: python -m verl_oar.testbed.workspace {COMMITTED} --force")
    return Testbed(COMMITTED, manifest)


def copy_testbed(source: Testbed, directory: str | os.PathLike) -> Testbed:
    """Copy a testbed's files into ``directory`` (replacing a copy there), for runs that write beside it."""
    root = Path(directory).expanduser().resolve()
    with build_lock(root):
        for name in ("model", "data", "teacher"):
            shutil.rmtree(root / name, ignore_errors=True)
            if (source.root / name).exists():  # a testbed built without a teacher has none
                shutil.copytree(source.root / name, root / name)
        for name in ("reward.py", MANIFEST):
            shutil.copyfile(source.root / name, root / name)
    return Testbed(root, read_manifest(root, MANIFEST))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Rebuild the pick_max testbed (the committed one, on one torch "
                                                 "thread: OMP_NUM_THREADS=1 python -m verl_oar.testbed.workspace "
                                                 "verl_oar/testbed/start --force)")
    parser.add_argument("directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if an identical testbed exists")
    args = parser.parse_args()
    bed = build_testbed(args.directory, force=args.force)
    print(json.dumps(bed.manifest, indent=2))
