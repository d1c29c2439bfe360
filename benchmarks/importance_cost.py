"""OAR-G and OAR-P importance cost as a ratio to the log-prob pass on the same batch and model.

    python benchmarks/importance_cost.py [--sizes 8x128,8x256,4x512] [--repeats 5]
        [--p-repeats 3] [--max-tokens 8192] [--budgets 4,16,64] [--line-len 8] [--naive-seqs 2] [--no-oar-p]

The defaults take 6-7 minutes on 2 idle CPU cores (``--no-oar-p``: the OAR-G table alone, about 1).

Every row is timed in this process on the same random tiny Qwen2 (fp32, CPU, sdpa) and batch, and
reported as the median over ``--repeats`` runs divided by the median of the log-prob pass. That pass is
**re-implemented here** on the plain transformers model (a no-grad forward that computes every token's
log-probability, what verl's old-log-prob step computes), not verl's engine pass (FSDP2, its
micro-batching and post-processing); the two ``fused`` rows below re-implement the worker's fused pass
the same way. The importance rows call the package's own functions (``hf_importance``,
``batched_perturbation_importance``). Through verl's real engine, the fused pass's log-probs are checked
bit-identical to verl's own (tests/engine/test_engine_importance_on_cpu.py), not timed. Rows:

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

OAR-P (``verl_oar.core.perturbation``, occlusion by the neutral id 0, AS-MEAN) scores the batch's
sequences together, copies of all of them sharing model calls as the engines run it (the same batch as the
OAR-G rows; every sequence has its own random prompt, so no prompt is shared). Per size, the OAR-P rows, the log-prob pass (batched, and one sequence at a time) and ``noisy_kl
(ours)`` (these three 3 times a round) are timed again together in ``--p-repeats`` round-robin rounds
(warm-up: the first sequence alone), so that a slow spell of a shared machine slows every row alike; each
row's median is reported as the
ratio to the batched log-prob pass over the same sequences (``x log-prob``, i.e. log-prob passes per
sequence), to the log-prob pass run one sequence at a time (``x 1-seq log-prob``), to ``noisy_kl
(ours)`` (``x OAR-G``), and to the naive row. Rows:

- ``OAR-P naive``: the plain reference loop (``tests/_oar_p_reference.py``): a clean and one occluded
  whole-sequence forward per reasoning token, batch 1, no cache; its logits_fn computes only the
  answer-predicting positions' logits (``logits_to_keep``), as ours does. It is timed on the first
  ``--naive-seqs`` sequences (default 2; 0: all) and scaled linearly to the batch (labelled ``scaled``):
  every sequence has the same length and spans, so this only saves time;
- ``OAR-P exact (ours)``: ``batched_perturbation_importance`` over ``core.hf.HFRowsModel``, one span per
  reasoning token, copies of all sequences packed into calls of up to ``--max-tokens`` padded tokens, each
  copy continuing its sequence's clean KV cache from its span on;
- ``OAR-P exact, no prefix sharing``: the same batching, every copy recomputed from position 0: the
  prefix saving alone is (no sharing - exact), the batching saving alone is (naive - no sharing);
- ``OAR-P chunk K=...`` (``--budgets``): at most K contiguous chunks per response;
- ``OAR-P line K=16``: reasoning steps of ``--line-len`` tokens (a line break ends every step),
  merged into at most 16 spans.

The columns spans / calls / tokens are ``PerturbationCost``'s copies / forwards / tokens per sequence
(tokens fed to the model; cached prefixes are not counted). Before the timings, exact (with and
without prefix sharing) and chunk K=16 are checked against the naive reference with the same spans on
the first sequence (max abs difference, fp32; at the first size also in float64). A summary table
then shows the growth with length: exact grows like R (and naive like R x T), budgeted modes stay
about flat in log-prob passes.

``--memory`` adds a table: the peak resident memory each computation adds, measured in a fresh
subprocess per cell (Linux VmHWM, reset right before the run, minus VmRSS then), next to an actor
update (forward, backward into the weights, one Adam step) on the same batch.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from verl_oar.core.gradient import GradientConfig
from verl_oar.core.hf import HFRowsModel, hf_importance
from verl_oar.core.outcome import answer_log_likelihood
from verl_oar.core.perturbation import (
    PerturbationConfig,
    PerturbationCost,
    Sample,
    batched_perturbation_importance,
    occlusion_spans,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _oar_p_reference import naive_perturbation_importance  # noqa: E402  (the plain loop the tests check against)


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


def time_it(fn, repeats: int, warmup=None) -> float:
    (warmup or fn)()  # warm-up
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
    answer = torch.roll(predict, 1, dims=1)  # the tokens the predicting positions predict
    return hf_importance(model, ids, reasoning, answer, cfg, generator=torch.Generator().manual_seed(0))


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
    importance = hf_importance(model, ids, reasoning, torch.roll(predict, 1, dims=1), cfg,
                               generator=torch.Generator().manual_seed(0), clean_logits=clean_logits)
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


NEUTRAL_ID = 0


def line_ends(reasoning, line_len: int):
    """(B, T) bool: every ``line_len``-th reasoning token ends a line (a reasoning step)."""
    index = torch.cumsum(reasoning.long(), 1) - 1
    return reasoning & (index % line_len == line_len - 1)


def naive_logits_fn(model, keep):
    """(1, L) ids -> (1, L, V) logits for ``naive_perturbation_importance``, computing only the ``keep``
    positions' logits (the rest of the returned tensor is uninitialized and never read)."""

    def logits_fn(ids):
        kept = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits
        out = kept.new_empty(ids.shape[0], ids.shape[1], kept.shape[-1])
        out[:, keep] = kept
        return out

    return logits_fn


