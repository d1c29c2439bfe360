"""Token-credit heatmaps: what a run applied (from its dumps), or any estimator recomputed on any Hugging Face causal LM.

Two modes:

    # the credit a run actually applied, per row, from one of its step dumps (+algorithm.oar.dump_dir=DIR); no model
    python -m verl_oar.tools.heatmap --dump DIR/step_N.pt --tokenizer MODEL_PATH [--rows 0,3,5] [--config RUN_CONFIG]

    # recompute from a model (a verl checkpoint: merge it first, below), with the run's settings (--config)
    python -m verl_oar.tools.heatmap --model PATH (--prompt TEXT --response TEXT | --rollouts FILE [--rows 0,3,5]
        [--prompt-key K] [--response-key K]) [--config RUN_CONFIG ...]
        [--estimators oar_g,oar_p,cscr,oppo,acpo] [--oar-p-mode exact|chunk|line|hierarchical]
        [--oar-p-budget 16] [--neutral pad|space|ID] [--ground-truth TEXT | --ground-truth-key K] [--reward 1.0]
        [--advantage 1.0] [--oracle MODULE:FUNCTION] [--chat-template | --no-chat-template]
        [--temperature 1.0] [--seed 0] [--out DIR] [--dtype float32|bfloat16] [--device cpu|cuda]

Both write ``heatmap_<row>.png`` per response, ``heatmap.html`` with all of them and ``heatmap.json`` to ``--out``,
and print the paths (stdout); the recompute prints every setting it used and where it came from (stderr).
``main(argv)`` runs the CLI in-process and returns the JSON content.

``--dump``: ``tools/heatmap_dump.py`` says what each estimator's dump holds and what each view draws (oar_g,
oar_p, cscr, oppo, acpo, codapo, and any of them under ``+algorithm.codapo.compose=true``).

``--config`` (``tools/heatmap_config.py``): the run's composed config (``<run dir>/.hydra/config.yaml``, a logged
config), a recipe yaml (composed by Hydra) or a file of Hydra overrides, repeatable (later wins). The recompute
then takes ``algorithm.oar`` / ``cscr`` / ``oppo`` / ``acpo`` and the rollout temperature from the run, the keys
the run left unset at training's defaults (e.g. OAR-P ``chunk`` with K=16, not the tool's ``exact``); flags
given explicitly still win. Without ``--config`` training's defaults hold (OAR-P chunk K=16, default reshaping).

From verl's checkpoint to the folder ``--model`` reads (verl 0.9.1, ``verl/model_merger``; checked on a
2-rank FSDP2 checkpoint saved by verl's ``FSDPCheckpointManager``, tests/unit/test_heatmap_checkpoint_on_cpu.py)::

    python -m verl.model_merger merge --backend fsdp \
        --local_dir <trainer.default_local_dir>/global_step_N/actor --target_dir <hf_dir>
    # Megatron: --backend megatron (add --tie-word-embedding for tied models)

The merger writes the weights in bfloat16 (it casts every shard), with the config and tokenizer from the
checkpoint's ``huggingface/`` folder; ``--dtype float32`` upcasts them on load.

Recompute steps, per response, in the order they run:

Steps, per response, in the order they run:

1. prompt ids: a chat message list (verl's RL parquet) goes through the tokenizer's chat template
   with ``add_generation_prompt=True``, then ``encode(add_special_tokens=False)``, as verl's dataset
   does; a text prompt too when the tokenizer has a template (``--no-chat-template``: the raw text,
   ``encode`` with the tokenizer's own special tokens). Response ids: ``encode(response,
   add_special_tokens=False)``. The sequence is prompt ids + response ids, positions 0..L-1.
2. reasoning and answer tokens: ``verl_oar.core.answer_span.locate_answer_tokens`` on the response ids
   (what the training worker uses); a response with no answer is reported and skipped. A position
   predicts the answer when its next token is an answer token.
3. OAR-G (``core.hf.hf_importance`` with ``OARConfig.gradient_config()``: by default AS-MEAN, noisy KL,
   grad x input; noise drawn from a generator seeded with ``--seed``; clean logits from a no-grad forward) and
   OAR-P (``core.hf.hf_importance`` with ``OARConfig.perturbation_config()``, prefix sharing where the model
   allows it), logits divided by the temperature as the worker divides by the rollout's. The ``OARConfig`` is
   the run's (``--config``) with the flags applied, else training's defaults.
4. OAR weights (``reshape.importance_to_weights`` with that ``OARConfig``'s reshaping) of each
   estimator's importance: what training would multiply the response's GRPO advantage by.
   CSCR and OPPO (``--estimators cscr,oppo``; ``tools/heatmap_privileged.py`` says how, and its
   departures): their token signal (sensitivity, evidence) as a score row and their weights as a w~ row,
   from re-scoring the response under the rewritten prompt; OPPO needs the reference answer
   (``--ground-truth`` or the rollouts' ``--ground-truth-key`` column) and the response's reward (``--reward``).
   ACPO (``--estimators acpo``; ``tools/heatmap_modal.py``): the surrogate entropy of ``algorithm.acpo.surrogate``
   from the model's logits as a score row, its weights for a response of GRPO advantage ``--advantage`` as a w~
   row. CoDaPO is refused here: its value needs the question's whole group (``--dump`` shows it).
5. an oracle (``main(oracle=...)`` or ``--oracle MODULE:FUNCTION``): known causal tokens per response,
   drawn under the scores; e.g. the pick_max testbed's ``verl_oar.testbed.pick_max:heatmap_oracle``.

Departures from a training step, stated:

1. The response is re-tokenised from its text, so its ids can differ from the sampled ones where
   a tokenizer has several encodings of one text. verl's rollout dump (``trainer.rollout_data_dir``,
   keys ``input`` / ``output``) decodes with ``skip_special_tokens=True``: its ``input`` is the
   prompt after the chat template minus the special tokens, so it is tokenised as raw text (the
   template is not applied again) and the role markers the policy saw are missing.
2. OAR-G's noise comes from one generator seeded with ``--seed``, not from the worker's per-sequence
   draws of (seed, step, tokens): the same sequence gets other noise than in training.
3. The OAR-P neutral token defaults to the worker's (the pad token, else eos); ``space`` occludes
   with a space, as the testbed's quality report does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from verl_oar.core.answer_locator import load_answer_locator
from verl_oar.core.answer_span import line_break_tokens, locate_answer_tokens, token_texts
from verl_oar.core.config import OARConfig
from verl_oar.core.gradient import GradientConfig
from verl_oar.core.hf import can_share_prefix, hf_importance
from verl_oar.core.perturbation import PerturbationConfig
from verl_oar.core.privileged_prompt import ground_truth
from verl_oar.core.reshape import Fallback, importance_to_weights
from verl_oar.tools.heatmap_config import RunConfig, RunConfigError, read_run_config, section_config, setting_sources
from verl_oar.tools.heatmap_modal import CODAPO_NEEDS_GROUP, acpo_signal
from verl_oar.tools.heatmap_privileged import PRIVILEGED, cscr_signal, oppo_signal

__all__ = ["ESTIMATORS", "HeatmapInputError", "Oracle", "Sample", "load_oracle", "main", "make_sample",
           "oar_g_importance", "oar_p_importance", "oar_weights", "read_rollouts"]

ESTIMATORS = ("oar_g", "oar_p", *PRIVILEGED, "acpo", "codapo")
"""every registered estimator; ``codapo`` only from a dump (``--dump``): it needs the whole group"""
MAX_TOKENS = 8192
"""tokens per OAR-P model call when neither the flag nor the run's config sets it (the run's 0 = verl's budget)"""
_TRAINING = OARConfig()
TOOL_DEFAULTS = {"oar_p_mode": _TRAINING.perturb_mode, "oar_p_budget": _TRAINING.perturb_budget,
                 "oar_p_refine_top": _TRAINING.perturb_refine_top, "oar_p_refine_unit": _TRAINING.perturb_refine_unit,
                 "oar_p_max_tokens": MAX_TOKENS, "neutral": "pad", "seed": _TRAINING.seed,
                 "answer_locator": _TRAINING.answer_locator}
