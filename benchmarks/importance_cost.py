"""OAR-G importance cost as a ratio to the log-prob pass on the same batch and model.

    python benchmarks/importance_cost.py [--sizes 8x128,8x256,4x512] [--repeats 5]

Every row is timed in this process on the same random tiny Qwen2 (fp32, CPU, sdpa) and batch, and
reported as the median over ``--repeats`` runs divided by the median of the log-prob pass (a no-grad
forward that computes every token's log-probability, as verl's old-log-prob step does). Rows:

- ``reference structure``: the public OAR code's structure -- a per-sample loop, a clean and a
  noisy pass, ``J.backward()`` into the weights (grads zeroed afterwards);
- ``noisy_kl (ours)``: ``gradient_importance``, batched, clean pass + noisy pass + one input-only
  backward (the default objective, AS-MEAN);
- ``loglik (ours)``: ``gradient_importance`` with the answer log-likelihood objective: one forward
  and one input-only backward, no clean pass;
- ``fused loglik + log-probs``: the log-prob pass and the loglik importance from one forward
  (log-probs from its detached logits), i.e. the *total* cost of both, to compare with 1 + loglik;
- ``fused noisy_kl + log-probs``: the log-prob pass doubling as noisy_kl's clean pass, then the noisy
  pass and the input-only backward: the *total* cost of both, to compare with 1 + noisy_kl.
The worker runs the fused forms by default (``algorithm.oar.fuse_log_prob``), inside verl's
old-log-prob step, so their extra cost over plain GRPO is the fused total minus 1.

Answers are the last 8 tokens of each response; reasoning is everything before them.

``--memory`` adds a second table: the peak resident memory each computation adds, measured in a fresh
subprocess per cell (Linux VmHWM, reset right before the run, minus VmRSS then), next to an actor
update (forward, backward into the weights, one Adam step) on the same batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from verl_oar.importance.gradient import GradientConfig, gradient_importance, make_hf_logits_fn
from verl_oar.outcome import answer_log_likelihood


def build_model(vocab: int, hidden: int, layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).eval()


def make_batch(batch: int, length: int, vocab: int, answer_len: int = 8):
    ids = torch.randint(0, vocab, (batch, length))
    prompt = length // 4
    reasoning = torch.zeros(batch, length, dtype=torch.bool)
    reasoning[:, prompt : length - answer_len] = True
    predict = torch.zeros(batch, length, dtype=torch.bool)
    predict[:, length - answer_len - 1 : length - 1] = True
    targets = torch.roll(ids, -1, dims=1)
    segment = torch.arange(batch).unsqueeze(1).expand(batch, length).contiguous()
    return ids, reasoning, predict, targets, segment


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def logprob_pass(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.roll(ids, -1, 1).unsqueeze(-1))


def ours(model, ids, reasoning, predict, targets, segment, objective: str):
    cfg = GradientConfig(objective=objective, outcome="mean")
    embeds = model.get_input_embeddings()(ids).detach()
    return gradient_importance(
        make_hf_logits_fn(model), embeds, reasoning, predict, targets, segment, ids.shape[0], cfg,
        generator=torch.Generator().manual_seed(0),
    )


def fused(model, ids, reasoning, predict, targets, segment):
    """One forward: log-probs of every token (detached) and loglik importance."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, use_cache=False).logits
    log_probs = torch.log_softmax(logits.detach().float(), -1).gather(-1, targets.unsqueeze(-1))
    phi = answer_log_likelihood(logits[predict], targets[predict], segment[predict], ids.shape[0]).sum()
    (grad,) = torch.autograd.grad(phi, [embeds])
    return log_probs, torch.where(reasoning, (grad * embeds.detach()).sum(-1).abs(), 0.0)


def fused_noisy_kl(model, ids, reasoning, predict, targets, segment):
    """The log-prob pass is noisy_kl's clean pass: log-probs + clean logits, then noisy pass + backward."""
    with torch.no_grad():
        clean_logits = model(input_ids=ids, use_cache=False).logits
        log_probs = torch.log_softmax(clean_logits.float(), -1).gather(-1, targets.unsqueeze(-1))
    cfg = GradientConfig(objective="noisy_kl", outcome="mean")
    embeds = model.get_input_embeddings()(ids).detach()
    importance = gradient_importance(
        make_hf_logits_fn(model), embeds, reasoning, predict, targets, segment, ids.shape[0], cfg,
        generator=torch.Generator().manual_seed(0), clean_logits=clean_logits,
    )
    return log_probs, importance


