"""Token-credit heatmaps: what a run applied (from its dumps), or any estimator recomputed on any Hugging Face causal LM.

    # the credit a run applied, per row, from one of its step dumps (+algorithm.oar.dump_dir=DIR); no model
    verl-oar heatmap --dump DIR/step_N.pt --config RUN_CONFIG [--rows 0,3,5]

    # recompute from a model (a verl checkpoint: merge it first, see ``rollouts``) with the run's settings
    verl-oar heatmap --model HF_DIR --config RUN_CONFIG --rollouts FILE [--rows 0,3,5]

``verl-oar heatmap`` and ``python -m verl_oar.tools.heatmap`` run :func:`main`. ``--config`` (``run_config``):
the run's composed config (``<run dir>/.hydra/config.yaml``, a logged config), a recipe yaml (composed by Hydra)
or a file of Hydra overrides, repeatable (later wins). The recompute then takes ``algorithm.oar`` / ``cscr`` /
``oppo`` / ``acpo`` and the rollout temperature from the run, the keys the run left unset at training's defaults
(e.g. OAR-P ``chunk`` with K=16); flags given explicitly still win (``settings``). Without ``--config`` training's
defaults hold. The dump mode takes the estimator's name and the tokenizer's path from it.

Both modes write ``heatmap_<row>.png`` per response, ``heatmap.html`` with all of them and ``heatmap.json`` to
``--out`` and print the paths (stdout); the recompute prints every setting it used and where it came from
(stderr). ``main(argv)`` runs the CLI in-process and returns the JSON content.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from verl_oar.tools.heatmap import dump, rollouts
from verl_oar.tools.heatmap.inputs import DEFAULT_ROWS, GROUND_TRUTH_KEYS, PROMPT_KEYS, RESPONSE_KEYS, HeatmapInputError
from verl_oar.tools.heatmap.run_config import RunConfigError, read_run_config
from verl_oar.tools.heatmap.scoring import ESTIMATORS, Oracle
from verl_oar.tools.heatmap.settings import FLAG_FIELDS, MAX_TOKENS, flag_name

__all__ = ["DEFAULT_ESTIMATORS", "build_parser", "main", "run"]

DEFAULT_ESTIMATORS = "oar_g,oar_p"
"""--estimators without the flag"""
EPILOG = """\
modes:
  --dump DIR/step_N.pt --tokenizer MODEL_PATH   the credit the run applied (+algorithm.oar.dump_dir=DIR); no model
  --model HF_DIR ...                            recompute; add --config RUN_CONFIG for the run's settings

a verl checkpoint is sharded; merge it into a Hugging Face folder first (verl 0.9.1):
  python -m verl.model_merger merge --backend fsdp \\
      --local_dir <trainer.default_local_dir>/global_step_N/actor --target_dir <hf_dir>
  (the fsdp merger writes bfloat16 weights; Megatron: --backend megatron, --tie-word-embedding for tied embeddings)
"""


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
    output = parser.add_argument_group("output and hardware")
    output.add_argument("--out", default="oar_heatmap", help="output directory")
    output.add_argument("--wrap", type=int, default=48, help="tokens per line in the figures")
    output.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    output.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    return parser


def run(args, oracle: Oracle | None = None) -> dict:
    """Read ``--config``, check the flags belong to the mode, and run it (``--dump``: ``dump``; ``--model``:
    ``rollouts``); returns the JSON content. Raises :class:`HeatmapInputError` on bad input."""
    try:
        run_config = read_run_config(args.config) if args.config else None
    except RunConfigError as err:
        raise HeatmapInputError(str(err)) from None
    if args.dump is not None:
        recompute_only = [flag_name(d) for d in ("prompt", "response", "rollouts", "prompt_key", "response_key",
                                                 "ground_truth", "ground_truth_key", "oracle", "temperature",
                                                 *FLAG_FIELDS) if getattr(args, d, None) not in (None, "")]
        if args.estimators != DEFAULT_ESTIMATORS:
            recompute_only.append("--estimators")
        if recompute_only:
            raise HeatmapInputError(f"--dump draws what the run dumped; {', '.join(dict.fromkeys(recompute_only))} "
                                    "only apply when recomputing from --model: drop them, or drop --dump")
        return dump.run(args, run_config)
    if args.model is None:
        raise HeatmapInputError("give --model PATH (a Hugging Face model directory; a verl checkpoint must be merged "
                                "first, see --help) to recompute credit, or --dump STEP_PT to draw what a run applied")
    if args.tokenizer is not None:
        raise HeatmapInputError("--tokenizer only applies to --dump; the recompute mode uses --model's tokenizer")
    return rollouts.run(args, run_config, oracle)


def main(argv: Sequence[str] | None = None, *, oracle: Oracle | None = None) -> dict:
    """The CLI, callable in-process: returns the JSON content; bad input exits with its message.
    ``oracle``: drawn under the scores (see ``scoring.Oracle``); overrides ``--oracle``."""
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
