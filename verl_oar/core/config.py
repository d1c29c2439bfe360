"""``algorithm.oar.*``: OAR's hyper-parameters, typed, with defaults and validation.

verl's base config has no ``algorithm.oar`` node, so users add keys with Hydra's ``+`` prefix:

    python -m verl.trainer.main_ppo algorithm.adv_estimator=oar_g \
        +algorithm.oar.tau=0.5 +algorithm.oar.outcome=mean +algorithm.oar.saliency=grad_x_input

Every key is optional; a key that is not a field below is refused with the list of valid keys
(a typo must not silently fall back to a default).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Mapping, TypeVar

from verl_oar.core.gradient import GradientConfig
from verl_oar.core.perturbation import PerturbationConfig
from verl_oar.core.reshape import ReshapeConfig


def algorithm_node(algorithm: Mapping[str, Any] | None, node: str, cls: type, docs: str) -> dict[str, Any]:
    """The keys under ``algorithm.<node>`` (DictConfig or dict) as a dict; a key that is not a field of the
    dataclass ``cls`` is refused with the list of valid keys and where they are documented (``docs``)."""
    raw = dict(((algorithm or {}).get(node, None) or {}).items())
    valid = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - valid)
    if unknown:
        raise ValueError(f"Unknown key(s) algorithm.{node}.{f', algorithm.{node}.'.join(unknown)}. "
                         f"Valid keys: {', '.join(sorted(valid))} ({docs}).")
    return raw


def node_problems(algorithm: Mapping[str, Any] | None, cls: type[NodeConfig]) -> tuple[list[str], dict]:
    """Every problem of ``algorithm.<node>`` (``cls.NODE``) at once (a preflight's view; the run itself stops at the
    first): unknown keys (one message listing all); then, if the known keys do not make a valid ``cls`` together,
    each key's value checked alone, and what remains checked together. Returns ``(messages, the node's good keys)``."""
    node, docs = cls.NODE, cls.DOCS
    raw = dict(((algorithm or {}).get(node, None) or {}).items())
    valid = {f.name for f in fields(cls)}
    problems = []
    try:
        algorithm_node({node: raw}, node, cls, docs)
    except ValueError as err:
        problems.append(str(err))
    known = {k: v for k, v in raw.items() if k in valid}
    try:
        cls(**known)
        return problems, known
    except (TypeError, ValueError) as err:
        together = str(err)
    good = {}
    for key, value in known.items():
        try:
            cls(**{key: value})
            good[key] = value
        except (TypeError, ValueError) as err:
            problems.append(str(err))
    if len(good) == len(known):          # no key is bad alone: the combination is
        problems.append(together)
        return problems, {}
    try:
        cls(**good)
    except (TypeError, ValueError) as err:
        problems.append(str(err))
        return problems, {}
    return problems, good


NodeConfigT = TypeVar("NodeConfigT", bound="NodeConfig")


class NodeConfig:
    """Base of the typed ``algorithm.<node>`` configs (frozen dataclasses: :class:`OARConfig`, ``CSCRConfig``, ...):
    reading the node from verl's config, writing it back as a dict, and the checks their ``__post_init__`` share,
    each naming the key as ``algorithm.<node>.<key>``."""

    NODE: ClassVar[str]
    """the node under ``algorithm`` ("oar", "cscr", ...)"""
    DOCS: ClassVar[str]
    """where its keys are documented, named when a key is refused"""

    @classmethod
    def from_algorithm(cls: type[NodeConfigT], algorithm: Mapping[str, Any] | None) -> NodeConfigT:
        """Read ``algorithm.<NODE>`` from verl's ``algorithm`` config (DictConfig or dict); unknown keys are refused
        with the valid ones."""
        return cls(**algorithm_node(algorithm, cls.NODE, cls, cls.DOCS))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_finite(self, *keys: str) -> None:
        """ValueError unless each of ``keys`` is a finite int or float (a bool is not a number here)."""
        for key in keys:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"algorithm.{self.NODE}.{key}={value!r} is invalid: a finite number.")

    def check_flags(self, *keys: str) -> None:
        """ValueError unless each of ``keys`` is a bool."""
        for key in keys:
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"algorithm.{self.NODE}.{key}={getattr(self, key)!r} is invalid: true or false.")

    def check_choice(self, key: str, choices: tuple) -> None:
        """ValueError unless ``key`` is one of ``choices``."""
        if getattr(self, key) not in choices:
            raise ValueError(f"algorithm.{self.NODE}.{key}={getattr(self, key)!r} is invalid: one of {choices}.")


@dataclass(frozen=True)
class OARConfig(NodeConfig):
    """Everything OAR reads from ``algorithm.oar``; defaults follow the paper's best setting."""

    NODE = "oar"
    DOCS = "docs/configuration.md"

    tau: float = 0.5
    """quantile level in [0, 1] that splits suppressed from amplified tokens (paper: ~0.5 best)"""
    beta: float = 1.0
    """amplification strength: the most important token gets weight 1 + beta before renormalising"""
    floor: float = 0.1
    """smallest weight a suppressed token can get, before renormalising"""
    amplify: bool = True
    """ablation switch: boost tokens above the tau-quantile"""
    suppress: bool = True
    """ablation switch: shrink tokens below the tau-quantile"""
    preserve_mass: bool = True
    """ablation switch: renormalise so each sequence's summed token advantage equals GRPO's"""
    outcome: str = "mean"
    """what "the final answer" is: single (AS-SINGLE), mean (AS-MEAN, default), joint (AS-JOINT)"""
    objective: str = "noisy_kl"
    """OAR-G objective: noisy_kl (reference: D(clean || noisy) under embedding noise) or loglik
    (gradient of the answer log-likelihood itself: noise-free, no clean pass)"""
    saliency: str = "grad_x_input"
    """OAR-G saliency: grad_x_input |<dJ/de_t, e_t>| (reference code) or grad_norm ||dJ/de_t||_2"""
    noise_std: float = 0.2
    """scale of the Gaussian noise added to reasoning-token embeddings (objective=noisy_kl): its ratio
    to each token's embedding RMS (``noise_relative=true``, default), or its std (the reference code:
    ``noise_relative=false noise_std=1e-3``)"""
    noise_relative: bool = True
    """scale each token's noise by its own embedding's RMS (``noise_std`` is a noise-to-signal ratio,
    the same perturbation on any model and in bf16); the default was chosen by measuring bf16 vs fp32
    importance, see docs/configuration.md"""
    perturb_mode: str = "chunk"
    """OAR-P occlusion unit: chunk (default: at most ``perturb_budget`` contiguous chunks per response, so K
    copies whatever the length), exact (each reasoning token: the paper's OAR-P, one copy per token; for analysis
    and small models), line (reasoning steps split at line breaks, merged into at most ``perturb_budget`` groups)
    or hierarchical (chunks, then the top ones refined); every token of a span gets the span's importance"""
    perturb_budget: int = 16
    """OAR-P: K, the most occluded copies per response in chunk and line modes (cost grows with K,
    not with the response length)"""
    perturb_refine_top: int = 4
    """OAR-P ``hierarchical`` mode: m, how many of the ``perturb_budget`` coarse chunks are refined (4, with
    ``perturb_refine_unit=4``: the best recall of exact mode's top tokens at ~0.1 R copies, docs/method.md)"""
    perturb_refine_unit: int = 4
    """OAR-P ``hierarchical`` mode: tokens per refined span (1: single tokens)"""
    perturb_token_id: int = -1
    """OAR-P: the token an occluded token is replaced by; -1 = the tokenizer's pad token (else eos)"""
    perturb_max_tokens: int = 0
    """OAR-P: tokens fed per model call (rows x longest new part, padded; cached prefixes up to 4x it); 0 = verl's
    log-prob budget (``log_prob_max_token_len_per_gpu`` with dynamic batch size, else
    ``log_prob_micro_batch_size_per_gpu`` x the micro-batch's longest sequence)"""
    gather_params: bool = False
    """FSDP2 with several ranks: gather the whole model once per importance pass (opt-in; a full ``param_dtype``
    copy per GPU) instead of FSDP's own per-layer gathers in every model call, with the calls kept equal across
    ranks (default: parameters stay sharded, see docs/reliability.md)"""
    importance_model: str = "actor"
    """which model scores importance: actor (the rollout/old policy, default) or ref"""
    seed: int = 0
    """seed of the embedding noise; mixed with the step so each step draws fresh noise"""
    fuse_log_prob: bool = True
    """compute importance inside verl's old-log-prob pass (the clean forward is shared; with
    ``objective=loglik`` the whole pass is) instead of in a pass of its own; ``importance_model=ref``
    and rollout-correction bypass mode always use a pass of their own"""
    answer_locator: str = ""
    """where the final answer is in a response's text: "" (the built-in ``answer_span.find_answer_span``:
    boxed, "Answer:", "Final Answer", ``####``, "The answer is"), or ``pkg://module.function`` /
    ``/path/file.py:function`` with its signature (text -> AnswerSpan | None). A reward function that
    returns ``answer_span`` (``verl_oar.rewards.math_reward`` does) overrides it for the outputs it graded"""
    no_answer_first_steps: int = 3
    """start-up check: when the locator finds no answer in any response of each of the run's first this many
    training steps, the run stops (whatever ``no_answer_action``): the locator does not read the model's
    answer format, so OAR would never take effect; 0 turns the check off"""
    no_answer_max_frac: float = 0.5
    """after the warm-up, a step whose ``oar/fallback/frac_no_answer`` exceeds this prints a warning and is
    counted (``oar/fallback/no_answer_steps``): those responses keep GRPO's credit"""
    no_answer_stop_frac: float = 0.9
    """after the warm-up, a step whose ``oar/fallback/frac_no_answer`` exceeds this counts towards stopping the
    run (``no_answer_patience`` consecutive ones): a run of them is GRPO under another name; >= ``no_answer_max_frac``"""
    no_answer_patience: int = 3
    """consecutive steps above ``no_answer_stop_frac`` before the run stops (``no_answer_action=error``) or warns"""
    no_answer_action: str = "error"
    """error (stop the run naming the cause and the fix) or warn (print and log, keep training)"""
    no_answer_warmup: int = 10
    """the run's first training steps (global step <= this) never count towards the warning or the stop: a base
    model can need a few updates before it answers often; 0 counts from step 1 (the start-up check above is apart)"""
    dump_dir: str = ""
    """if set, every step's token-level tensors (importance, masks, weights, GRPO and OAR advantages)
    are saved to ``{dump_dir}/step_{N}.pt`` for inspection (heatmaps, debugging); off by default"""

    def __post_init__(self) -> None:
        if self.importance_model not in ("actor", "ref"):
            raise ValueError(
                f"algorithm.oar.importance_model={self.importance_model!r} is not valid: use 'actor' "
                "(the policy that produced the rollout, default) or 'ref' (the reference model)."
            )
        # Build the sub-configs once so their own validation runs at start-up.
        self.reshape_config()
        self.gradient_config()
        self.perturbation_config()
        if not isinstance(self.perturb_token_id, int) or self.perturb_token_id < -1:
            raise ValueError(
                f"algorithm.oar.perturb_token_id={self.perturb_token_id!r} is invalid: a token id, or -1 for "
                "the tokenizer's pad token."
            )
        if not isinstance(self.answer_locator, str):
            raise ValueError(
                f"algorithm.oar.answer_locator={self.answer_locator!r} is invalid: '' (built-in) or "
                "'pkg://module.function' or '/path/file.py:function'."
            )
        for key in ("no_answer_max_frac", "no_answer_stop_frac"):
            frac = getattr(self, key)
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
                raise ValueError(f"algorithm.oar.{key}={frac!r} is invalid: a fraction in [0, 1].")
        if self.no_answer_stop_frac < self.no_answer_max_frac:
            raise ValueError(
                f"algorithm.oar.no_answer_stop_frac={self.no_answer_stop_frac!r} is below no_answer_max_frac="
                f"{self.no_answer_max_frac!r}: the stop's threshold must be at least the warning's; raise "
                "no_answer_stop_frac or lower no_answer_max_frac."
            )
        if isinstance(self.no_answer_first_steps, bool) or not isinstance(self.no_answer_first_steps, int) \
                or self.no_answer_first_steps < 0:
            raise ValueError(
                f"algorithm.oar.no_answer_first_steps={self.no_answer_first_steps!r} is invalid: training steps, an "
                "integer >= 0 (0: no start-up check)."
            )
        if isinstance(self.no_answer_patience, bool) or not isinstance(self.no_answer_patience, int) \
                or self.no_answer_patience < 1:
            raise ValueError(
                f"algorithm.oar.no_answer_patience={self.no_answer_patience!r} is invalid: consecutive steps, an integer >= 1."
            )
        if isinstance(self.no_answer_warmup, bool) or not isinstance(self.no_answer_warmup, int) \
                or self.no_answer_warmup < 0:
            raise ValueError(
                f"algorithm.oar.no_answer_warmup={self.no_answer_warmup!r} is invalid: training steps, an integer >= 0."
            )
        if self.no_answer_action not in ("error", "warn"):
            raise ValueError(
                f"algorithm.oar.no_answer_action={self.no_answer_action!r} is invalid: 'error' (stop the run) or 'warn'."
            )
        self.check_flags("gather_params")
        if not isinstance(self.perturb_max_tokens, int) or self.perturb_max_tokens < 0:
            raise ValueError(
                f"algorithm.oar.perturb_max_tokens={self.perturb_max_tokens!r} is invalid: tokens per OAR-P "
                "model call, an integer >= 1, or 0 for verl's log-prob budget."
            )

    def reshape_config(self) -> ReshapeConfig:
        return ReshapeConfig(
            tau=self.tau,
            beta=self.beta,
            floor=self.floor,
            amplify=self.amplify,
            suppress=self.suppress,
            preserve_mass=self.preserve_mass,
        )

    def gradient_config(self) -> GradientConfig:
        return GradientConfig(
            outcome=self.outcome, objective=self.objective, saliency=self.saliency, noise_std=self.noise_std,
            noise_relative=self.noise_relative,
        )

    def perturbation_config(self, share_prefix: bool = True) -> PerturbationConfig:
        return PerturbationConfig(
            outcome=self.outcome, mode=self.perturb_mode, budget=self.perturb_budget, share_prefix=share_prefix,
            refine_top=self.perturb_refine_top, refine_unit=self.perturb_refine_unit,
        )

def neutral_token_id(cfg: OARConfig, tokenizer) -> int:
    """The id an occluded token becomes: ``algorithm.oar.perturb_token_id``, else the pad token,
    else the end-of-sequence token."""
    if cfg.perturb_token_id >= 0:
        return cfg.perturb_token_id
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise ValueError(
        "OAR-P needs a neutral token to occlude with, and the tokenizer has neither a pad nor an eos token. "
        "Set algorithm.oar.perturb_token_id to a token id."
    )
