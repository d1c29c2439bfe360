"""OPPO's teacher on the pick_max testbed: the starting model taught to read the oracle's hint.

OPPO's teacher oracle scores a response twice with a frozen teacher ``T``, with and without the
reference answer in the prompt, and takes ``e_t = log T(y_t | x + answer) - log T(y_t | x)`` as the
token's evidence (docs/algo/oppo.md). A teacher helps only if the hint changes what it predicts:
the testbed's own model never saw a hint (the self-oracle's evidence on it is noise: README,
"Testbed results"). This teacher is that model fine-tuned on two kinds of examples, in equal shares:

- the plain prompt with a warm-start response (picks right with the start's ``pick_max_prob``, as
  the start was trained): ``log T(y | x)`` stays the starting model's;
- the oracle prompt (OPPO's default template rendered with the chat template, as the privileged pass
  renders it) with a response whose every pick is the pair's larger digit, i.e. the hinted answer:
  ``log T(pick | x + answer)`` goes to 0 for the right pick and far below for a wrong one.

Filler letters are uniform in both, so their evidence stays near 0 and the evidence concentrates on
the picks: positive on right ones, negative on wrong ones. A 7B Instruct teacher reads a hint
without being taught; here the teaching stands in for that ability (the teacher is told nothing
else: the reasoning it rewards is the task's own rule, the one the reward checks).

``python -m verl_oar.testbed.teacher [TESTBED]`` builds it into ``TESTBED/teacher/`` (default: the
committed testbed) and writes ``teacher.json`` with its spec, the start's fingerprint, statistics on
held-out prompts and the machine. The demo refuses a teacher built from another start.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_oar.core.privileged_prompt import OPPO_ORACLE, rewrite_messages
from verl_oar.testbed.machine import machine_info
from verl_oar.testbed.pick_max import PickMaxProblem, oracle_token_masks, warm_start_response

__all__ = ["MANIFEST", "TeacherSpec", "build_teacher", "check_teacher", "evidence_statistics", "hinted_prompt_ids"]

MANIFEST = "teacher.json"
"""written last into the teacher's folder: marks a finished build"""


@dataclass(frozen=True)
class TeacherSpec:
    """How the teacher is taught (module docstring)."""

    steps: int = 1000
    """AdamW steps of ``batch_size`` examples, each with a freshly drawn response"""
    batch_size: int = 32
    lr: float = 1e-3
    hint_share: float = 0.5
    """share of examples with the oracle prompt (the rest: plain prompt, warm-start response)"""
    template: str = OPPO_ORACLE
    """the oracle prompt's user turn; OPPO's default ``algorithm.oppo.template``"""
    seed: int = 0
    stats_samples: int = 64
    """held-out prompts for the statistics in teacher.json"""


def hinted_prompt_ids(tokenizer, question: str, answer: str, template: str = OPPO_ORACLE) -> list[int]:
    """Token ids of the oracle prompt as the privileged pass renders it: the user turn rewritten by
    ``template`` (``core.privileged_prompt``) through the chat template with the generation prompt."""
    messages = rewrite_messages([{"role": "user", "content": question}], template, answer)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _examples(tokenizer, problems: Sequence[PickMaxProblem], bed_spec, spec: TeacherSpec) -> list[tuple[list[int], list[int]]]:
    from verl_oar.cpu.workspace import chat_prompt_ids

    rng = random.Random(f"{spec.seed}/teacher_examples")
    plain = {p.prompt: chat_prompt_ids(tokenizer, p.prompt) for p in problems}
    hinted = {p.prompt: hinted_prompt_ids(tokenizer, p.prompt, p.answer, spec.template) for p in problems}
    out = []
    for i in range(spec.steps * spec.batch_size):
        p = problems[i % len(problems)]
        with_hint = rng.random() < spec.hint_share
        response = warm_start_response(p.pairs, 1.0 if with_hint else bed_spec.pick_max_prob, bed_spec.filler_words,
                                       bed_spec.word_length, rng, bed_spec.filler_repeat_prob)
        ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append(((hinted if with_hint else plain)[p.prompt], ids))
    return out


def evidence_statistics(scorer, tokenizer, problems: Sequence[PickMaxProblem], sampled: Sequence[tuple[list[int], list[int]]],
                        template: str = OPPO_ORACLE) -> dict:
    """OPPO's evidence ``log s(y_t | x + answer) - log s(y_t | x)`` of a scorer model ``s`` on given
    responses, averaged over token kinds: {"right_pick", "wrong_pick", "filler_abs"} (nats; picks
    right / wrong for their pair; |e| on the non-causal reasoning tokens) and their counts."""
    import torch

    from verl_oar.testbed.pick_max import parse_response

    sums = {"right_pick": [], "wrong_pick": [], "filler_abs": []}
    for problem, (prompt, response) in zip(problems, sampled):
        masks = oracle_token_masks(response, tokenizer)
        if masks is None:
            continue
        hinted = hinted_prompt_ids(tokenizer, problem.prompt, problem.answer, template)
        with torch.no_grad():
            lp = []
            for head in (hinted, prompt):
                logits = scorer(torch.tensor([head + response])).logits[0, len(head) - 1 : -1].float()
                lp.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0])
        evidence = lp[0] - lp[1]
        text = tokenizer.decode(response, skip_special_tokens=True)
        trace = parse_response(text)
        picks = [t for t in range(len(response)) if bool(masks.causal[t])]
        for (a, b), token, (s, e) in zip(problem.pairs, picks, trace.picks if trace else ()):
            key = "right_pick" if text[s:e] == str(max(a, b)) else "wrong_pick"
            sums[key].append(float(evidence[token]))
        sums["filler_abs"] += evidence[masks.reasoning & ~masks.causal].abs().tolist()
    out = {k: round(sum(v) / len(v), 4) if v else None for k, v in sums.items()}
    out.update({f"{k}_count": len(v) for k, v in sums.items()})
    return out


