"""Peak memory of OAR-G's pass with and without gradient checkpointing, against the tokens of a micro-batch, beside
``core.memory_estimate``'s estimate of the same pass.

    python benchmarks/oar_g_checkpointing.py [--tokens 512,1024,2048] [--dtypes float32,bfloat16] [--out FILE]
    python benchmarks/oar_g_checkpointing.py --device cuda --attention flash_attention_2 --dtypes bfloat16 \
        --full-shape --tokens 4096,8192,16384 --out results_oar_g_checkpointing_h200.json   # GPU (prepared, not run)

The pass is what engines/fsdp/gradient.py runs on each micro-batch (not fused): ``core.hf.OutcomeHead`` +
``core.gradient.gradient_importance_in_forward``, objective ``noisy_kl``, on plain transformers in eval mode (as
verl's engine runs it). "checkpointed" is the model after ``gradient_checkpointing_enable()`` (what verl does for
``actor_rollout_ref.model.enable_gradient_checkpointing=true``, its default): the head then recomputes each decoder
layer in the backward; "plain" is the same model without it (the pass before this change, whatever verl's flag).
The importance of the two is compared bit for bit (``bit_identical``), beside the plain pass run twice
(``rerun_bit_identical``: on a GPU, flash-attention's and SDPA's backward kernels may use atomics and then differ
run to run; checkpointing is then judged by ``max_abs_diff`` against the rerun's).

Model: Qwen2.5-Math-1.5B's shape narrowed to fit a shared CPU: its 28 layers, head dim 128, 6:1 query to KV heads
ratio, MLP 5.83x the hidden size, 151,936-token tied vocabulary, but hidden 384 (3 / 1 heads, MLP 2240); random
weights, sdpa; float32 and bfloat16 (FSDP's ``param_dtype`` in the recipes; slow on this CPU). ``--full-shape``:
Qwen2.5-Math-1.5B's own (hidden 1536, 12 / 2 heads, MLP 8960; for a GPU: ~44 GiB plain at 16k tokens). Workload:
``T / 512`` rows of 512 tokens (a 64-token prompt, reasoning, an 8-token answer and an end token).

What is measured on the CPU: the peak of live tensor bytes the pass creates (``LiveBytes``, a ``TorchDispatchMode``
that counts every storage an op creates while any tensor on it lives; tests/unit/test_memory_estimate_on_cpu.py
measures with it too; the weights are not counted): what a GPU's caching allocator must hold at least, free of the CPU
allocator's caching (peak RSS is not: glibc keeps freed chunks). Exact and deterministic, so one run per row;
memory does not depend on other processes' CPU load. On CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated``
above what was allocated before the pass (after a warm-up pass), which adds CUDA's kernels (flash-attention's
saved log-sum-exp and its recomputation, cuBLAS workspaces) and the caching allocator's rounding. Beside it,
``estimate(...).pass_bytes`` for the same shape (``fsdp=False``; no padding mask, so SDPA keeps what
flash-attention keeps: the estimate's ``flash_attention_2``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ROW, PROMPT, ANSWER = 512, 64, 8
SHAPE = dict(hidden_size=384, intermediate_size=2240, num_hidden_layers=28, num_attention_heads=3,
             num_key_value_heads=1, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
             max_position_embeddings=4096)
FULL_SHAPE = {**SHAPE, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
              "num_key_value_heads": 2}
"""Qwen2.5-Math-1.5B's config.json (architecture only)"""
MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages ops create inside the mode, each counted until no tensor uses it (a view of an
    op's input is not new). Intermediate buffers inside one kernel are not seen."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        result = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.storages.items() if ref.expired()]:
            self.now -= self.storages.pop(key)[1]
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in given and key not in self.storages:  # new, not a view of an input
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return result


def _batch(rows: int, seed: int):
    """(ids, reasoning, predict, targets, segment), each (rows, ROW): the layout module docstring describes."""
    ids = torch.randint(1, SHAPE["vocab_size"], (rows, ROW), generator=torch.Generator().manual_seed(seed))
    reasoning = torch.zeros(rows, ROW, dtype=torch.bool)
    reasoning[:, PROMPT : ROW - ANSWER - 1] = True
    predict = torch.zeros_like(reasoning)
    predict[:, ROW - ANSWER - 2 : ROW - 2] = True  # the positions whose next token is an answer token
    segment = torch.arange(rows).unsqueeze(1).expand(rows, ROW).contiguous()
    return ids, reasoning, predict, torch.roll(ids, -1, 1), segment


def _measure(model, tokens: int) -> tuple[int, torch.Tensor]:
    """(peak bytes, importance) of one pass over ``tokens // ROW`` rows on the model's device (module docstring)."""
    from contextlib import nullcontext

    from verl_oar.core.gradient import GradientConfig, gradient_importance_in_forward
    from verl_oar.core.hf import OutcomeHead

    device = model.device
    rows = tokens // ROW
    ids, reasoning, predict, targets, segment = (t.to(device) for t in _batch(rows, tokens))
    head = OutcomeHead(model, predict, 1.0, nullcontext())

    def run() -> torch.Tensor:
        return gradient_importance_in_forward(
            lambda t: head.run({"input_ids": ids}, t, full_logits=False)[1], reasoning, predict, targets, segment,
            rows, GradientConfig(), generator=torch.Generator(device).manual_seed(tokens)).cpu()

    if device.type != "cuda":
        with LiveBytes() as live:
            importance = run()
        return live.peak, importance
    run()  # warm-up: cuBLAS handles and workspaces, flash-attention's first call
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    importance = run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, importance


def _estimate(shape: dict, tokens: int, dtype_bytes: int, checkpointed: bool) -> int:
    from transformers import Qwen2Config

    from verl_oar.core.memory_estimate import EstimatorSettings, ModelShape, RunShape, estimate

    run = RunShape(tokens, PROMPT, ROW - PROMPT, dtype_bytes=dtype_bytes, answer_tokens=ANSWER, fsdp=False,
                   attention="flash_attention_2")  # no padding mask: SDPA does not repeat the KV heads
    settings = EstimatorSettings("oar_g", fuse_log_prob=False, gradient_checkpointing=checkpointed)
    return estimate(ModelShape.from_hf_config(Qwen2Config(**shape)), run, settings).pass_bytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="512,1024,2048", help="tokens per micro-batch (multiples of 512)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (memory does not depend on them)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--attention", default="sdpa", help="attn_implementation (flash_attention_2 on CUDA)")
    parser.add_argument("--full-shape", action="store_true", help="Qwen2.5-Math-1.5B's own shape (a GPU's)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_oar.testbed.machine import machine_info

    counts = [int(t) for t in args.tokens.split(",")]
    if any(t % ROW or t <= 0 for t in counts):
        raise SystemExit(f"--tokens={args.tokens} is invalid: positive multiples of {ROW} (rows of {ROW} tokens)")
    dtypes = args.dtypes.split(",")
    shape = FULL_SHAPE if args.full_shape else SHAPE
    torch.set_num_threads(args.threads)
    rows = []
    for name in dtypes:
        dtype = getattr(torch, name)
        torch.manual_seed(0)
        config = Qwen2Config(**shape)
        config._attn_implementation = args.attention
        model = Qwen2ForCausalLM(config).to(dtype).to(args.device).eval()
        _measure(model, ROW)  # warm-up: lazy imports
        plain = {tokens: _measure(model, tokens) for tokens in counts}
        rerun = {tokens: _measure(model, tokens)[1] for tokens in counts}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as verl does
        kept = {tokens: _measure(model, tokens) for tokens in counts}
        b = torch.finfo(dtype).bits // 8
        for tokens in counts:
            for checkpointed, (peak, _) in ((False, plain[tokens]), (True, kept[tokens])):
                rows.append({"dtype": name, "tokens": tokens, "checkpointed": checkpointed,
                             "peak_mib": round(peak / MIB, 1),
                             "estimate_mib": round(_estimate(shape, tokens, b, checkpointed) / MIB, 1)})
            want = plain[tokens][1]
            rows[-1].update(checkpointed_over_plain=round(kept[tokens][0] / plain[tokens][0], 3),
                            bit_identical=bool(torch.equal(kept[tokens][1], want)),
                            max_abs_diff=float((kept[tokens][1] - want).abs().max()),
                            rerun_bit_identical=bool(torch.equal(rerun[tokens], want)),
                            rerun_max_abs_diff=float((rerun[tokens] - want).abs().max()),
                            importance_max=float(want.abs().max()))
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del model, plain, rerun, kept
    result = {
        "command": "python benchmarks/oar_g_checkpointing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "model": {**shape, "attention": args.attention, "weights": "random"},
        "device": args.device, "measured": "live tensor bytes (CPU) / max_memory_allocated (CUDA), above the weights",
        "workload": {"row_tokens": ROW, "prompt": PROMPT, "answer": ANSWER, "objective": "noisy_kl",
                     "tokens": counts, "dtypes": dtypes},
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