def reference_structure(model, ids, reasoning, predict, targets, segment):
    """Per-sample loop, clean pass, noisy pass, J.backward() into the weights (then zeroed)."""
    out = []
    for i in range(ids.shape[0]):
        row = ids[i : i + 1]
        with torch.no_grad():
            clean = model(input_ids=row, use_cache=False).logits[0][predict[i]].mean(0).log_softmax(-1)
        embeds = model.get_input_embeddings()(row).detach().requires_grad_(True)
        noisy_in = embeds + 1e-3 * torch.randn_like(embeds) * reasoning[i : i + 1].unsqueeze(-1)
        noisy = model(inputs_embeds=noisy_in, use_cache=False).logits[0][predict[i]].mean(0).log_softmax(-1)
        kl = torch.sum(clean.exp() * (clean - noisy))
        kl.backward()
        out.append((embeds.grad * embeds.detach()).sum(-1).abs())
    model.zero_grad(set_to_none=True)
    return out


def actor_update(model, ids):
    """What verl's actor update does per micro-batch: forward, backward into the weights, Adam step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = -torch.log_softmax(logits.float(), -1).gather(-1, torch.roll(ids, -1, 1).unsqueeze(-1)).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_memory_mb(mode: str, size: str, vocab: int, hidden: int, layers: int) -> float:
    """Run ``mode`` once in this (fresh) process; return the peak RSS it added, in MiB (Linux only:
    the peak is reset through /proc/self/clear_refs right before the run)."""
    import gc

    b, t = (int(x) for x in size.lower().split("x"))
    model = build_model(vocab, hidden, layers)
    ids, reasoning, predict, targets, segment = make_batch(b, t, vocab)
    logprob_pass(model, ids)  # warm-up: lazy allocations of the first forward are not the mode's
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    before = _status_kib("VmRSS")
    if mode == "logprob":
        logprob_pass(model, ids)
    elif mode == "update":
        actor_update(model, ids)
    elif mode == "reference":
        reference_structure(model, ids, reasoning, predict, targets, segment)
    else:
        ours(model, ids, reasoning, predict, targets, segment, mode)
    return (_status_kib("VmHWM") - before) / 1024


def memory_table(args) -> None:
    import subprocess

    modes = ("logprob", "update", "reference", "noisy_kl", "loglik")
    print(f"\npeak memory added (MiB, fresh process per cell): {' | '.join(modes)}")
    for size in args.sizes.split(","):
        cells = []
        for mode in modes:
            out = subprocess.run(
                [sys.executable, __file__, "--_peak", mode, "--sizes", size, "--vocab", str(args.vocab),
                 "--hidden", str(args.hidden), "--layers", str(args.layers)],
                capture_output=True, text=True, check=True,
            )
            cells.append(float(out.stdout.strip().splitlines()[-1]))
        ratio = " | ".join(f"{c:7.1f}" for c in cells)
        print(f"{size:>8} | {ratio} | importance / update: noisy_kl {cells[3] / cells[1]:.2f}x, loglik {cells[4] / cells[1]:.2f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8x128,8x256,4x512", help="BxT batch sizes and lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--memory", action="store_true", help="also measure peak memory (subprocess per cell)")
    parser.add_argument("--_peak", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._peak:
        print(peak_memory_mb(args._peak, args.sizes, args.vocab, args.hidden, args.layers))
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = build_model(args.vocab, args.hidden, args.layers)
    print(f"command: python benchmarks/importance_cost.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"model: Qwen2 vocab={args.vocab} hidden={args.hidden} layers={args.layers} fp32, "
          f"torch threads={torch.get_num_threads()}, median of {args.repeats}")
    header = (
        f"{'B x T':>8} | {'log-prob pass':>13} | {'reference structure':>19} | {'noisy_kl (ours)':>15} | "
        f"{'loglik (ours)':>13} | {'fused loglik+logp':>17} | {'fused noisy_kl+logp':>19}"
    )
    print(header)
    print("-" * len(header))
    for size in args.sizes.split(","):
        b, t = (int(x) for x in size.lower().split("x"))
        ids, reasoning, predict, targets, segment = make_batch(b, t, args.vocab)
        base = time_it(lambda: logprob_pass(model, ids), args.repeats)
        rows = [
            time_it(lambda: reference_structure(model, ids, reasoning, predict, targets, segment), args.repeats),
            time_it(lambda: ours(model, ids, reasoning, predict, targets, segment, "noisy_kl"), args.repeats),
            time_it(lambda: ours(model, ids, reasoning, predict, targets, segment, "loglik"), args.repeats),
            time_it(lambda: fused(model, ids, reasoning, predict, targets, segment), args.repeats),
            time_it(lambda: fused_noisy_kl(model, ids, reasoning, predict, targets, segment), args.repeats),
        ]
        cells = " | ".join(f"{r / base:>{w}.2f}x" for r, w in zip(rows, (18, 14, 12, 16, 18)))
        print(f"{size:>8} | {base * 1e3:>10.1f} ms | {cells}")
    if args.memory:
        memory_table(args)


if __name__ == "__main__":
    main()