def _statistics(teacher, start, tokenizer, problems: Sequence[PickMaxProblem], bed_spec, spec: TeacherSpec) -> dict:
    """Held-out statistics: the teacher's greedy accuracy with and without the hint, and the evidence
    the teacher and the start model itself (OPPO's self-oracle at step 0) give the start's samples."""
    from verl_oar.testbed.workspace import is_right, max_response_tokens, sample_responses

    limit = max_response_tokens(bed_spec)
    prompts = [p.prompt for p in problems]
    sampled = sample_responses(start, tokenizer, prompts, seed=spec.seed, max_new_tokens=limit)
    plain = sample_responses(teacher, tokenizer, prompts, seed=spec.seed, max_new_tokens=limit, greedy=True)
    accuracy_plain = sum(is_right(tokenizer.decode(r, skip_special_tokens=True), p) for p, (_, r) in zip(problems, plain))
    accuracy_hinted = 0
    for p in problems:  # one at a time: sample_responses renders the plain prompt
        import torch

        ids = torch.tensor([hinted_prompt_ids(tokenizer, p.prompt, p.answer, spec.template)])
        with torch.no_grad():
            out = teacher.generate(ids, max_new_tokens=limit, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id)
        accuracy_hinted += is_right(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), p)
    n = len(problems)
    return {
        "samples": n,
        "greedy_accuracy_plain": round(accuracy_plain / n, 4),
        "greedy_accuracy_hinted": round(accuracy_hinted / n, 4),
        "evidence_teacher": evidence_statistics(teacher, tokenizer, problems, sampled, spec.template),
        "evidence_self": evidence_statistics(start, tokenizer, problems, sampled, spec.template),
    }


def build_teacher(bed, spec: TeacherSpec | None = None) -> dict:
    """Teach a copy of ``bed``'s model to read the hint (module docstring); write it and teacher.json into
    ``bed.teacher_dir`` (replacing a teacher there). Returns the manifest."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_oar.cpu.workspace import all_cpu_threads, build_tokenizer, save_model_dir, supervised_steps
    from verl_oar.testbed.workspace import split_problems

    spec = spec or TeacherSpec()
    start_time = time.time()
    root = bed.teacher_dir
    shutil.rmtree(root, ignore_errors=True)
    tokenizer = build_tokenizer()  # the start's (its saved files are the same bytes)
    train, val = split_problems(bed.spec)
    with all_cpu_threads():
        start = AutoModelForCausalLM.from_pretrained(bed.model_dir, dtype=torch.float32).eval()
        teacher = AutoModelForCausalLM.from_pretrained(bed.model_dir, dtype=torch.float32)
        losses = supervised_steps(teacher, tokenizer, _examples(tokenizer, train, bed.spec, spec),
                                  random.Random(f"{spec.seed}/teacher_batches"), steps=spec.steps,
                                  batch_size=spec.batch_size, lr=spec.lr, log=lambda m: print(f"[teacher] {m}", flush=True))
        stats = _statistics(teacher, start, tokenizer, val[: spec.stats_samples], bed.spec, spec)
        threads = torch.get_num_threads()
    save_model_dir(teacher, tokenizer, root)
    manifest = {
        "spec": asdict(spec),
        "start_fingerprint": bed.manifest["fingerprint"],
        "final_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4),
        "val_samples": stats,
        "machine": machine_info(),
        "torch_threads": threads,
        "build_seconds": round(time.time() - start_time, 1),
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check_teacher(bed) -> Path:
    """``bed.teacher_dir`` if it holds a teacher built from this testbed's start; a clear error otherwise."""
    manifest_path = bed.teacher_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = None
    if manifest is None or manifest.get("start_fingerprint") != bed.manifest["fingerprint"]:
        found = "none" if manifest is None else f"one built from start {manifest.get('start_fingerprint')}"
        raise SystemExit(f"the testbed in {bed.root} has no OPPO teacher for its start {bed.manifest['fingerprint']} "
                         f"({found} in {bed.teacher_dir}); build it: python -m verl_oar.testbed.teacher {bed.root}")
    return bed.teacher_dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build OPPO's teacher for a pick_max testbed (the committed one: "
                                                 "OMP_NUM_THREADS=1 python -m verl_oar.testbed.teacher)")
    parser.add_argument("testbed", nargs="?", default=None, help="a built testbed (default: the committed one)")
    args = parser.parse_args()
    from verl_oar.testbed.quality import load_testbed
    from verl_oar.testbed.workspace import committed_testbed

    target = committed_testbed() if args.testbed is None else load_testbed(args.testbed)
    print(json.dumps(build_teacher(target), indent=2))
