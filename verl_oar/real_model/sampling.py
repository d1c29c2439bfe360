"""The real model's own responses, sampled with plain transformers ``generate`` (not verl's rollout): the start
statistics, the counterfactual test and the real-model demo sample with it, and say so.

At temperature 1 without top-k / top-p (what the recipes train at), or greedy; the prompt is a user turn through the
model's chat template; one ``torch.manual_seed`` per call, so a call is repeatable on one machine.
"""

from __future__ import annotations

__all__ = ["SAMPLER", "generate"]

SAMPLER = "transformers generate (temperature 1, no top-k / top-p)"
"""what every result sampled by :func:`generate` records as its sampler"""


def generate(model, tokenizer, prompts: list[str], *, samples: int, greedy: bool, max_new_tokens: int, seed: int,
             batch: int) -> list[tuple[str, int, bool]]:
    """(decoded response, its token count with the end token, cut at ``max_new_tokens``) per (prompt, sample),
    prompt-major; ``samples`` per prompt (1 when ``greedy``), ``batch`` sequences per ``generate`` call, left
    padding (the tokenizer's ``padding_side``)."""
    import torch

    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    wanted = [t for t in texts for _ in range(1 if greedy else samples)]
    out = []
    torch.manual_seed(seed)
    for start in range(0, len(wanted), batch):
        chunk = wanted[start:start + batch]
        enc = tokenizer(chunk, return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=not greedy,
                                 temperature=None if greedy else 1.0, top_k=None if greedy else 0,
                                 top_p=None if greedy else 1.0, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        for row in ids[:, enc["input_ids"].shape[1]:]:
            tokens = row.tolist()
            ended = tokenizer.eos_token_id in tokens
            n = tokens.index(tokenizer.eos_token_id) + 1 if ended else len(tokens)
            out.append((tokenizer.decode(tokens[:n], skip_special_tokens=True), n, not ended))
    return out