"""the settings without --config: training's defaults (``OARConfig()``: OAR-P chunk mode, K=16), so that a heatmap
shows the credit a run with default settings used; ``--oar-p-mode exact`` gives the paper's every-token definition.
OAR-P's tokens per call: the tool's :data:`MAX_TOKENS` (training's 0 means verl's log-prob budget, unknown here)"""
FLAG_FIELDS = {"oar_p_mode": "perturb_mode", "oar_p_budget": "perturb_budget", "oar_p_refine_top": "perturb_refine_top",
               "oar_p_refine_unit": "perturb_refine_unit", "oar_p_max_tokens": "perturb_max_tokens",
               "neutral": "perturb_token_id", "seed": "seed", "answer_locator": "answer_locator"}
"""flag (argparse dest) -> the ``algorithm.oar`` key it overrides"""
PROMPT_KEYS = ("prompt", "input")
"""tried in order when --prompt-key is not given: a generic file, then verl's rollout dump"""
RESPONSE_KEYS = ("response", "output")
GROUND_TRUTH_KEYS = ("ground_truth", "reward_model", "gts")
"""tried in order for OPPO's reference answer: a generic file, verl's RL parquet, verl's rollout dump"""
DUMP_PROMPT_KEY = "input"
"""verl's rollout dump: the prompt already went through the chat template (departure 1)"""
EPILOG = """\
modes:
  --dump DIR/step_N.pt --tokenizer MODEL_PATH   the credit the run applied (+algorithm.oar.dump_dir=DIR); no model
  --model HF_DIR ...                            recompute; add --config RUN_CONFIG for the run's settings

a verl checkpoint is sharded; merge it into a Hugging Face folder first (verl 0.9.1):
  python -m verl.model_merger merge --backend fsdp \\
      --local_dir <trainer.default_local_dir>/global_step_N/actor --target_dir <hf_dir>
  (the fsdp merger writes bfloat16 weights; Megatron: --backend megatron, --tie-word-embedding for tied embeddings)
"""
DEFAULT_ROWS = 8
DEFAULT_ESTIMATORS = "oar_g,oar_p"
"""rows drawn from a rollouts file without --rows: the first ones"""

