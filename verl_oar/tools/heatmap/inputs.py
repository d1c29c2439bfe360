"""What the heatmap scores: a rollouts file's rows, one response as prompt and response ids, its answer masks.

1. A rollouts file (``.parquet`` or ``.jsonl``): :func:`read_rollouts` picks the prompt and response columns
   (:data:`PROMPT_KEYS`, :data:`RESPONSE_KEYS`, or the ones named) and the rows.
2. Prompt ids (:func:`prompt_token_ids`): a chat message list (verl's RL parquet) goes through the tokenizer's chat
   template with ``add_generation_prompt=True``, then ``encode(add_special_tokens=False)``, as verl's dataset does;
   a text prompt too when the tokenizer has a template (``chat_template=False``: the raw text, ``encode`` with the
   tokenizer's own special tokens). Response ids: ``encode(response, add_special_tokens=False)``. The sequence is
   prompt ids + response ids, positions 0..L-1.
3. Reasoning and answer tokens (:func:`make_sample`): ``verl_oar.core.answer_span.locate_answer_tokens`` on the
   response ids (what the training worker uses); a response with no answer raises :class:`HeatmapInputError`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from verl_oar.core.answer_span import locate_answer_tokens

__all__ = ["DEFAULT_ROWS", "DUMP_PROMPT_KEY", "GROUND_TRUTH_KEYS", "PROMPT_KEYS", "RESPONSE_KEYS", "HeatmapInputError",
           "Sample", "load_tokenizer", "make_sample", "parse_rows", "pick_key", "prompt_token_ids", "read_records",
           "read_rollouts"]

PROMPT_KEYS = ("prompt", "input")
"""tried in order when --prompt-key is not given: a generic file, then verl's rollout dump"""
RESPONSE_KEYS = ("response", "output")
GROUND_TRUTH_KEYS = ("ground_truth", "reward_model", "gts")
"""tried in order for OPPO's reference answer: a generic file, verl's RL parquet, verl's rollout dump"""
DUMP_PROMPT_KEY = "input"
"""verl's rollout dump: the prompt already went through the chat template (``rollouts`` departure 1)"""
DEFAULT_ROWS = 8
"""rows drawn without --rows: the first ones (of a rollouts file; of a dump, its first real rows)"""


class HeatmapInputError(ValueError):
    """Bad input to the heatmap (file, key, row, response); the message names the problem and the fix."""


def read_records(path: Path) -> list[dict]:
    """Every row of a ``.parquet`` or ``.jsonl`` file as a dict."""
    if not path.is_file():
        raise HeatmapInputError(
            f"--rollouts {path}: no such file. Give the path of a .parquet or .jsonl rollouts file."
        )
    if path.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    if path.suffix in (".jsonl", ".json"):
        records = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise HeatmapInputError(f"--rollouts {path}: line {number} is not JSON ({err.msg}); "
                                            "expected one JSON object per line (jsonl).") from None
        return records
    raise HeatmapInputError(f"--rollouts {path}: unknown format {path.suffix!r}; use a .parquet or .jsonl file.")


def pick_key(records: list[dict], given: str | None, candidates: Sequence[str], flag: str, path: Path) -> str:
    """The column ``given``, else the first of ``candidates`` the file has; the error names ``flag``."""
    available = sorted(records[0]) if records else []
    for key in [given] if given else candidates:
        if key in available:
            return key
    tried = repr(given) if given else " / ".join(repr(k) for k in candidates)
    raise HeatmapInputError(
        f"--rollouts {path}: no column {tried}; available keys: {', '.join(available) or 'none'}. "
        f"Name the column with {flag}."
    )


def read_rollouts(
    path: str | Path, rows: Sequence[int] | None, prompt_key: str | None = None, response_key: str | None = None
) -> tuple[list[tuple[int, Any, Any]], str]:
    """The selected rows of a rollouts file as ``(row, prompt, response)``, and the prompt key used.

    ``prompt`` is a string or a chat message list; ``rows`` None means the first :data:`DEFAULT_ROWS`.
    Raises :class:`HeatmapInputError` for a missing file, an unknown format, a missing key or a row
    out of range.
    """
    path = Path(path)
    records = read_records(path)
    if not records:
        raise HeatmapInputError(f"--rollouts {path}: the file has no rows.")
    p_key = pick_key(records, prompt_key, PROMPT_KEYS, "--prompt-key", path)
    r_key = pick_key(records, response_key, RESPONSE_KEYS, "--response-key", path)
    chosen = list(range(min(DEFAULT_ROWS, len(records)))) if rows is None else list(rows)
    bad = [r for r in chosen if not 0 <= r < len(records)]
    if bad:
        raise HeatmapInputError(
            f"--rows {','.join(map(str, bad))}: out of range, {path} has {len(records)} rows (0..{len(records) - 1})."
        )
    return [(r, records[r][p_key], records[r][r_key]) for r in chosen], p_key


