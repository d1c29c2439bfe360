"""Build, offline, everything a CPU run of verl needs: tokenizer, tiny Qwen2, data, reward function.

``build_workspace(directory)`` writes into ``directory``::

    model/        tokenizer (byte-level BPE, ChatML template) + tiny Qwen2 (fp32) + generation config
    data/train.parquet, data/val.parquet    arithmetic prompts in verl's RL format
    reward.py     the reward function (a copy of ``verl_oar/rewards/tiny_reward.py``)
    workspace.json  what was built, with which settings, and the warm-start statistics

Nothing is downloaded. Building again into the same directory with the same settings reuses it
(a ``workspace.json`` with the same ``fingerprint``); a file lock makes concurrent builds safe.

Departures from a real setup, on purpose:

1. The tokenizer has only the 256 byte symbols (no merges) plus ``<|im_end|>`` (eos),
   ``<|endoftext|>`` (pad) and ``<|im_start|>``: transformers 5 reloads it as a ``Qwen2Tokenizer``
   for ``model_type=qwen2``, and verl's Qwen chat-token builder finds the tokens it needs.
2. The model (hidden 64, 2 layers, 4 heads, 2 kv heads, 140k parameters, vocab 259) gets a short supervised
   warm start -- a plain torch loop of ``warm_start_steps`` steps, a few seconds to under a minute
   on 2 cores -- on strings like ``"3 plus 4 makes 7. \\boxed{7}<|im_end|>"``, so that responses
   sampled at temperature 1 usually end with a ``\\boxed{...}`` answer, sometimes right and sometimes
   wrong. OAR needs that final answer to ground its token importance on.
3. Deterministic for a given ``seed`` (and torch build and thread count).

Public helpers the pick_max testbed reuses (``verl_oar.testbed.workspace``): :func:`build_tokenizer`,
:func:`new_tiny_model`, :func:`chat_prompt_ids`, :func:`supervised_steps`, :func:`write_parquet`,
:func:`save_model_dir`, :func:`read_manifest`, :func:`build_lock`, :func:`all_cpu_threads`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

WORKSPACE_VERSION = 1
"""bump when the layout or the recipe changes, so that old workspaces are rebuilt"""

DATA_SOURCE = "verl_oar/tiny_arithmetic"
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, as Qwen2 instruct models use it, without a default system prompt"""

RESPONSE_TEMPLATES = (
    "{a} plus {b} makes {c}. \\boxed{{{c}}}",
    "add {a} and {b}: {c}. \\boxed{{{c}}}",
    "{a}+{b} is {c}, so \\boxed{{{c}}}",
    "sum of {a} and {b} is {c}. \\boxed{{{c}}}",
)
"""warm-start responses: some reasoning words and digits, then the final answer in \\boxed{}"""


