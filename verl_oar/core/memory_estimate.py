"""Memory of each token estimator's pass per GPU, estimated from the model's shape before anything runs.

All sizes are bytes. Notation (one GPU, one micro-batch of verl's old-log-prob pass):

    b       bytes per element of the compute dtype (FSDP's ``param_dtype``: bf16 -> 2, fp32 -> 4)
    h, L    hidden size, decoder layers           H, Hkv, d   attention heads, KV heads, head dim
    q = H d, kv = Hkv d                           I, V        MLP intermediate size, vocabulary
    T       tokens of one log-prob micro-batch (``log_prob_max_token_len_per_gpu`` under dynamic batch size,
            else ``log_prob_micro_batch_size_per_gpu`` x the longest sequence)
    S       the longest sequence (prompt + response); n = max(1, T // S) full-length samples per micro-batch
    a       answer-predicting positions per response (``RunShape.answer_tokens``, rough)
    c       KV cache per token, all layers: 2 L kv b

Formulas (each checked where marked; the rest are marked rough and named so in the breakdown):

- parameters: ``V h (x2 untied) + h + L (h q + q + 2 (h kv + kv) + q h + 3 h I + 2 h)`` (qkv biases where the
  model has them) -- equals a transformers Qwen2's ``parameters()`` count (CPU test);
- KV cache of one token: ``c`` -- equals the ``past_key_values`` a transformers Qwen2 returns (CPU test);
- logits of ``k`` positions: ``k V b`` -- equals the returned ``logits`` (CPU test);
- activations kept for OAR-G's backward, per token per layer, the actor's parameters requiring grad (as in verl)
  and attention that saves q, k, v, out and the log-sum-exp (SDPA's flash / memory-efficient kernels,
  flash-attention): ``8 h + 8 + 4 b h + 2 b q + 2 b kv' + 4 H + 4 b I`` (two RMSNorms: an fp32 copy of the input,
  the rsqrt and the normalised output; the projections' shared inputs; q, k, v, out; the MLP's gate, its SiLU, up
  and their product); ``kv' = q`` where SDPA is given a mask (transformers then repeats the KV heads), else ``kv``
  -- equals the bytes autograd saves in a transformers Qwen2 (CPU test, fp32 and bf16). Eager attention also saves
  the (H, T, T) attention weights: not modelled;
- with gradient checkpointing (``enable_gradient_checkpointing``, verl's default; ``EstimatorSettings``): OAR-G's
  pass checkpoints the decoder layers itself (``core.hf.OutcomeHead``: verl runs the pass in eval mode, where
  transformers does not): each layer's input ``h b`` per token per layer is kept, and one layer's activations above
  are recomputed at a time in the backward -- the per-layer slope equals the measured one (CPU test). Above the
  kept inputs the pass peaks at the largest of three moments: the forward's end (fused ``loglik``: verl's full
  logits), the outcome's backward (the outcome logits), a layer's recomputation (its activations and the backward
  transient);
- a no-grad forward's transient at one layer: ``(3 I + 4 h + 2 d) b`` per token (the MLP's up, SiLU and product,
  four hidden-sized tensors, the rotary cos / sin) -- within a few percent of a measured forward (CPU test); rough
  on GPU (kernel workspaces);
- verl's own old-log-prob pass: the logits ``T V b`` plus ``ENTROPY_COPIES`` vocabulary-wide temporaries for the
  entropy verl computes there (rough: 0 when ``torch.compile`` fuses it, 2 in eager), or the MLP transient,
  whichever is larger; plus, under FSDP, the gathered root (embeddings, output layer) and two gathered layers;
- FSDP2 ``gather_params=true``: a full ``param_dtype`` copy of the parameters, ``P b``, for the importance pass.

Per estimator, the pass and its peak (``estimate``):

- ``oar_g``: verl's clean pass, then a forward with grad (logits only at the ``n a`` predicting positions) and a
  backward to the input embeddings: the activations of ``T`` tokens (every layer's, or with gradient
  checkpointing every layer's input and one layer's activations), the embeddings, noise and their gradient
  (``3 T h b``; ``loglik`` has no noise: ``2 T h b``), the outcome logits in fp32 and their math
  (``n a V OUTCOME_BYTES``: 12 bytes per logit for noisy KL, 17 for loglik, measured) and the backward's transient
  (``2 T I b``, rough). ``objective=loglik`` fused computes verl's full logits in that forward with grad: activations + logits.
  The whole pass is within 15% above a measured one, with and without checkpointing (CPU test).
- ``oar_p``: no grad; the model calls ``core.perturbation.plan_calls`` makes for a micro-batch of ``n``
  full-length samples (prompts, clean rows, occluded copies; ``perturb_mode`` and ``K`` decide the copies; the
  refined chunks of ``hierarchical`` are assumed evenly spread, ``line`` is counted as ``chunk``). Held while the
  copies run: every sample's clean cache. A call of ``rows`` rows, longest new part ``N`` and longest prefix
  ``P`` peaks at the largest of three moments: in its forward, the prefixes gathered (``rows P c``), the cache
  grown to ``rows (P + N) c`` and the forward transient of ``rows N`` tokens (with SDPA: a bool padding mask
  ``rows N (P + N)``, and in attention its float copy and the KV heads repeated to all heads); after it, a call
  that returns its caches holds them three times (the model's, the stacked layers, the per-row copies) beside its
  logits ``rows a V b``; then its logits reduced in fp32 (``rows a V (b + 12)``, rough: one call's logits at a
  time, nothing of size V outliving the call), plus a 5% margin (``OAR_P_MARGIN``). The whole pass is at or up to
  25% above a measured one, never below (CPU test; the measured margins are in docs/benchmarks.md).
- ``acpo`` (modal): verl's pass plus one fp32 block of ``acpo_block_bytes`` (``rows = block // (4 V)`` rows: the
  block's shifted values, written into one buffer reused by every block, the fp32 copy of bf16 logits made in it),
  one (rows,) row statistic at a time, the (T,) fp32 result and the (T,) reciprocal temperatures -- equal to the
  measured peak on CPU, fp32 and bf16 logits (test).
- ``cscr``, ``oppo``: verl's ``compute_log_prob`` over K x the batch in verl's own micro-batches: the same peak
  (no entropy): nothing extra. ``oppo`` with ``oracle=teacher``: the teacher's log-prob pass (its parameters stay
  in CPU memory, FSDP2 gathers its root and a layer or two at a time) with the reference model's budget.
- ``codapo``: reads verl's log-probs: nothing extra.

What the estimate is not: a measurement. It ignores the CUDA context, NCCL buffers, the caching allocator's
fragmentation and kernel workspaces (``decide_fit``'s reserve covers those), and assumes full-length sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verl_oar.core.perturbation import Row, plan_calls

__all__ = ["ENTROPY_COPIES", "ESTIMATORS", "MARKER_TOKENS", "OAR_P_MEASURED_COST", "OUTCOME_BYTES", "RESERVE_BYTES",
           "RESERVE_FRACTION", "EstimatorSettings", "FitDecision", "MemoryEstimate", "ModelShape", "RunShape", "Term", "decide_fit",
           "estimate", "format_bytes", "oar_p_cost_passes", "training_state_bytes"]

ESTIMATORS = ("oar_g", "oar_p", "acpo", "cscr", "oppo", "codapo")
ENTROPY_COPIES = 1
"""vocabulary-wide temporaries of verl's entropy in the old-log-prob pass, per logit (rough: 0 when torch.compile
fuses ``entropy_from_logits``, 2 in eager: the softmax and its product with the logits)"""
OUTCOME_BYTES = {"noisy_kl": 12, "loglik": 17}
"""bytes per outcome logit (N x V) at the peak of OAR-G's outcome math (rough): loglik's four fp32 (N, V) tensors
(16); noisy KL's fp32 logits, a bf16 model's own and the per-sequence (S, V) fp32 pooling (10.2 / 11.5 bytes per
logit measured in fp32 / bf16 with 4 answer tokens per sequence, fewer with more); CPU test, Qwen's vocabulary"""
MARKER_TOKENS = 2
"""tokens between the reasoning and the answer (``\\boxed{``), rough"""
OAR_P_MEASURED_COST: dict[str, float] = {}
"""Measured OAR-P cost in one-sequence log-prob passes of *time*, keyed ``"<mode> K=<K>"`` (``"chunk K=16"``),
set by whoever measured it on the target GPU (cite the run next to the value). Empty: the start-up log shows only
the token count of :func:`oar_p_cost_passes`; a value here is shown beside it."""


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB (or MiB under 1 GiB), one decimal."""
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer: what the formulas read."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    """input and output embeddings are one matrix"""
    qkv_bias: bool = True
    """the q/k/v projections have biases (Qwen2 does, Llama does not)"""
    moe: bool = False
    """experts: their parameters and routed activations are not modelled (the estimate is then rough)"""

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        """From a transformers config (``AutoConfig``); multimodal configs give their text decoder."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        heads = int(config.num_attention_heads)
        bias = getattr(config, "attention_bias", None)
        if bias is None:
            bias = getattr(config, "model_type", "") in ("qwen2", "qwen2_moe")
        moe = any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
        return cls(
            hidden=int(config.hidden_size), layers=int(config.num_hidden_layers), heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate=int(config.intermediate_size), vocab=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)), qkv_bias=bool(bias), moe=bool(moe),
        )

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer."""
        h, q, kv = self.hidden, self.q, self.kv
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return h * q + 2 * h * kv + bias + q * h + 3 * h * self.intermediate + 2 * h

    def root_parameters(self) -> int:
        """Parameters outside the decoder layers: embeddings, output layer (if untied), final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def parameters(self) -> int:
        return self.root_parameters() + self.layers * self.layer_parameters()

    def kv_cache_per_token(self, b: int) -> int:
        """c: keys and values of one token over all layers, bytes."""
        return 2 * self.layers * self.kv * b

    def saved_per_token_layer(self, b: int, repeated_kv: bool = False) -> int:
        """Bytes autograd keeps for a backward through one layer, per token (module docstring)."""
        kv = self.q if repeated_kv else self.kv
        h = self.hidden
        return 8 * h + 8 + 4 * b * h + 2 * b * self.q + 2 * b * kv + 4 * self.heads + 4 * b * self.intermediate

    def forward_transient_per_token(self, b: int) -> int:
        """A no-grad forward's live bytes at one layer's MLP, per token (rough): up, SiLU and their product, four
        hidden-sized tensors (residual stream, norm, attention output) and the rotary cos / sin."""
        return (3 * self.intermediate + 4 * self.hidden + 2 * self.head_dim) * b