class PerturbationRun:
    """One OAR-P variant over the batch's sequences: the batched path on all of them at once (as the engines run
    it), or the naive loop one sequence at a time."""

    def __init__(self, model, ids, reasoning, predict, line_end, mode, budget, share_prefix, max_tokens, naive=False):
        self.model, self.ids, self.predict = model, ids, predict
        self.naive, self.max_tokens = naive, max_tokens
        self.rows_model = HFRowsModel(model, pad_id=NEUTRAL_ID)
        self.cfg = PerturbationConfig(outcome="mean", mode=mode, budget=budget, share_prefix=share_prefix)
        self.spans = [occlusion_spans(reasoning[i], mode, budget, line_end[i]) for i in range(ids.shape[0])]

    def naive_sequence(self, i: int):
        """(importance, cost) of sequence i through the naive loop."""
        keep = self.predict[i].nonzero().squeeze(1)
        importance = naive_perturbation_importance(
            naive_logits_fn(self.model, keep), self.ids[i], self.spans[i], self.predict[i], NEUTRAL_ID, "mean"
        )
        spans, length = int(self.spans[i].max()) + 1, self.ids.shape[1]
        return importance, PerturbationCost(forwards=spans + 1, copies=spans, tokens=(spans + 1) * length,
                                            peak_call_tokens=length)

    def importance(self, sequences: int | None = None) -> tuple[list[torch.Tensor], PerturbationCost]:
        """Importance of the first ``sequences`` (default: all), one (T,) tensor each, and their summed cost."""
        count = self.ids.shape[0] if sequences is None else sequences
        if self.naive:
            out, cost = [], PerturbationCost()
            for i in range(count):
                importance, c = self.naive_sequence(i)
                out.append(importance)
                cost.add(c)
            return out, cost
        positions = torch.arange(self.ids.shape[1])
        samples = [Sample(self.ids[i], positions, self.spans[i], self.predict[i]) for i in range(count)]
        out, _, cost = batched_perturbation_importance(self.rows_model, samples, NEUTRAL_ID, self.cfg,
                                                       self.max_tokens)
        return out, cost

    def __call__(self, sequences: int | None = None) -> PerturbationCost:
        """Run the first ``sequences`` (default: all); return their cost."""
        return self.importance(sequences)[1]


