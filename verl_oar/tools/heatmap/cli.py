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
from verl_oar.tools.heatmap.scoring import DEFAULT_ESTIMATORS, ESTIMATORS, Oracle
from verl_oar.tools.heatmap.settings import FLAG_FIELDS, MAX_TOKENS, flag_name

__all__ = ["build_parser", "main", "run"]

USAGE = """\
%(prog)s --dump DIR/step_N.pt --config RUN_CONFIG [--rows 0,3,5] [--out DIR]
       %(prog)s --model HF_DIR --config RUN_CONFIG --rollouts FILE [--rows 0,3,5] [--out DIR]
       %(prog)s --model HF_DIR --prompt TEXT --response TEXT [--config RUN_CONFIG]
       (--estimators picks what --model recomputes; the advanced flags below are rarely needed)"""
"""the common case first: what a run applied (--dump), or a recompute with the run's settings (--model)"""
EPILOG = """\
--config RUN_CONFIG: the run's composed config (<run dir>/.hydra/config.yaml), a logged config, a recipe yaml or a
file of Hydra overrides; repeat to layer them (later wins). Without it the settings are training's defaults (OAR-P
chunk mode, K=16) and --dump needs --tokenizer (or --model).

a verl checkpoint is sharded; merge it into a Hugging Face folder first (verl 0.9.1):
  python -m verl.model_merger merge --backend fsdp \\
      --local_dir <trainer.default_local_dir>/global_step_N/actor --target_dir <hf_dir>
  (the fsdp merger writes bfloat16 weights; Megatron: --backend megatron, --tie-word-embedding for tied embeddings)
"""


def build_parser() -> argparse.ArgumentParser:
    """The flags: the common case's group first, then the advanced ones (each with a default from ``--config``,
    else training's, else the tool's)."""
    parser = argparse.ArgumentParser(prog="python -m verl_oar.tools.heatmap", usage=USAGE,
                                     description=__doc__.splitlines()[0], epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = parser.add_argument_group("the common case")
    common.add_argument("--dump", metavar="STEP_PT",
                        help="draw the credit a run applied from its dump ({dump_dir}/step_N.pt of "
                             "+algorithm.oar.dump_dir): no model forward; decoded with --tokenizer, else the "
                             "--config's model path")
    common.add_argument("--model", metavar="HF_DIR",
                        help="recompute with this Hugging Face causal LM directory (or hub id) and its tokenizer; "
                             "a verl checkpoint must be merged into one first (see the end of --help)")
    common.add_argument("--config", action="append", default=[], metavar="RUN_CONFIG",
                        help="the run's config (see below): the estimator settings, temperature, (--dump) estimator "
                             "name and tokenizer are taken from it; explicit flags still win")
    common.add_argument("--rollouts", metavar="FILE", help="a .parquet or .jsonl file of rollouts")
    common.add_argument("--rows",
                        help=f"comma-separated rows of --rollouts or --dump (default: the first {DEFAULT_ROWS})")
    common.add_argument("--prompt", metavar="TEXT",
                        help="prompt text (chat template applied unless --no-chat-template)")
    common.add_argument("--response", metavar="TEXT", help="response text as generated")
    common.add_argument("--estimators", default=None, metavar="LIST",
                        help=f"--model: comma-separated, of {', '.join(ESTIMATORS)} (default: the --config run's "
                             f"algorithm.adv_estimator when it is one of them, else {DEFAULT_ESTIMATORS}; "
                             "codapo only from --dump, it needs the group)")
    common.add_argument("--out", default="oar_heatmap", metavar="DIR", help="output directory (default: oar_heatmap)")

    inputs = parser.add_argument_group("advanced: inputs")
    inputs.add_argument("--tokenizer", metavar="PATH",
                        help="--dump: the tokenizer to decode the dumped ids with (the run's model path); "
                             "default: --model, else the --config's actor_rollout_ref.model.path")
    inputs.add_argument("--prompt-key", metavar="KEY", help=f"prompt column (default: {' then '.join(PROMPT_KEYS)})")
    inputs.add_argument("--response-key", metavar="KEY",
                        help=f"response column (default: {' then '.join(RESPONSE_KEYS)})")
    inputs.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="apply the tokenizer's chat template to a text prompt (default: yes, except for "
                             "verl's rollout dump key 'input', already templated); message lists always are")
    inputs.add_argument("--oracle", metavar="MODULE:FUNCTION",
                        help="also draw an oracle's masks of known causal tokens, oracle(response_ids, tokenizer) -> "
                             "{name: [bool]*T} or None; e.g. verl_oar.testbed.pick_max:heatmap_oracle")

    settings = parser.add_argument_group(
        "advanced: estimator settings (--model; default: the --config run's, else training's)")
    settings.add_argument("--oar-p-mode", choices=("exact", "chunk", "line", "hierarchical"), default=None,
                          help="default: the --config's algorithm.oar.perturb_mode, else training's (chunk); "
                               "exact: every token on its own, the paper's definition")
    settings.add_argument("--oar-p-budget", type=int, default=None, metavar="K",
                          help="K spans in chunk / line / hierarchical mode (default: --config's, else 16)")
    settings.add_argument("--oar-p-refine-top", type=int, default=None, metavar="M",
                          help="hierarchical mode: chunks refined (m) (default: --config's, else 4)")
    settings.add_argument("--oar-p-refine-unit", type=int, default=None, metavar="N",
                          help="hierarchical mode: tokens per refined unit (default: --config's, else 4)")
    settings.add_argument("--oar-p-max-tokens", type=int, default=None, metavar="N",
                          help="tokens per OAR-P model call (default: --config's perturb_max_tokens, else "
                               f"{MAX_TOKENS})")
    settings.add_argument("--neutral", default=None, metavar="{pad,space,ID}",
                          help="OAR-P occlusion token (default: --config's perturb_token_id, else pad)")
    settings.add_argument("--temperature", type=float, default=None, metavar="T",
                          help="rollout temperature, logits are divided by it (default: --config's "
                               "actor_rollout_ref.rollout.temperature, else 1.0)")
    settings.add_argument("--seed", type=int, default=None, metavar="N",
                          help="seed of OAR-G's embedding noise (default: --config's algorithm.oar.seed, else 0)")
    settings.add_argument("--answer-locator", default=None, metavar="SPEC",
                          help="the run's algorithm.oar.answer_locator (pkg://module.function or file.py:function); "
                               "default: --config's, else the built-in")

    outcome = parser.add_argument_group("advanced: the response's outcome (--model; OPPO and ACPO)")
    outcome.add_argument("--ground-truth", metavar="TEXT", help="OPPO: the reference answer of --prompt")
    outcome.add_argument("--ground-truth-key", metavar="KEY",
                         help="OPPO: the rollouts' reference-answer column (default: "
                              f"{' then '.join(GROUND_TRUTH_KEYS)})")
    outcome.add_argument("--reward", type=float, default=1.0, metavar="R",
                         help="OPPO: the response's reward in [0, 1] (default: 1.0)")
    outcome.add_argument("--advantage", type=float, default=1.0, metavar="A",
                         help="ACPO: the response's GRPO advantage; its sign picks the success (> 0) or failure (< 0) "
                              "weighting (default: 1.0)")

    output = parser.add_argument_group("advanced: figures and hardware")
    output.add_argument("--wrap", type=int, default=48, metavar="N",
                        help="tokens per line in the figures (default: 48)")
    output.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="--model: the weights' dtype on load (default: float32)")
    output.add_argument("--device", choices=("cpu", "cuda"), default=None, help="--model: default: cuda if available")
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
        if args.estimators is not None:
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