@dataclass(frozen=True)
class RunShape:
    """What verl's configuration fixes for the passes on one GPU."""

    micro_batch_tokens: int
    """T: tokens of one old-log-prob micro-batch"""
    prompt_tokens: int
    response_tokens: int
    dtype_bytes: int = 2
    """b: the compute (FSDP ``param_dtype``) dtype's bytes"""
    answer_tokens: int = 8
    """a: answer-predicting positions per response (rough: math answers are a few tokens)"""
    fsdp: bool = True
    """FSDP (or FSDP2) engine: the forward gathers the root and a layer or two in ``param_dtype``"""
    attention: str = "flash_attention_2"
    """the model's ``attn_implementation``: ``sdpa`` repeats the KV heads under a mask (module docstring)"""

    @property
    def sequence(self) -> int:
        """S: the longest sequence"""
        return self.prompt_tokens + self.response_tokens

    @property
    def tokens(self) -> int:
        """T: a micro-batch holds at least one sequence"""
        return max(self.micro_batch_tokens, self.sequence)

    @property
    def samples(self) -> int:
        """n: full-length samples in one micro-batch"""
        return max(1, self.micro_batch_tokens // max(self.sequence, 1))


@dataclass(frozen=True)
class EstimatorSettings:
    """An estimator and the settings its pass's memory depends on (defaults: ``OARConfig``'s, the recipes')."""

    name: str
    objective: str = "noisy_kl"
    fuse_log_prob: bool = True
    perturb_mode: str = "chunk"
    perturb_budget: int = 16
    perturb_refine_top: int = 4
    perturb_refine_unit: int = 4
    perturb_max_tokens: int = 0
    """tokens per OAR-P call; 0: the micro-batch tokens T"""
    gather_params: bool = False
    acpo_modal: bool = True
    acpo_block_bytes: int = 256 << 20
    """``engines.fsdp.modal.DEFAULT_BLOCK_BYTES`` (passed in by the caller: core does not import engines)"""
    gradient_checkpointing: bool = False
    """the importance model's ``actor_rollout_ref.model.enable_gradient_checkpointing`` (verl's default true): OAR-G
    keeps each layer's input instead of every layer's activations. False (not known) estimates the larger pass."""
    rescore_copies: int = 0
    """rows re-scored per response by verl's compute_log_prob (CSCR 2, OPPO 1; the teacher's 2)"""
    teacher: ModelShape | None = None
    teacher_micro_batch_tokens: int = 0

    def __post_init__(self) -> None:
        if self.name not in ESTIMATORS:
            raise ValueError(f"no memory estimate for estimator {self.name!r}: one of {ESTIMATORS}")


@dataclass(frozen=True)
class Term:
    """One part of a pass's memory at its peak."""

    name: str
    bytes: int
    rough: bool = False


@dataclass(frozen=True)
class MemoryEstimate:
    """An estimator's pass against verl's own old-log-prob pass, per GPU, above what stays resident."""

    estimator: str
    pass_terms: tuple[Term, ...]
    """the estimator's pass at its peak (empty: no pass of its own beyond verl's)"""
    verl_terms: tuple[Term, ...]
    """verl's old-log-prob pass at its peak"""
    notes: tuple[str, ...] = ()
    cost_passes: float | None = None
    """OAR-P: tokens fed per sample, in one-sequence log-prob passes"""

    @property
    def pass_bytes(self) -> int:
        return sum(t.bytes for t in self.pass_terms)

    @property
    def verl_bytes(self) -> int:
        return sum(t.bytes for t in self.verl_terms)

    @property
    def peak_bytes(self) -> int:
        """The larger of the two passes: what the GPU must hold above its resident state."""
        return max(self.pass_bytes, self.verl_bytes)

    @property
    def extra_bytes(self) -> int:
        """What the estimator adds to verl's own peak."""
        return max(0, self.pass_bytes - self.verl_bytes)


def _gather_terms(model: ModelShape, run: RunShape, whole: bool) -> list[Term]:
    b = run.dtype_bytes
    if whole:
        return [Term("gathered parameters (gather_params=true)", model.parameters() * b)]
    if not run.fsdp:
        return []
    return [Term("FSDP gathers (root + 2 layers)", (model.root_parameters() + 2 * model.layer_parameters()) * b,
                 rough=True)]


def _log_prob_pass(model: ModelShape, tokens: int, run: RunShape, entropy: bool) -> list[Term]:
    """verl's log-prob pass over ``tokens``: the larger of its logits stage and its MLP stage."""
    b = run.dtype_bytes
    logits = [Term("logits", tokens * model.vocab * b)]
    if entropy and ENTROPY_COPIES:
        logits.append(Term("entropy temporaries", ENTROPY_COPIES * tokens * model.vocab * b, rough=True))
    mlp = [Term("forward transient", tokens * model.forward_transient_per_token(b), rough=True)]
    return logits if sum(t.bytes for t in logits) >= mlp[0].bytes else mlp


def _oar_g(model: ModelShape, run: RunShape, s: EstimatorSettings) -> list[Term]:
    b, T = run.dtype_bytes, run.tokens
    predicting = run.samples * run.answer_tokens
    repeated = run.attention == "sdpa"
    outside = T * (4 * model.hidden + 4 + b * model.hidden)  # the final norm's fp32 input, rsqrt and output
    noisy = s.objective == "noisy_kl"
    embeddings = Term("embeddings, noise, their gradient" if noisy else "embeddings, their gradient",
                      (3 if noisy else 2) * T * model.hidden * b)
    outcome = Term("outcome logits (N x V) and their fp32 math", predicting * model.vocab * OUTCOME_BYTES[s.objective],
                   rough=True)
    full_logits: list[Term] = []
    if s.objective == "loglik" and s.fuse_log_prob:  # verl's log-probs come from this forward: its full logits
        full_logits = [t for t in _log_prob_pass(model, T, run, entropy=True) if t.name != "forward transient"]
    transient = Term("backward transient", 2 * T * model.intermediate * b, rough=True)
    if not s.gradient_checkpointing:  # every layer's activations through the whole pass: everything at once
        saved = T * model.layers * model.saved_per_token_layer(b, repeated) + outside
        return [Term("activations kept for the backward", saved), embeddings, outcome, *full_logits, transient]
    # each layer's input kept through the pass; above it the largest of three moments: the end of the forward
    # (fused: the full logits), the outcome's backward, one layer's activations recomputed with its backward's
    kept = [Term("layer inputs kept (gradient checkpointing)", T * model.layers * model.hidden * b + outside),
            embeddings]
    recomputed = [Term("one layer's activations, recomputed", T * model.saved_per_token_layer(b, repeated)), transient]
    moments = [full_logits, [outcome], recomputed]
    return kept + max(moments, key=lambda terms: sum(t.bytes for t in terms))


def _span_starts(reasoning: int, mode: str, k: int, m: int, u: int) -> list[list[int]]:
    """Per scoring round, the first reasoning position of each occluded copy of one response (module docstring)."""
    if reasoning <= 0:
        return [[]]
    if mode == "exact":
        return [list(range(reasoning))]
    k = min(k, reasoning)
    chunks = [(-(-j * reasoning // k), -(-(j + 1) * reasoning // k)) for j in range(k)]  # [start, end) per chunk
    rounds = [[start for start, _ in chunks]]
    if mode == "hierarchical":
        picked = sorted({int((i + 0.5) * k / min(m, k)) for i in range(min(m, k))})
        units = [start + t * u for j in picked for start, end in [chunks[j]] if end - start > u
                 for t in range(-(-(end - start) // u))]
        if units:
            rounds.append(units)
    return rounds


def _call_terms(rows: list[Row], held: int, model: ModelShape, run: RunShape) -> list[Term]:
    """One call's peak with the caches held around it: the largest of three moments (module docstring)."""
    b, c = run.dtype_bytes, model.kv_cache_per_token(run.dtype_bytes)
    m = len(rows)
    new, past = max(r.ids.numel() for r in rows), max(r.past_len for r in rows)
    keep = max(max(r.keep for r in rows), 1)
    returns_cache = any(r.cache for r in rows)
    gathered, grown = m * past * c, m * (past + new) * c
    held_term = Term("KV caches held (clean rows, prompts)", held)
    shape = f"{m} rows, prefix {past}, new {new}"
    mlp = m * new * model.forward_transient_per_token(b)
    mask, attention = 0, 0
    if run.attention == "sdpa":  # a bool padding mask for the whole forward; in attention its float copy and the
        mask = m * new * (past + new)  # KV heads repeated to all heads (flash-attention needs neither)
        attention = (4 * mask + 2 * m * (past + new) * model.q * b
                     + m * new * (5 * model.hidden + 2 * model.head_dim) * b)  # q, k, v, out, residual; cos / sin
    during = [held_term, Term(f"KV cache of the call ({shape})", gathered + grown),
              Term("forward transient" if mlp >= attention else "attention transient (SDPA: mask, repeated KV heads)",
                   max(mlp, attention) + mask, rough=True)]
    after = [held_term, Term(f"KV caches the call returns ({shape})", gathered + (3 * grown if returns_cache else 0)),
             Term("the call's logits", m * keep * model.vocab * b)]
    reduced = [held_term, Term(f"KV caches kept from the call ({shape})", grown if returns_cache else 0),
               Term("the call's logits, reduced in fp32", m * keep * model.vocab * (b + 12), rough=True)]
    return max((during, after, reduced), key=lambda terms: sum(t.bytes for t in terms))


def _oar_p_rounds(run: RunShape, s: EstimatorSettings) -> tuple[list[tuple[list[Row], list[Row], list[Row]]], int]:
    """The rows of each scoring round of one micro-batch of full-length samples, and the budget per call."""
    p, a = run.prompt_tokens, run.answer_tokens
    reasoning = max(run.response_tokens - a - MARKER_TOKENS, 0)
    end = p + reasoning + MARKER_TOKENS + a - 1  # the last predicting position + 1
    budget = s.perturb_max_tokens or run.tokens
    stub = torch.empty(0, dtype=torch.uint8)

    def row(n: int, past: int, keep: int = 0, cache: bool = False) -> Row:
        return Row(ids=stub.new_empty(n), positions=stub, past_len=past, keep=keep, cache=cache)

    rounds = []
    for starts in _span_starts(reasoning, s.perturb_mode, s.perturb_budget, s.perturb_refine_top,
                               s.perturb_refine_unit):
        prompts = [row(p, 0, cache=True) for _ in range(run.samples)] if p else []
        clean = [row(end - p, p, keep=a, cache=True) for _ in range(run.samples)]
        copies = [row(end - (p + st), p + st, keep=a) for _ in range(run.samples) for st in starts]
        rounds.append((prompts, clean, copies))
    return rounds, budget


OAR_P_MARGIN = 0.05
"""added to OAR-P's largest call: measured CPU peaks lay up to 2.5% above its named terms (the calls' int64 ids and
positions, index tensors, allocator rounding); with it the estimate is never below a measured peak (CPU test)"""


def _oar_p(model: ModelShape, run: RunShape, s: EstimatorSettings) -> list[Term]:
    """The largest call of the planned calls, with the caches held around it, plus ``OAR_P_MARGIN``."""
    c = model.kv_cache_per_token(run.dtype_bytes)
    rounds, budget = _oar_p_rounds(run, s)
    best: list[Term] = []
    for prompts, clean, copies in rounds:
        prompt_cache = sum(r.ids.numel() for r in prompts) * c
        stages = [(prompts, 0), (clean, prompt_cache), (copies, sum(r.past_len + r.ids.numel() for r in clean) * c)]
        for rows, held in stages:
            for call in plan_calls(rows, budget) if rows else []:
                terms = _call_terms([rows[i] for i in call], held, model, run)
                if sum(t.bytes for t in terms) > sum(t.bytes for t in best):
                    best = terms
    margin = math.ceil(OAR_P_MARGIN * sum(t.bytes for t in best))
    return [*best, Term("small tensors and rounding (5% margin)", margin, rough=True)] if best else best


def oar_p_cost_passes(run: RunShape, s: EstimatorSettings) -> float:
    """Tokens OAR-P feeds per sample (prompt, clean row, copies, each round; ``perturb_mode``, K, m, u), in
    one-sequence log-prob passes (S tokens). About ``1 + R (K + 1) / (2 S)`` for ``chunk`` (R reasoning tokens),
    ``R^2 / (2 S)`` for ``exact``; ``hierarchical`` adds a second clean pass and its units (refined chunks assumed
    evenly spread). A prompt is counted once per sample (a group's samples may share it: a little less). A count
    of tokens, not of time: attention over long prefixes makes a token of a late copy dearer than a log-prob token
    (``OAR_P_MEASURED_COST`` holds measured time factors)."""
    rounds, _ = _oar_p_rounds(RunShape(run.sequence, run.prompt_tokens, run.response_tokens,
                                       answer_tokens=run.answer_tokens), s)
    fed = sum(r.ids.numel() for stage in rounds for rows in stage for r in rows)
    return fed / max(run.sequence, 1)


def estimate(model: ModelShape, run: RunShape, settings: EstimatorSettings) -> MemoryEstimate:
    """The estimator's pass and verl's own old-log-prob pass at their peaks, per GPU (module docstring)."""
    name, notes = settings.name, []
    gathers = _gather_terms(model, run, whole=False)
    verl = gathers + _log_prob_pass(model, run.tokens, run, entropy=True)
    whole = settings.gather_params and run.fsdp
    own: list[Term] = []
    cost = None
    if name == "oar_g":
        own = _gather_terms(model, run, whole) + _oar_g(model, run, settings)
        notes.append("with gradient checkpointing: each layer's input is kept for the input-gradient backward and one "
                     "layer's activations are recomputed at a time" if settings.gradient_checkpointing else
                     "without gradient checkpointing: every layer's activations are kept for the input-gradient "
                     "backward (actor_rollout_ref.model.enable_gradient_checkpointing=true keeps only each layer's "
                     "input)")
    elif name == "oar_p":
        own = _gather_terms(model, run, whole) + _oar_p(model, run, settings)
        cost = oar_p_cost_passes(run, settings)
    elif name == "acpo" and settings.acpo_modal:
        rows = min(max(1, settings.acpo_block_bytes // (4 * model.vocab)), run.tokens)
        own = verl + [Term("top-1 log-prob block (fp32), a row statistic, the (T,) result and 1 / temperature",
                           rows * model.vocab * 4 + rows * 4 + 2 * run.tokens * 4)]
    elif name == "oppo" and settings.teacher is not None:
        t, tokens = settings.teacher, max(settings.teacher_micro_batch_tokens or run.tokens, run.sequence)
        own = ([Term("teacher's gathered root + 2 layers (parameters stay in CPU memory)",
                     (t.root_parameters() + 2 * t.layer_parameters()) * run.dtype_bytes, rough=True)]
               + _log_prob_pass(t, tokens, run, entropy=False))
        notes.append(f"the teacher's parameters take {format_bytes(t.parameters() * run.dtype_bytes)} of pinned CPU "
                     "memory in all, shared over the ranks")
    elif name in ("cscr", "oppo"):
        notes.append(f"re-scoring: verl's compute_log_prob over {settings.rescore_copies} x the batch in verl's own "
                     "micro-batches: no peak beyond verl's pass")
    if model.moe:
        notes.append("mixture-of-experts model: experts are not modelled (rough)")
    if run.attention == "eager":
        notes.append("eager attention keeps the (heads, T, T) attention weights: not modelled (rough)")
    return MemoryEstimate(name, tuple(own), tuple(verl), tuple(notes), cost)


def training_state_bytes(model: ModelShape, data_parallel: int, storage_bytes: int = 4) -> tuple[int, int]:
    """(parameter shard, Adam state) per GPU of verl's FSDP actor: its parameters in ``storage_bytes`` (verl's
    ``model_dtype``, fp32) over ``data_parallel`` ranks, and Adam's two fp32 moments per parameter of the shard
    (created by the first optimizer step)."""
    shard = math.ceil(model.parameters() / max(data_parallel, 1))
    return shard * storage_bytes, 2 * 4 * shard


RESERVE_BYTES = 2 << 30
"""memory outside any estimate: CUDA contexts (this process, a sleeping rollout server's), NCCL buffers"""
RESERVE_FRACTION = 0.05
"""of the GPU's total: the caching allocator's fragmentation, kernel workspaces"""


@dataclass(frozen=True)
class FitDecision:
    """An estimate against a GPU, bytes."""

    usable: int
    """total - resident - what the rollout keeps - reserve"""
    pass_bytes: int
    verl_bytes: int
    reserve: int

    @property
    def refuse(self) -> bool:
        """The estimator's pass does not fit and is the larger of the two (verl's own pass alone is verl's matter)."""
        return self.pass_bytes > self.usable and self.pass_bytes > self.verl_bytes

    @property
    def verl_fits(self) -> bool:
        return self.verl_bytes <= self.usable


def decide_fit(estimate: MemoryEstimate, total: int, resident: int, rollout_held: int = 0) -> FitDecision:
    """Compare an estimate with a GPU of ``total`` bytes whose training state holds ``resident`` bytes during the
    pass (parameters, optimizer state, buffers) and whose rollout engine keeps ``rollout_held`` bytes while the
    trainer computes (0 when it frees its memory: verl's ``free_cache_engine``). A reserve of ``RESERVE_BYTES`` or
    ``RESERVE_FRACTION`` of the total, whichever is larger, stands for what no estimate counts."""
    reserve = max(RESERVE_BYTES, int(RESERVE_FRACTION * total))
    return FitDecision(usable=total - resident - rollout_held - reserve, pass_bytes=estimate.pass_bytes,
                       verl_bytes=estimate.verl_bytes, reserve=reserve)