def time_interleaved(timers: dict, rounds: int) -> tuple[dict, dict]:
    """Median seconds of each ``(run, warm-up, n)`` in ``timers``, timed in ``rounds`` round-robin rounds
    so that a slow spell of the machine slows every row alike, not just the one running then (a short
    run is repeated ``n`` times per round, each timed); also the last value each run returned."""
    for _, warmup, _ in timers.values():
        warmup()
    samples, results = {key: [] for key in timers}, {}
    for _ in range(rounds):
        for key, (fn, _, n) in timers.items():
            for _ in range(n):
                start = time.perf_counter()
                results[key] = fn()
                samples[key].append(time.perf_counter() - start)
    return {key: statistics.median(v) for key, v in samples.items()}, results


def logprob_one_at_a_time(model, ids):
    for i in range(ids.shape[0]):
        logprob_pass(model, ids[i : i + 1])


def perturbation_block(args, model, ids, reasoning, predict, targets, segment, check64: bool):
    """Time the OAR-P rows on one batch and print them; return R and each row's ratio to the log-prob pass.

    The log-prob passes and OAR-G's noisy_kl row are timed again here, interleaved with the OAR-P rows."""
    b, t = ids.shape
    line_end = line_ends(reasoning, args.line_len)
    r = int(reasoning[0].sum())

    def run(mode, budget=16, share_prefix=True, naive=False):
        return PerturbationRun(model, ids, reasoning, predict, line_end, mode, budget, share_prefix, args.max_tokens,
                               naive=naive)

    naive_seqs = min(b, args.naive_seqs) if args.naive_seqs > 0 else b
    naive_label = "OAR-P naive" + (f" (timed on {naive_seqs}/{b} seqs, scaled)" if naive_seqs < b else "")
    exact = run("exact")
    variants = [
        ("OAR-P naive", naive_label, run("exact", naive=True)),
        ("OAR-P exact (ours)", None, exact),
        ("OAR-P exact, no prefix sharing", None, run("exact", share_prefix=False)),
        *[(f"OAR-P chunk K={k}", None, run("chunk", k)) for k in args.budgets],
        ("OAR-P line K=16", f"OAR-P line K=16 (lines of {args.line_len} tokens)", run("line", 16)),
    ]

    # sanity: ours equals the naive reference (same spans, same model) on the first sequence
    naive_exact = run("exact", naive=True).naive_sequence(0)[0]
    naive_chunk = run("chunk", 16, naive=True).naive_sequence(0)[0]
    checks = [
        (label, (variant.importance(1)[0][0] - reference).abs().max().item())
        for label, variant, reference in [
            ("exact", exact, naive_exact),
            ("exact, no prefix sharing", variants[2][2], naive_exact),
            ("chunk K=16", run("chunk", 16), naive_chunk),
        ]
    ]

    shared_vs_not = ("identical" if torch.equal(exact.importance(1)[0][0], variants[2][2].importance(1)[0][0])
                     else "differ")
    if check64:  # the same in float64: what is left above is rounding, not a different computation
        model64 = copy.deepcopy(model).double()
        run64 = PerturbationRun(model64, ids[:1], reasoning[:1], predict[:1], line_end[:1], "exact", 16, True,
                                args.max_tokens)
        exact64, naive64 = run64.importance(1)[0][0], run64.naive_sequence(0)[0]
        checks.append(("exact in float64", (exact64 - naive64).abs().max().item()))
        del model64, run64

    oar_g = partial(ours, model, ids, reasoning, predict, targets, segment, "noisy_kl")
    timers = {  # the short baselines run 3 times a round
        "log-prob": (partial(logprob_pass, model, ids), partial(logprob_pass, model, ids), 3),
        "1-seq log-prob": (partial(logprob_one_at_a_time, model, ids), partial(logprob_pass, model, ids[:1]), 3),
        "OAR-G": (oar_g, oar_g, 3),
    }
    for key, _, variant in variants:  # warm-up: the first sequence
        timers[key] = (partial(variant, naive_seqs if variant.naive else b), partial(variant, 1), 1)
    seconds_of, costs = time_interleaved(timers, args.p_repeats)
    seconds_of["OAR-P naive"] *= b / naive_seqs
    logprob_s, one_at_a_time, oar_g_s = (seconds_of[key] for key in ("log-prob", "1-seq log-prob", "OAR-G"))

    print(f"\nOAR-P, {b} x {t}: R={r} reasoning tokens/seq, 8 answer tokens; log-prob pass {logprob_s * 1e3:.1f} ms "
          f"batched ({logprob_s / b * 1e3:.2f} ms/seq), {one_at_a_time / b * 1e3:.2f} ms/seq one sequence at a time; "
          f"OAR-G noisy_kl {oar_g_s / logprob_s:.2f}x; --max-tokens {args.max_tokens}; "
          f"medians of {args.p_repeats} interleaved rounds")
    header = (f"{'variant':<42} | {'spans':>5} | {'calls':>5} | {'tokens':>6} | {'ms/seq':>8} | {'x log-prob':>10} | "
              f"{'x 1-seq log-prob':>16} | {'x OAR-G':>8} | {'x naive':>7}")
    print(header)
    print("-" * len(header))
    ratios = {}
    for key, label, variant in variants:
        counted, cost, seconds = naive_seqs if variant.naive else b, costs[key], seconds_of[key]
        ratios[key] = seconds / logprob_s
        print(f"{label or key:<42} | {cost.copies / counted:>5.0f} | {cost.forwards / counted:>5.0f} | "
              f"{cost.tokens / counted:>6.0f} | {seconds / b * 1e3:>8.1f} | {seconds / logprob_s:>9.1f}x | "
              f"{seconds / one_at_a_time:>15.1f}x | {seconds / oar_g_s:>7.1f}x | "
              f"{seconds / seconds_of['OAR-P naive']:>6.3f}x")
    print(f"exact / naive = {seconds_of['OAR-P exact (ours)'] / seconds_of['OAR-P naive']:.3f}x; "
          f"no prefix sharing / naive = {seconds_of['OAR-P exact, no prefix sharing'] / seconds_of['OAR-P naive']:.3f}x")
    print(f"check on sequence 0, max |ours - naive| (max |I| = {naive_exact.abs().max().item():.2e}): "
          + ", ".join(f"{label} {diff:.1e}" for label, diff in checks)
          + f"; exact with and without prefix sharing: {shared_vs_not}")
    return r, ratios


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
    parser.add_argument("--no-oar-p", dest="oar_p", action="store_false", help="skip the OAR-P tables")
    parser.add_argument("--p-repeats", type=int, default=3, help="repeats of each OAR-P row (median)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="OAR-P token budget per model call")
    parser.add_argument("--budgets", default="4,16,64", help="K of the OAR-P chunk rows")
    parser.add_argument("--line-len", type=int, default=8, help="reasoning tokens per line in the line K=16 row")
    parser.add_argument("--naive-seqs", type=int, default=2,
                        help="time OAR-P naive on the first N sequences and scale to the batch (0: all)")
    parser.add_argument("--_peak", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._peak:
        print(peak_memory_mb(args._peak, args.sizes, args.vocab, args.hidden, args.layers))
        return
    args.budgets = [int(k) for k in args.budgets.split(",") if k]
    started = time.perf_counter()
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
    batches = {}
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
        batches[size] = (ids, reasoning, predict, targets, segment)
        cells = " | ".join(f"{r / base:>{w}.2f}x" for r, w in zip(rows, (18, 14, 12, 16, 18)))
        print(f"{size:>8} | {base * 1e3:>10.1f} ms | {cells}")
    if args.oar_p:
        summary = {size: perturbation_block(args, model, *batch, check64=n == 0)
                   for n, (size, batch) in enumerate(batches.items())}
        print("\nOAR-P growth with length: x log-prob pass on the same batch (= log-prob passes per sequence)")
        header = f"{'B x T':<32} | " + " | ".join(f"{size:>8}" for size in summary)
        print(header)
        print("-" * len(header))
        print(f"{'R (reasoning tokens/seq)':<32} | " + " | ".join(f"{r:>8}" for r, _ in summary.values()))
        for label in next(iter(summary.values()))[1]:
            print(f"{label:<32} | " + " | ".join(f"{ratios[label]:>7.1f}x" for _, ratios in summary.values()))
    if args.memory:
        memory_table(args)
    print(f"\nwall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