@dataclass(frozen=True)
class WorkspaceSpec:
    """What to build; its fingerprint decides whether an existing workspace can be reused."""

    seed: int = 0
    """seeds the data split, the model initialisation and the warm start"""
    max_operand: int = 9
    """prompts ask for a+b with a, b in [0, max_operand]"""
    n_train: int = 80
    """prompts in data/train.parquet"""
    n_val: int = 20
    """prompts in data/val.parquet (disjoint from train)"""
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    warm_start_steps: int = 400
    """supervised steps on the response templates; fewer leaves more wrong answers (400: about 40%
    of sampled train answers right, nearly all boxed)"""
    warm_start_batch_size: int = 32
    warm_start_lr: float = 3e-3

    def fingerprint(self) -> str:
        reward_src = (Path(__file__).parents[1] / "rewards" / "tiny_reward.py").read_bytes()
        payload = json.dumps({"spec": asdict(self), "version": WORKSPACE_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(payload + reward_src).hexdigest()[:16]


VLLM_SPEC = WorkspaceSpec(num_attention_heads=2, num_key_value_heads=2)
"""the workspace for verl's vLLM rollout on vLLM's CPU build (``launch --rollout vllm``): heads 32 wide (hidden 64 over
2 heads), the narrowest its CPU attention accepts; the default's 16-wide heads are refused"""


@dataclass(frozen=True)
class Workspace:
    """Paths of a built workspace."""

    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    reward_file: Path
    manifest: dict

    @classmethod
    def at(cls, root: Path, manifest: dict) -> Workspace:
        return cls(
            root=root,
            model_dir=root / "model",
            train_file=root / "data" / "train.parquet",
            val_file=root / "data" / "val.parquet",
            reward_file=root / "reward.py",
            manifest=manifest,
        )


def _log(msg: str) -> None:
    print(f"[verl-oar workspace] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------


def build_tokenizer():
    """Byte-level BPE with no merges: token id == byte value for ids 0..255, then 3 special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from verl_oar.core.answer_span import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ---------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------


def _question(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def _split_pairs(spec: WorkspaceSpec) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(spec.max_operand + 1) for b in range(spec.max_operand + 1)]
    random.Random(spec.seed).shuffle(pairs)
    if spec.n_train + spec.n_val > len(pairs):
        raise ValueError(f"n_train + n_val = {spec.n_train + spec.n_val} > {len(pairs)} distinct prompts")
    return pairs[: spec.n_train], pairs[spec.n_train : spec.n_train + spec.n_val]


def _rl_rows(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": _question(a, b)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "question": _question(a, b), "answer": str(a + b)},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def write_parquet(rows: list[dict], path: Path) -> None:
    """Write ``rows`` (one dict per row, verl's RL columns) to the parquet file ``path`` (folders made)."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)


# ---------------------------------------------------------------------------------------------------
# model and warm start
# ---------------------------------------------------------------------------------------------------


def new_tiny_model(spec, tokenizer):
    """A freshly initialised float32 Qwen2ForCausalLM with tied embeddings, seeded with ``spec.seed``.

    ``spec``: any object with ``seed``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads`` and ``max_position_embeddings`` (a
    :class:`WorkspaceSpec`, the testbed's ``TestbedSpec``); vocabulary, eos and pad come from ``tokenizer``.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(config).float()


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of one user turn through the chat template with the generation prompt, as verl's
    dataset builds a prompt (``encode(add_special_tokens=False)``)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def supervised_steps(
    model, tokenizer, examples: Sequence[tuple[list[int], list[int]]], rng: random.Random, *, steps: int,
    batch_size: int, lr: float, pad_to: int | None = None, log=print,
) -> list[float]:
    """Next-token loss on the response tokens of ``(prompt ids, response ids)`` examples: ``steps``
    AdamW steps (20 warm-up steps, then constant ``lr``) on batches drawn with ``rng``, right-padded
    to ``pad_to`` tokens (None: the batch's longest). Leaves the model in eval mode; returns the loss
    of every step (nats/token)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    losses = []
    for step in range(steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        length = pad_to or max(len(p) + len(r) for p, r in batch)
        input_ids = torch.full((len(batch), length), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), length), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), length), dtype=torch.long)
        for row, (prompt, response) in enumerate(batch):
            ids = prompt + response
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, len(prompt) : len(ids)] = torch.tensor(response)
            attention[row, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log(f"warm start step {step:4d}/{steps} loss {losses[-1]:.3f}")
    model.eval()
    return losses


def warm_start(model, tokenizer, pairs: list[tuple[int, int]], spec: WorkspaceSpec) -> dict:
    """Supervised fine-tuning on templated responses ending in ``\\boxed{a+b}<|im_end|>``.

    Plain torch loop; the loss is on response tokens only. Returns {"steps", "final_loss", "seconds"}.
    """
    rng = random.Random(spec.seed + 1)
    examples = []
    for a, b in pairs:
        prompt = chat_prompt_ids(tokenizer, _question(a, b))
        for template in RESPONSE_TEMPLATES:
            response = tokenizer.encode(template.format(a=a, b=b, c=a + b), add_special_tokens=False)
            examples.append((prompt, response + [tokenizer.eos_token_id]))
    max_len = max(len(p) + len(r) for p, r in examples)
    start = time.time()
    losses = supervised_steps(
        model, tokenizer, examples, rng, steps=spec.warm_start_steps, batch_size=spec.warm_start_batch_size,
        lr=spec.warm_start_lr, pad_to=max_len, log=_log,
    )
    loss_value = losses[-1] if losses else float("nan")
    return {
        "steps": spec.warm_start_steps,
        "final_loss": round(loss_value, 4),
        "seconds": round(time.time() - start, 1),
    }


def sample_statistics(model, tokenizer, pairs: list[tuple[int, int]], *, max_new_tokens: int, seed: int) -> dict:
    """Sample one response per prompt at temperature 1 and score it with the workspace reward.

    Returns {"boxed_rate", "accuracy", "mean_response_tokens", "example"}.
    """
    import torch

    from verl_oar.rewards.tiny_reward import compute_score, last_boxed_content

    torch.manual_seed(seed)
    boxed, correct, lengths, example = 0, 0, [], None
    for a, b in pairs:
        prompt = torch.tensor([chat_prompt_ids(tokenizer, _question(a, b))])
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        response_ids = out[0, prompt.shape[1] :].tolist()
        lengths.append(len(response_ids))
        text = tokenizer.decode(response_ids, skip_special_tokens=True)
        score = compute_score(DATA_SOURCE, text, str(a + b))
        boxed += last_boxed_content(text) is not None
        correct += score >= 1.0
        example = example or f"{_question(a, b)} -> {text!r}"
    n = len(pairs)
    return {
        "boxed_rate": round(boxed / n, 3),
        "accuracy": round(correct / n, 3),
        "mean_response_tokens": round(sum(lengths) / n, 1),
        "example": example,
    }


# ---------------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def build_lock(root: Path):
    """Hold an exclusive file lock on ``root/.lock`` (``root`` created): one build of a folder at a time."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_manifest(root: Path, name: str = "workspace.json") -> dict | None:
    """The manifest ``root/name`` a finished build wrote last, or None (absent or unreadable)."""
    try:
        return json.loads((root / name).read_text())
    except (OSError, ValueError):
        return None


def save_model_dir(model, tokenizer, model_dir: Path) -> None:
    """Save model, tokenizer and a sampling generation config (eos or pad ends a response) to ``model_dir``."""
    from transformers import GenerationConfig

    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
    ).save_pretrained(model_dir)


def build_workspace(
    directory: str | os.PathLike, spec: WorkspaceSpec | None = None, *, force: bool = False
) -> Workspace:
    """Build (or reuse) the CPU-run workspace in ``directory`` and return its paths."""
    import torch

    spec = spec or WorkspaceSpec()
    root = Path(directory).expanduser().resolve()
    fingerprint = spec.fingerprint()
    with build_lock(root):
        manifest = read_manifest(root)
        if not force and manifest is not None and manifest.get("fingerprint") == fingerprint:
            _log(f"reusing {root} (fingerprint {fingerprint})")
            return Workspace.at(root, manifest)

        start = time.time()
        _log(f"building into {root} (fingerprint {fingerprint})")
        (root / "workspace.json").unlink(missing_ok=True)
        for stale in ("model", "data"):
            shutil.rmtree(root / stale, ignore_errors=True)

        tokenizer = build_tokenizer()
        train_pairs, val_pairs = _split_pairs(spec)
        write_parquet(_rl_rows(train_pairs, "train"), root / "data" / "train.parquet")
        write_parquet(_rl_rows(val_pairs, "val"), root / "data" / "val.parquet")
        shutil.copyfile(Path(__file__).parents[1] / "rewards" / "tiny_reward.py", root / "reward.py")

        with all_cpu_threads():
            model = new_tiny_model(spec, tokenizer)
            warm = warm_start(model, tokenizer, train_pairs, spec)
            stats = sample_statistics(model, tokenizer, train_pairs[:32], max_new_tokens=48, seed=spec.seed)
        _log(f"warm start: {warm}; sampled on 32 train prompts: {stats}")

        save_model_dir(model, tokenizer, root / "model")

        manifest = {
            "fingerprint": fingerprint,
            "version": WORKSPACE_VERSION,
            "spec": asdict(spec),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "warm_start": warm,
            "train_samples": stats,
            "torch": torch.__version__,
            "build_seconds": round(time.time() - start, 1),
        }
        (root / "workspace.json").write_text(json.dumps(manifest, indent=2))  # written last: marks completion
        _log(f"built in {manifest['build_seconds']} s")
        return Workspace.at(root, manifest)


@contextlib.contextmanager
def all_cpu_threads():
    """Let torch use every core inside the block (a warm start), then restore its thread count; with
    ``$OMP_NUM_THREADS`` set, that many threads instead (the test suite sets 1: two test workers share
    2 cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if an identical workspace exists")
    args = parser.parse_args()
    ws = build_workspace(args.directory, force=args.force)
    print(json.dumps(ws.manifest, indent=2))