def parse_rows(text: str | None) -> list[int] | None:
    """``--rows 0,3,5`` as row numbers; None when not given."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise HeatmapInputError(f"--rows {text!r}: expected comma-separated row numbers, e.g. --rows 0,3,5") from None


def _messages(prompt: Any) -> list[dict] | None:
    """A chat message list (verl's RL format; numpy arrays from parquet included), else None."""
    if isinstance(prompt, str) or not hasattr(prompt, "__len__"):
        return None
    items = list(prompt)
    if items and all(isinstance(m, dict) and "role" in m and "content" in m for m in items):
        return [{"role": m["role"], "content": m["content"]} for m in items]
    return None


def prompt_token_ids(tokenizer, prompt: Any, chat_template: bool) -> tuple[str, list[int], list[dict] | None]:
    """(prompt text as tokenised, its ids, the chat messages it was rendered from: None when the chat
    template was not applied).

    A message list always goes through the chat template; a string only when ``chat_template`` and
    the tokenizer has one.
    """
    messages = _messages(prompt)
    if messages is None and not isinstance(prompt, str):
        raise HeatmapInputError(f"the prompt is a {type(prompt).__name__}, not a string or a list of "
                                "{'role', 'content'} messages")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if messages is not None and not has_template:
        raise HeatmapInputError("the prompt is a chat message list but the tokenizer has no chat template; "
                                "give the prompt as text")
    if messages is None and not (chat_template and has_template):
        return prompt, tokenizer.encode(prompt, add_special_tokens=True), None
    messages = messages or [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tokenizer.encode(text, add_special_tokens=False), messages


@dataclass
class Sample:
    """One response to score: ids of prompt and response, and the response's masks (T tokens)."""

    row: int
    prompt_text: str
    response_text: str
    prompt_ids: list[int]
    response_ids: list[int]
    reasoning: list[bool]
    """(T,) tokens before the answer marker: the ones OAR scores and reshapes"""
    answer: list[bool]
    """(T,) tokens overlapping the answer content"""
    chat_template: bool
    notes: list[str] = field(default_factory=list)
    messages: list[dict] | None = None
    """the chat messages the prompt ids were rendered from (None: a raw text prompt)"""
    prompt_source: str = ""
    """the raw text prompt as given (rewritten by CSCR/OPPO when ``messages`` is None)"""

    @property
    def ids(self) -> Tensor:
        """(L,) long, prompt + response."""
        return torch.tensor(self.prompt_ids + self.response_ids, dtype=torch.long)

    def full_masks(self) -> tuple[Tensor, Tensor]:
        """(reasoning, answer), each (L,) bool over prompt + response."""
        p = len(self.prompt_ids)
        return torch.tensor([False] * p + self.reasoning), torch.tensor([False] * p + self.answer)


def make_sample(row: int, prompt: Any, response: Any, tokenizer, chat_template: bool, locator=None) -> Sample:
    """Tokenise one (prompt, response) and locate its answer (``locator``: training's
    ``algorithm.oar.answer_locator``, default the built-in); :class:`HeatmapInputError` if it has none."""
    if not isinstance(response, str) or not response:
        raise HeatmapInputError(f"the response is {response!r}, not a non-empty string")
    prompt_text, prompt_ids, messages = prompt_token_ids(tokenizer, prompt, chat_template)
    response_ids = tokenizer.encode(response, add_special_tokens=False)
    located = locate_answer_tokens(response_ids, tokenizer, locator)
    if located is None:
        raise HeatmapInputError(
            "no final answer found in the response (no \\boxed{...}, 'Answer:' / 'Final Answer' line, '####' or "
            "'The answer is'; or none from --answer-locator); OAR has nothing to ground importance on and "
            "training keeps GRPO's credit for it"
        )
    reasoning, answer = located
    sample = Sample(row, prompt_text, response, prompt_ids, response_ids, reasoning, answer, messages is not None,
                    messages=messages, prompt_source=prompt if isinstance(prompt, str) else "")
    if not any(reasoning):
        sample.notes.append("no reasoning token before the answer marker: every importance is 0")
    if not prompt_ids and answer[0]:
        sample.notes.append("empty prompt: the first answer token has no predicting position")
    return sample


def load_tokenizer(path: str):
    """The tokenizer of a Hugging Face model directory (or hub id)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise HeatmapInputError(f"--model {path}: cannot load its tokenizer ({err}); give a model directory "
                                "that holds the tokenizer files") from None