Oracle = Callable[[list[int], Any], "dict[str, list[bool]] | None"]
"""``oracle(response_ids, tokenizer)``: named (T,) masks of known causal tokens of one response
(drawn as "oracle <name>" under the scores), or None when it has none for this response."""


class HeatmapInputError(ValueError):
    """Bad input to the heatmap (file, key, row, response); the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------------
# 1. Inputs: rollouts file, prompt and response ids, answer masks
# ---------------------------------------------------------------------------------------------------


def _read_records(path: Path) -> list[dict]:
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


def _pick_key(records: list[dict], given: str | None, candidates: Sequence[str], flag: str, path: Path) -> str:
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
    records = _read_records(path)
    if not records:
        raise HeatmapInputError(f"--rollouts {path}: the file has no rows.")
    p_key = _pick_key(records, prompt_key, PROMPT_KEYS, "--prompt-key", path)
    r_key = _pick_key(records, response_key, RESPONSE_KEYS, "--response-key", path)
    chosen = list(range(min(DEFAULT_ROWS, len(records)))) if rows is None else list(rows)
    bad = [r for r in chosen if not 0 <= r < len(records)]
    if bad:
        raise HeatmapInputError(
            f"--rows {','.join(map(str, bad))}: out of range, {path} has {len(records)} rows (0..{len(records) - 1})."
        )
    return [(r, records[r][p_key], records[r][r_key]) for r in chosen], p_key


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


# ---------------------------------------------------------------------------------------------------
# 2. Importance and weights of one sample, (T,) over its response tokens
# ---------------------------------------------------------------------------------------------------


def oar_g_importance(model, sample: Sample, cfg: GradientConfig, seed: int, temperature: float = 1.0) -> Tensor:
    """OAR-G importance (T,) float32 of the response tokens, 0 off the reasoning tokens (one sequence,
    noise from a CPU generator seeded with ``seed``)."""
    device = model.get_input_embeddings().weight.device
    ids = sample.ids.to(device)[None]
    reasoning, answer = (m.to(device)[None] for m in sample.full_masks())
    full = hf_importance(model, ids, reasoning, answer, cfg, attention_mask=torch.ones_like(ids),
                         temperature=temperature, generator=torch.Generator().manual_seed(seed))
    return full[0, len(sample.prompt_ids):].cpu()


def oar_p_importance(
    model, sample: Sample, cfg: PerturbationConfig, neutral_id: int, max_tokens: int, tokenizer,
    temperature: float = 1.0,
) -> Tensor:
    """OAR-P importance (T,) float32 of the response tokens, 0 off the reasoning tokens."""
    device = model.get_input_embeddings().weight.device
    ids = sample.ids.to(device)[None]
    reasoning, answer = (m.to(device)[None] for m in sample.full_masks())
    line_end = None
    if cfg.mode == "line":
        line_end = torch.tensor([[False] * len(sample.prompt_ids) + line_break_tokens(sample.response_ids, tokenizer)])
    full = hf_importance(model, ids, reasoning, answer, cfg, temperature=temperature, neutral_id=neutral_id,
                         max_tokens=max_tokens, line_end=None if line_end is None else line_end.to(device))
    return full[0, len(sample.prompt_ids):].cpu()


def oar_weights(importance: Tensor, reasoning: Sequence[bool], cfg: OARConfig) -> tuple[list[float], str]:
    """OAR token weights (T,) of one response (1.0 off the reasoning tokens) and the fallback's
    name (``NONE`` when the row is reshaped)."""
    result = importance_to_weights(
        importance[None].float(), torch.tensor([list(reasoning)]), cfg.reshape_config(),
        answer_found=torch.tensor([True]),
    )
    return result.weights[0].tolist(), Fallback(int(result.fallback[0])).name


# ---------------------------------------------------------------------------------------------------
# 3. CLI
# ---------------------------------------------------------------------------------------------------


def _parse_rows(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise HeatmapInputError(f"--rows {text!r}: expected comma-separated row numbers, e.g. --rows 0,3,5") from None


def _parse_estimators(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in ESTIMATORS]
    if unknown or not names:
        raise HeatmapInputError(f"--estimators {text!r}: choose from {', '.join(ESTIMATORS)} (comma-separated)")
    return list(dict.fromkeys(names))


def neutral_id(tokenizer, choice: str) -> int:
    """The OAR-P occlusion token: ``pad`` (the worker's default: pad, else eos), ``space`` or an id."""
    if choice == "pad":
        from verl_oar.core.config import neutral_token_id

        return neutral_token_id(OARConfig(), tokenizer)
    if choice == "space":
        ids = tokenizer.encode(" ", add_special_tokens=False)
        if len(ids) != 1:
            raise HeatmapInputError(f"--neutral space: a space is {len(ids)} tokens for this tokenizer; give an id")
        return ids[0]
    if choice.isdigit() and int(choice) < len(tokenizer):
        return int(choice)
    raise HeatmapInputError(f"--neutral {choice!r}: use pad, space or a token id below {len(tokenizer)}")


def load_oracle(spec: str) -> Oracle:
    """The oracle named ``MODULE:FUNCTION`` (see :data:`Oracle`), imported."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise HeatmapInputError(f"--oracle {spec!r}: give MODULE:FUNCTION, e.g. "
                                "verl_oar.testbed.pick_max:heatmap_oracle")
    try:
        oracle = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise HeatmapInputError(f"--oracle {spec!r}: cannot load it ({err})") from None
    if not callable(oracle):
        raise HeatmapInputError(f"--oracle {spec!r}: {name} is not a function")
    return oracle


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m verl_oar.tools.heatmap", description=__doc__.splitlines()[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_argument_group("what to score")
    source.add_argument("--model",
                        help="Hugging Face causal LM directory (or hub id) with its tokenizer; a verl checkpoint "
                             "must be merged into one first (see the end of --help)")
    source.add_argument("--dump", metavar="STEP_PT",
                        help="draw the credit a run applied from its dump ({dump_dir}/step_N.pt of "
                             "+algorithm.oar.dump_dir): no model forward; needs --tokenizer (or --model)")
    source.add_argument("--tokenizer", metavar="PATH",
                        help="--dump: the tokenizer to decode the dumped ids with (the run's model path); "
                             "default: --model, else the --config's actor_rollout_ref.model.path")
    source.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="the run's config (composed .hydra/config.yaml or logged config, a recipe yaml, or a "
                             "file of Hydra overrides; repeat to layer them): the estimator settings, temperature "
                             "and (--dump) estimator name are taken from it; explicit flags still win")
    source.add_argument("--prompt", help="prompt text (chat template applied unless --no-chat-template)")
    source.add_argument("--response", help="response text as generated")
    source.add_argument("--rollouts", help="a .parquet or .jsonl file of rollouts")
    source.add_argument("--rows", help=f"comma-separated rows of --rollouts (default: the first {DEFAULT_ROWS})")
    source.add_argument("--prompt-key", help=f"prompt column (default: {' then '.join(PROMPT_KEYS)})")
    source.add_argument("--response-key", help=f"response column (default: {' then '.join(RESPONSE_KEYS)})")
    source.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="apply the tokenizer's chat template to a text prompt (default: yes, except for "
                             "verl's rollout dump key 'input', already templated); message lists always are")
    method = parser.add_argument_group("estimators")
    method.add_argument("--estimators", default=DEFAULT_ESTIMATORS,
                        help=f"comma-separated: {', '.join(ESTIMATORS)} (codapo: only from --dump, it needs the group)")
    method.add_argument("--oar-p-mode", choices=("exact", "chunk", "line", "hierarchical"), default=None,
                        help="default: the --config's algorithm.oar.perturb_mode, else training's (chunk); "
                             "exact: every token on its own, the paper's definition")
    method.add_argument("--oar-p-budget", type=int, default=None,
                        help="K spans in chunk / line / hierarchical mode (default: --config's, else 16)")
    method.add_argument("--oar-p-refine-top", type=int, default=None,
                        help="hierarchical mode: chunks refined (m) (default: --config's, else 4)")
    method.add_argument("--oar-p-refine-unit", type=int, default=None,
                        help="hierarchical mode: tokens per refined unit (default: --config's, else 4)")
    method.add_argument("--oar-p-max-tokens", type=int, default=None,
                        help=f"tokens per OAR-P model call (default: --config's perturb_max_tokens, else {MAX_TOKENS})")
    method.add_argument("--neutral", default=None,
                        help="OAR-P occlusion token: pad, space or a token id (default: --config's "
                             "perturb_token_id, else pad)")
    method.add_argument("--temperature", type=float, default=None,
                        help="rollout temperature, logits are divided by it (default: --config's "
                             "actor_rollout_ref.rollout.temperature, else 1.0)")
    method.add_argument("--seed", type=int, default=None,
                        help="seed of OAR-G's embedding noise (default: --config's algorithm.oar.seed, else 0)")
    method.add_argument("--advantage", type=float, default=1.0,
                        help="ACPO: the response's GRPO advantage; its sign picks the success (> 0) or failure (< 0) "
                             "weighting")
    method.add_argument("--ground-truth", help="OPPO: the reference answer of --prompt")
    method.add_argument("--ground-truth-key",
                        help=f"OPPO: the rollouts' reference-answer column (default: {' then '.join(GROUND_TRUTH_KEYS)})")
    method.add_argument("--reward", type=float, default=1.0, help="OPPO: the response's reward in [0, 1]")
    method.add_argument("--oracle", metavar="MODULE:FUNCTION",
                        help="also draw an oracle's masks of known causal tokens, oracle(response_ids, tokenizer) -> "
                             "{name: [bool]*T} or None; e.g. verl_oar.testbed.pick_max:heatmap_oracle")
    method.add_argument("--answer-locator", default=None, metavar="SPEC",
                        help="the run's algorithm.oar.answer_locator (pkg://module.function or file.py:function); "
                             "default: the built-in")
    run = parser.add_argument_group("output and hardware")
    run.add_argument("--out", default="oar_heatmap", help="output directory")
    run.add_argument("--wrap", type=int, default=48, help="tokens per line in the figures")
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    run.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    return parser


def _inputs(args, estimators: Sequence[str] = ()) -> tuple[list[tuple[int, Any, Any]], bool]:
    """(row, prompt, response) to score and whether text prompts get the chat template."""
    if args.rollouts is None:
        if args.prompt is None or args.response is None:
            raise HeatmapInputError("give --prompt TEXT and --response TEXT, or --rollouts FILE")
        if args.rows or args.prompt_key or args.response_key or args.ground_truth_key:
            raise HeatmapInputError("--rows / --prompt-key / --response-key / --ground-truth-key only apply to --rollouts")
        return [(0, args.prompt, args.response)], args.chat_template is not False
    if args.prompt is not None or args.response is not None or args.ground_truth is not None:
        raise HeatmapInputError("give either --prompt/--response (and --ground-truth) or --rollouts, not both")
    items, p_key = read_rollouts(args.rollouts, _parse_rows(args.rows), args.prompt_key, args.response_key)
    if p_key == DUMP_PROMPT_KEY and set(estimators) & set(PRIVILEGED):
        raise HeatmapInputError(
            f"--rollouts {args.rollouts}: its prompt column {DUMP_PROMPT_KEY!r} (verl's rollout dump) holds the prompt "
            "after the chat template, and cscr/oppo rewrite the prompt's user turn; give a file whose prompt column "
            "holds the chat messages (e.g. the training parquet's 'prompt' beside a 'response' column), or "
            "--prompt/--response, or drop cscr/oppo from --estimators")
    default = p_key != DUMP_PROMPT_KEY  # verl's dump is already templated (departure 1)
    return items, default if args.chat_template is None else args.chat_template


def _ground_truths(args, rows: Sequence[int]) -> dict[int, str]:
    """OPPO's reference answer per row: --ground-truth, or the rollouts' column (verl's ``reward_model``
    dicts included)."""
    if args.rollouts is None:
        if args.ground_truth is None:
            raise HeatmapInputError("--estimators oppo needs the reference answer: give --ground-truth TEXT")
        return {row: args.ground_truth for row in rows}
    path = Path(args.rollouts)
    records = _read_records(path)
    key = _pick_key(records, args.ground_truth_key, GROUND_TRUTH_KEYS, "--ground-truth-key", path)
    out = {}
    for row in rows:
        value = records[row][key]
        try:
            out[row] = ground_truth(value) if isinstance(value, dict) else str(value)
        except ValueError as err:
            raise HeatmapInputError(f"--rollouts {path}: row {row}: {err}") from None
    return out


def _load_model(path: str, dtype: str, device: str | None):
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise HeatmapInputError("--device cuda: no CUDA device is available; use --device cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as err:
        raise HeatmapInputError(f"--model {path}: cannot load a causal LM ({err})") from None
    return model.to(device).eval()


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise HeatmapInputError(f"--model {path}: cannot load its tokenizer ({err}); give a model directory "
                                "that holds the tokenizer files") from None


@dataclass
class Settings:
    """The estimator settings a recompute uses, and where each came from."""

    oar: OARConfig
    cscr: Any
    oppo: Any
    acpo: Any
    temperature: float
    neutral: str
    """pad, space or a token id (OAR-P's occlusion token)"""
    max_tokens: int
    seed: int
    answer_locator: str
    sources: dict[str, dict] = field(default_factory=dict)
    """setting -> {"value", "source"}: the flag, the --config file, or the default (tool's or training's)"""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _labelled(run: RunConfig | None, section: str) -> dict[str, tuple[Any, str]]:
    """``setting_sources`` with a default named for whose it is: training's (the run left the key unset) or,
    without --config, the tool's (the core config class's default)."""
    who = "training" if run is not None else "tool"
    return {key: (value, f"{who} {source}" if source.startswith("default") else source)
            for key, (value, source) in setting_sources(run, section).items()}


def resolve_settings(args, run: RunConfig | None, estimators: Sequence[str]) -> Settings:
    """Explicit flags win; then the run's config (keys it does not set: training's defaults, as the run had
    them); without --config training's defaults (:data:`TOOL_DEFAULTS`)."""
    oar_sources = _labelled(run, "oar")
    chosen, sources = {}, {}
    for dest, key in FLAG_FIELDS.items():
        given = getattr(args, dest)
        if given is not None:
            value, source = given, _flag(dest)
        elif run is not None:
            value, source = oar_sources[key]
            if dest == "neutral":
                value = "pad" if value == -1 else str(value)
            elif dest == "oar_p_max_tokens" and value == 0:
                value, source = MAX_TOKENS, f"{source}: 0 = verl's log-prob budget, unknown here; the tool's {MAX_TOKENS}"
        else:
            value, source = TOOL_DEFAULTS[dest], "training default (no --config)"
        chosen[dest] = value
        sources[f"algorithm.oar.{key}" if dest != "neutral" else "neutral (algorithm.oar.perturb_token_id)"] = \
            {"value": value, "source": source}
    neutral = str(chosen.pop("neutral"))
    replaced = {FLAG_FIELDS[d]: v for d, v in chosen.items()}
    if neutral.isdigit():
        replaced["perturb_token_id"] = int(neutral)
    try:
        oar = replace(section_config(run, "oar"), **replaced)
    except ValueError as err:
        raise HeatmapInputError(str(err)) from None
    if set(estimators) & {"oar_g", "oar_p"}:
        for key, (value, source) in oar_sources.items():
            name = f"algorithm.oar.{key}"
            if name not in sources and key in OAR_SCORING_KEYS:
                sources[name] = {"value": value, "source": source}
    for section in ("cscr", "oppo", "acpo"):
        if section in estimators:
            for key, (value, source) in _labelled(run, section).items():
                if key not in ("teacher", "overflow"):
                    sources[f"algorithm.{section}.{key}"] = {"value": value, "source": source}
    if args.temperature is not None:
        temperature, source = args.temperature, "--temperature"
    elif run is not None and run.temperature is not None:
        temperature, source = run.temperature, run.origin.get("actor_rollout_ref.rollout.temperature", "--config")
    else:
        temperature, source = 1.0, "tool default (verl's rollout default)"
    sources["actor_rollout_ref.rollout.temperature"] = {"value": temperature, "source": source}
    return Settings(oar=oar, cscr=section_config(run, "cscr"), oppo=section_config(run, "oppo"),
                    acpo=section_config(run, "acpo"), temperature=temperature, neutral=neutral,
                    max_tokens=int(oar.perturb_max_tokens) or MAX_TOKENS, seed=int(oar.seed),
                    answer_locator=oar.answer_locator, sources=sources)


OAR_SCORING_KEYS = ("tau", "beta", "floor", "amplify", "suppress", "preserve_mass", "outcome", "objective", "saliency",
                    "noise_std", "noise_relative")
"""``algorithm.oar`` keys the recompute reads besides the flags' (reshaping, OAR-G's objective)"""


def score_sample(model, tokenizer, sample: Sample, args, estimators: list[str], neutral: int | None,
                 oracle: Oracle | None = None, answer: str | None = None, settings: Settings | None = None) -> dict:
    """Everything the JSON holds about one sample (``record["oracle"]``: ``oracle``'s masks, if given;
    ``answer``: OPPO's reference answer; ``settings``: :func:`resolve_settings`, default the tool's)."""
    settings = settings or resolve_settings(args, None, estimators)
    oar = settings.oar
    record: dict[str, Any] = {
        "row": sample.row, "prompt": sample.prompt_text, "response": sample.response_text,
        "chat_template": sample.chat_template, "prompt_ids": sample.prompt_ids, "response_ids": sample.response_ids,
        "tokens": token_texts(sample.response_ids, tokenizer), "reasoning": sample.reasoning, "answer": sample.answer,
        "answer_text": tokenizer.decode([t for t, a in zip(sample.response_ids, sample.answer) if a],
                                        skip_special_tokens=True),
        "scores": {}, "weights": {}, "fallback": {}, "notes": list(sample.notes),
    }
    for name in estimators:
        if name in PRIVILEGED:
            if name == "cscr":
                signal, weights = cscr_signal(model, tokenizer, sample, settings.temperature, settings.cscr)
            else:
                signal, weights = oppo_signal(model, tokenizer, sample, answer, args.reward, settings.temperature,
                                              settings.oppo)
            # the heat row shows positive values: OPPO's evidence by magnitude (its sign is the w~ row's colour)
            record["scores"][name] = signal.abs().tolist()
            record["signed_scores"] = {**record.get("signed_scores", {}), name: signal.tolist()}
            record["weights"][name], record["fallback"][name] = weights.tolist(), "NONE"
            continue
        if name == "acpo":
            surrogate, weights = acpo_signal(model, sample, settings.temperature, args.advantage, settings.acpo)
            record["scores"][name], record["weights"][name] = surrogate.tolist(), weights.tolist()
            record["fallback"][name] = "NONE"
            continue
        if name == "oar_g":
            importance = oar_g_importance(model, sample, oar.gradient_config(), settings.seed, settings.temperature)
        else:
            pcfg = oar.perturbation_config(share_prefix=can_share_prefix(model))
            importance = oar_p_importance(model, sample, pcfg, neutral, settings.max_tokens, tokenizer,
                                          settings.temperature)
        record["scores"][name] = importance.tolist()
        record["weights"][name], record["fallback"][name] = oar_weights(importance, sample.reasoning, oar)
    if oracle is not None:
        masks = oracle(sample.response_ids, tokenizer)
        record["oracle"] = None if masks is None else {name: [bool(v) for v in m] for name, m in masks.items()}
        if masks is None:
            record["notes"].append("oracle: none for this response")
    return record


def _title(record: dict, model: str) -> str:
    prompt = " ".join(record["prompt"].split())
    reasoning = sum(record["reasoning"])
    fallback = ", ".join(f"{k}: {v}" for k, v in record["fallback"].items() if v != "NONE")
    lines = [f"row {record['row']} | {model} | {reasoning} reasoning tokens | answer {record['answer_text']!r}"
             + (f" | fallback {fallback}" if fallback else ""),
             f"prompt: {prompt if len(prompt) <= 120 else '…' + prompt[-119:]}"]
    return "\n".join(lines + [f"note: {n}" for n in record["notes"]])


def _figure_rows(record: dict, estimators: list[str]):
    """(rows, weights, masks) for heatmap_render: every estimator's scores and weights, masks."""
    rows = [(name, record["scores"][name]) for name in estimators]
    weights = [(f"w~ {name}", record["weights"][name]) for name in estimators]
    masks = [("reasoning", record["reasoning"]), ("answer", record["answer"])]
    if record.get("oracle"):
        masks += [(f"oracle {name}", mask) for name, mask in record["oracle"].items()]
    return rows, weights, masks


def write_outputs(report: dict, out: Path, wrap: int) -> None:
    """heatmap_<row>.png, heatmap.html and heatmap.json in ``out``; their paths go into ``report["files"]``."""
    from verl_oar.tools.heatmap_render import html_block, html_page, render_png

    out.mkdir(parents=True, exist_ok=True)
    estimators = report["config"]["estimators"]
    pngs, blocks = [], []
    for record in report["rows"]:
        rows, weights, masks = _figure_rows(record, estimators)
        model = report["model"] if len(report["model"]) <= 60 else "…" + report["model"][-59:]
        title = _title(record, model)
        png = out / f"heatmap_{record['row']}.png"
        render_png(png, record["tokens"], rows, masks, title=title, wrap=wrap, weights=weights)
        blocks.append(html_block(record["tokens"], rows, masks, title, weights=weights, wrap=wrap))
        pngs.append(str(png))
    report["files"] = {"png": pngs, "html": str(out / "heatmap.html"), "json": str(out / "heatmap.json")}
    Path(report["files"]["html"]).write_text(html_page(blocks, f"OAR token importance: {report['model']}"),
                                             encoding="utf-8")
    Path(report["files"]["json"]).write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")


def run(args, oracle: Oracle | None = None) -> dict:
    """Score, draw and write; returns the JSON content. ``oracle``: see :data:`Oracle` (default: the
    one ``--oracle`` names, if any). Raises :class:`HeatmapInputError` on bad input."""
    try:
        run_config = read_run_config(args.config) if args.config else None
    except RunConfigError as err:
        raise HeatmapInputError(str(err)) from None
    if args.dump is not None:
        return run_dump(args, run_config)
    if args.model is None:
        raise HeatmapInputError("give --model PATH (a Hugging Face model directory; a verl checkpoint must be merged "
                                "first, see --help) to recompute credit, or --dump STEP_PT to draw what a run applied")
    if args.tokenizer is not None:
        raise HeatmapInputError("--tokenizer only applies to --dump; the recompute mode uses --model's tokenizer")
    estimators = _parse_estimators(args.estimators)
    if "codapo" in estimators:
        raise HeatmapInputError(CODAPO_NEEDS_GROUP)
    for flag in ("oar_p_budget", "oar_p_max_tokens", "oar_p_refine_top", "oar_p_refine_unit"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise HeatmapInputError(f"{_flag(flag)} {getattr(args, flag)}: must be >= 1")
    if args.temperature is not None and not args.temperature > 0:
        raise HeatmapInputError(f"--temperature {args.temperature}: must be > 0")
    if not 0.0 <= args.reward <= 1.0:
        raise HeatmapInputError(f"--reward {args.reward}: OPPO reads it as the response's success probability, in [0, 1]")
    settings = resolve_settings(args, run_config, estimators)
    print_settings(settings.sources)
    if "oppo" in estimators and settings.oppo.oracle != "self":
        print(f"verl_oar.tools.heatmap: the run's OPPO oracle is {settings.oppo.oracle!r} (algorithm.oppo.teacher: "
              f"{settings.oppo.teacher_path}); this heatmap scores the oracle prompt with --model {args.model} itself: "
              "give the teacher's folder as --model to see the teacher's evidence", file=sys.stderr)
    items, chat_template = _inputs(args, estimators)  # file, keys and rows are checked before any model is loaded
    answers = _ground_truths(args, [row for row, _, _ in items]) if "oppo" in estimators else {}
    tokenizer = _load_tokenizer(args.model)
    neutral = neutral_id(tokenizer, settings.neutral) if "oar_p" in estimators else None
    if oracle is None and args.oracle:
        oracle = load_oracle(args.oracle)
    try:
        locator = load_answer_locator(settings.answer_locator)
    except ValueError as err:
        raise HeatmapInputError(str(err)) from None
    samples, skipped = [], []
    for row, prompt, response in items:
        try:
            samples.append(make_sample(row, prompt, response, tokenizer, chat_template, locator))
        except HeatmapInputError as err:
            skipped.append({"row": row, "reason": str(err)})
            print(f"verl_oar.tools.heatmap: row {row} skipped: {err}", file=sys.stderr)
    if not samples:
        raise HeatmapInputError(
            f"no response could be scored ({len(skipped)} skipped): " + "; ".join(
                f"row {s['row']}: {s['reason']}" for s in skipped
            )
        )
    model = _load_model(args.model, args.dtype, args.device)
    with torch.no_grad():  # OAR-G re-enables grad for its own pass
        records = [score_sample(model, tokenizer, s, args, estimators, neutral, oracle, answers.get(s.row), settings)
                   for s in samples]
    report = {
        "model": args.model,
        "config": {
            "estimators": estimators, "oar_p_mode": settings.oar.perturb_mode,
            "oar_p_budget": settings.oar.perturb_budget, "neutral": settings.neutral, "neutral_id": neutral,
            "temperature": settings.temperature, "seed": settings.seed,
            "reward": args.reward if "oppo" in estimators else None,
            "advantage": args.advantage if "acpo" in estimators else None,
            "run_config": args.config, "settings": settings.sources,
            "oracle": args.oracle or (oracle and getattr(oracle, "__qualname__", repr(oracle))), "dtype": args.dtype, "device": str(next(model.parameters()).device),
            "gradient": asdict(settings.oar.gradient_config()), "reshape": asdict(settings.oar.reshape_config()),
        },
        "rows": records,
        "skipped": skipped,
    }
    write_outputs(report, Path(args.out), args.wrap)
    return report


def print_settings(sources: dict[str, dict]) -> None:
    """Each setting used, its value and where it came from, on stderr (stdout lists the files written)."""
    for name, entry in sources.items():
        print(f"verl_oar.tools.heatmap: {name} = {entry['value']!r} ({entry['source']})", file=sys.stderr)


def run_dump(args, run_config: RunConfig | None) -> dict:
    """``--dump``: the credit the run applied, per row, from its step dump (``heatmap_dump``); no model."""
    from verl_oar.tools.heatmap_dump import DumpError, dump_records, load_dump, write_dump_outputs

    recompute_only = [_flag(d) for d in ("prompt", "response", "rollouts", "prompt_key", "response_key",
                                         "ground_truth", "ground_truth_key", "oracle", "temperature",
                                         *FLAG_FIELDS) if getattr(args, d, None) not in (None, "")]
    if args.estimators != DEFAULT_ESTIMATORS:
        recompute_only.append("--estimators")
    if recompute_only:
        raise HeatmapInputError(f"--dump draws what the run dumped; {', '.join(dict.fromkeys(recompute_only))} only "
                                "apply when recomputing from --model: drop them, or drop --dump")
    path = args.tokenizer or args.model or (run_config.model_path if run_config is not None else None)
    if not path:
        raise HeatmapInputError("--dump needs a tokenizer to decode the dumped token ids: give --tokenizer PATH "
                                "(the run's actor_rollout_ref.model.path)")
    try:
        data = load_dump(args.dump)
        tokenizer = _load_tokenizer(path)
        records, summary = dump_records(data, tokenizer, _parse_rows(args.rows),
                                        run_config.adv_estimator if run_config is not None else None)
    except DumpError as err:
        raise HeatmapInputError(str(err)) from None
    if run_config is not None and summary["estimator"] == "oar" and run_config.adv_estimator in ("oar_g", "oar_p"):
        summary["estimator"] = run_config.adv_estimator
    report = {"dump": str(args.dump), "tokenizer": path, "config": {**summary, "run_config": args.config},
              "rows": records}
    write_dump_outputs(report, Path(args.out), args.wrap)
    return report


def main(argv: Sequence[str] | None = None, *, oracle: Oracle | None = None) -> dict:
    """The CLI, callable in-process: returns the JSON content; bad input exits with its message.
    ``oracle``: drawn under the scores (see :data:`Oracle`); overrides ``--oracle``."""
    from verl_oar.tools.heatmap_render import MissingMatplotlib, require_matplotlib

    args = build_parser().parse_args(argv)
    try:
        require_matplotlib("python -m verl_oar.tools.heatmap's PNG heatmaps")  # before any model is loaded
    except MissingMatplotlib as err:
        raise SystemExit(f"verl_oar.tools.heatmap: {err}") from None
    try:
        report = run(args, oracle)
    except HeatmapInputError as err:
        raise SystemExit(f"verl_oar.tools.heatmap: {err}") from None
    for path in [*report["files"]["png"], report["files"]["html"], report["files"]["json"]]:
        print(path)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
