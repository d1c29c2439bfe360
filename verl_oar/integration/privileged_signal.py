"""Privileged re-scoring: the sampled responses' log-probs under rewritten prompts, on the actor's
engine, and the two token signals built from them (``cscr_shifts``, ``oppo_evidence``).

verl extension points (checked against verl 0.9.1): the token-signal channel (``signals``: providers run
right after the old-log-prob step, when ``old_log_probs`` are in TransferQueue) and verl's own
``compute_log_prob`` worker call, so the pass has the engine's packing, micro-batching, dynamic batch
size and offload. Per step:

1. read each row's ``raw_prompt`` (chat messages), ``reward_model`` (ground truth, when a template has
   ``{answer}``), ``responses`` and ``response_mask`` from TransferQueue;
2. for every template, rewrite the last user turn (``core.privileged_prompt``), render it with the
   rollout's own token builder (``create_continuous_token_builder`` with ``data.apply_chat_template_kwargs``,
   as verl's agent loop) and append the response; a row whose privileged prompt + response exceeds the
   context (the model's ``max_position_embeddings``, ``rollout.max_model_len``, and under dynamic batch
   size ``rollout.log_prob_max_token_len_per_gpu``) gets its question shortened from the middle until it
   fits (``core.privileged_prompt.fit_question``: the chat header, system prompt and template are never
   cut; ``overflow=truncate``) or is skipped (``overflow=skip``, or when even an empty question does not
   fit), counted; verl's synthetic padding rows are re-scored as they are (log-prob shift 0);
3. every template's rows go into one TransferQueue partition of their own (``PARTITION``) and through
   ONE ``compute_log_prob`` call at the rollout temperature (balanced across data-parallel ranks as verl
   balances the batch, :func:`balance`; K templates x a batch that verl already made divisible keeps every
   divisibility of the old-log-prob call); the partition is cleared afterwards, also on error;
4. the response tokens' log-probs minus a baseline are the shifts, written as nested (bs, response_len)
   fields under the batch's keys. The baseline is ``old_log_probs`` (the same actor, weights and
   temperature on the rollout's own prompt), except where that is not the scoring model's own: in
   rollout-correction bypass mode verl sets ``old_log_probs`` to the rollout engine's log-probs, and OPPO's
   teacher is another model; there the rollout's own prompt is scored in the same call as a template of its
   own and subtracted (``{prefix}/rescore/plain_baseline`` 1), so that no train/inference mismatch enters
   the signal.

The actor scores its own rollout: CSCR's self-teacher and OPPO's self-oracle (or OPPO's frozen teacher,
``oracle=teacher``). Text prompts only (multimodal rows are refused with the cause).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from verl_oar.core.cscr import CSCRConfig
from verl_oar.core.oppo import OPPOConfig
from verl_oar.core.privileged_prompt import fit_question, ground_truth, rewrite_messages
from verl_oar.integration import compat
from verl_oar.integration.signals import register_token_signal
from verl_oar.integration.teacher import attach_teacher, check_teacher
from verl_oar.integration.validate import bypass_mode

PARTITION = "verl_oar_privileged"
"""TransferQueue partition of the re-scored rows (never "train"/"val": verl's replay buffer reads those)"""
CSCR_FIELDS = ("cscr_pos_shift", "cscr_neg_shift", "cscr_scored")
OPPO_FIELDS = ("oppo_evidence", "oppo_scored")
SEQLEN_PREFIX = "verl_oar_privileged_seqlen"
"""``logging_prefix`` of the pass's balancing (its statistics are not logged)"""


@dataclass
class Rescored:
    """The pass's result for one template: per row the response tokens' shifts against the baseline (1-D float32,
    0 on padding and on rows that were not scored)."""

    shifts: list[torch.Tensor]
    scored: list[bool]
    """False: the row was not scored (past the context with ``overflow=skip``, or even with an empty question)"""


@dataclass
class RescoreStats:
    rows: int = 0
    truncated: int = 0
    """rows whose question was shortened to fit the context"""
    skipped: int = 0
    seconds: float = 0.0
    plain_baseline: bool = False
    """the shifts are taken against the rollout's prompt re-scored in the same call (not ``old_log_probs``)"""
    prompt_tokens_added: list[int] = field(default_factory=list)

    def metrics(self, prefix: str) -> dict[str, float]:
        added = self.prompt_tokens_added
        return {
            f"{prefix}/rescore/rows": float(self.rows),
            f"{prefix}/rescore/truncated": float(self.truncated),
            f"{prefix}/rescore/skipped": float(self.skipped),
            f"{prefix}/rescore/seconds": float(self.seconds),
            f"{prefix}/rescore/plain_baseline": float(self.plain_baseline),
            f"{prefix}/rescore/prompt_tokens_added_mean": float(sum(added) / len(added)) if added else 0.0,
        }


def _model_facts(trainer) -> tuple[str | None, int]:
    """(hf model_type, context limit in tokens) of the actor's model, read once per trainer."""
    cached = getattr(trainer, "_verl_oar_model_facts", None)
    if cached is not None:
        return cached
    from transformers import AutoConfig

    model = trainer.config.actor_rollout_ref.model
    hf = AutoConfig.from_pretrained(model.path, trust_remote_code=bool(model.get("trust_remote_code", False)))
    limit = getattr(hf, "max_position_embeddings", None) or math.inf
    rollout = trainer.config.actor_rollout_ref.rollout
    if rollout.get("max_model_len", None):
        limit = min(limit, int(rollout.max_model_len))
    if rollout.get("log_prob_use_dynamic_bsz", False) and rollout.get("log_prob_max_token_len_per_gpu", None):
        limit = min(limit, int(rollout.log_prob_max_token_len_per_gpu))
    trainer._verl_oar_model_facts = (getattr(hf, "model_type", None), limit)
    return trainer._verl_oar_model_facts


def _teacher_limit(trainer) -> float:
    """The teacher's context (``max_position_embeddings``; inf when its config has none), read once."""
    cached = getattr(trainer, "_verl_oar_teacher_limit", None)
    if cached is None:
        from transformers import AutoConfig

        path = OPPOConfig.from_algorithm(trainer.config.algorithm).teacher_path
        remote = bool(trainer.config.actor_rollout_ref.model.get("trust_remote_code", False))
        cached = getattr(AutoConfig.from_pretrained(path, trust_remote_code=remote), "max_position_embeddings", None) or math.inf
        trainer._verl_oar_teacher_limit = cached
    return cached


def _token_builder(trainer):
    """verl's rollout token builder for this model (what the agent loop renders prompts with)."""
    builder = getattr(trainer, "_verl_oar_token_builder", None)
    if builder is None:
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        kwargs = dict(trainer.config.data.get("apply_chat_template_kwargs", None) or {})
        builder = create_continuous_token_builder(trainer.tokenizer, hf_model_type=_model_facts(trainer)[0],
                                                  chat_template_kwargs=kwargs)
        trainer._verl_oar_token_builder = builder
    return builder


def _rows(data, name: str) -> list:
    value = data[name]
    return list(value.unbind()) if isinstance(value, torch.Tensor) else list(value)


@dataclass
class PrivilegedRows:
    """The rows of one re-scoring pass, template-major: row ``j * n + i`` is template j on batch row i."""

    keys: list[str]
    rows: list[dict]
    """per row: ``prompts``, ``responses``, ``response_mask``, ``loss_mask``, ``input_ids``, ``position_ids``
    (1-D long tensors, no padding: verl's nested layout)"""
    tags: list[dict]
    scored: list[bool]


def privileged_rows(
    templates: list[str | None], keys: list[str], messages: list, prompts: list[torch.Tensor], responses: list[torch.Tensor],
    masks: list[torch.Tensor], answers: list[str | None], padding: list[bool], build_tokens, limit: float,
    overflow: str, stats: RescoreStats,
) -> PrivilegedRows:
    """Step 2 of the module docstring: each row's rewritten prompt (``build_tokens(messages) -> ids``, the
    rollout's token builder; template None: the rollout's own prompt ids), followed by its response. A row over
    ``limit`` tokens gets its question shortened until it fits (``overflow="truncate"``,
    ``core.privileged_prompt.fit_question``; template None re-renders the rollout's messages so) or is not scored
    (``overflow="skip"``, or when even an empty question does not fit: scored on its rollout prompt, ``scored``
    False), counted in ``stats``. Padding rows keep their rollout prompt."""
    out = PrivilegedRows([], [], [], [])
    for j, template in enumerate(templates):
        for i, key in enumerate(keys):
            response = responses[i]
            ok = True
            if padding[i]:
                prompt = prompts[i]
            else:
                if template is None:
                    prompt = prompts[i]
                else:
                    ids = build_tokens(rewrite_messages(list(messages[i]), template, answers[i] or ""))
                    prompt = torch.as_tensor(ids, dtype=torch.long)
                    stats.prompt_tokens_added.append(len(prompt) - len(prompts[i]))
                room = limit - len(response)
                if len(prompt) > room:
                    fitted = None
                    if overflow == "truncate" and room >= 1:
                        fitted, _ = fit_question(list(messages[i]), template or "{question}", answers[i] or "",
                                                 build_tokens, int(room))
                    if fitted is None:
                        ok, prompt = False, prompts[i]  # scored as the rollout's own prompt; the result is not used
                        stats.skipped += 1
                    else:
                        prompt = torch.as_tensor(fitted, dtype=torch.long)
                        stats.truncated += 1
            input_ids = torch.cat([prompt, response])
            out.keys.append(f"t{j}/{key}")
            out.rows.append({"prompts": prompt, "responses": response, "response_mask": masks[i], "loss_mask": masks[i],
                             "input_ids": input_ids, "position_ids": torch.arange(len(input_ids), dtype=torch.long)})
            out.tags.append({"seq_len": len(input_ids), "is_padding": padding[i]})
            out.scored.append(ok)
    stats.rows += len(out.rows)
    return out


def relative_shifts(log_probs: list[torch.Tensor], scored: list[bool], old: list[torch.Tensor],
                    masks: list[torch.Tensor], plain_baseline: bool) -> list[Rescored]:
    """Step 4 of the module docstring. ``log_probs``: the pass's rows, template-major (row ``j * n + i``, each the
    1-D response log-probs); with ``plain_baseline`` template 0 is the rollout's own prompt and every other
    template's shifts are taken against it, else against ``old_log_probs`` (``old``, n rows). A row either side
    could not score gets 0 and ``scored`` False."""
    n = len(old)
    first = 1 if plain_baseline else 0
    out = []
    for j in range(first, len(log_probs) // n if n else 0):
        shifts, ok = [], []
        for i in range(n):
            row = j * n + i
            good = scored[row] and (scored[i] or not plain_baseline)
            reference = log_probs[i] if plain_baseline else old[i]
            shift = (log_probs[row].float() - reference.float()) if good else torch.zeros(len(masks[i]))
            shifts.append(shift * masks[i].float())
            ok.append(good)
        out.append(Rescored(shifts=shifts, scored=ok))
    return out


def balance(trainer, meta):
    """``meta`` (a ``KVBatchMeta`` of the pass's rows) padded and reordered for the actor's data-parallel ranks as
    verl balances the training batch: verl's public ``PPOTrainer.balance_batch`` when the trainer's class has it
    (upstream PR ``balance-batch``), else the private ``_balance_batch`` through ``compat`` (the access is logged).
    The balance statistics are dropped (verl's own step logs the training batch's)."""
    if callable(getattr(type(trainer), "balance_batch", None)):
        method = trainer.balance_batch
    else:
        method = compat.private_attr(trainer, "verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch")
    return method(meta, metrics={}, logging_prefix=SEQLEN_PREFIX)


def rescore(trainer, batch, templates: list[str], overflow: str, stats: RescoreStats, teacher: bool = False,
            plain_baseline: bool = False) -> list[Rescored]:
    """Steps 1-4 of the module docstring for ``templates``, one ``Rescored`` each; one call in all: the actor's
    ``compute_log_prob``, or with ``teacher`` OPPO's frozen teacher (``compute_teacher_log_prob``, and the context
    limit is the smaller of the two models'). With ``plain_baseline`` the rollout's own prompt is scored in the
    same call (n rows more) and the shifts are taken against it instead of ``old_log_probs``."""
    import transfer_queue as tq
    from transfer_queue import KVBatchMeta
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.utils.padding import response_from_nested

    started = time.perf_counter()
    passes = ([None] if plain_baseline else []) + list(templates)
    needs_answer = any(t is not None and "{answer}" in t for t in passes)
    fields = ["raw_prompt", "prompts", "responses", "response_mask", "old_log_probs"] + (["reward_model"] if needs_answer else [])
    src = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    messages, prompts = _rows(src, "raw_prompt"), _rows(src, "prompts")
    responses, masks, old = _rows(src, "responses"), _rows(src, "response_mask"), _rows(src, "old_log_probs")
    answers = [None] * len(batch)
    padding = [bool((tag or {}).get("is_padding", False)) for tag in batch.tags]
    if needs_answer:
        rms = _rows(src, "reward_model")
        answers = [None if pad else ground_truth(rm) for rm, pad in zip(rms, padding, strict=True)]
    _, limit = _model_facts(trainer)
    if teacher:
        limit = min(limit, _teacher_limit(trainer))
    built = privileged_rows(passes, list(batch.keys), messages, prompts, responses, masks, answers, padding,
                            _token_builder(trainer).build_initial_tokens, limit, overflow, stats)
    keys, tags = built.keys, built.tags
    meta_keys = keys
    try:
        tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=list_of_dict_to_tensordict(built.rows), tags=tags)
        meta = KVBatchMeta(keys=keys, tags=tags, partition_id=PARTITION, extra_info={
            "calculate_entropy": False, "compute_loss": False,
            "temperature": trainer.config.actor_rollout_ref.rollout.temperature,
        })
        meta = balance(trainer, meta)
        meta_keys = list(meta.keys)
        score = trainer.actor_rollout_wg.compute_teacher_log_prob if teacher else trainer.actor_rollout_wg.compute_log_prob
        output = score(meta)
        if len(output) != len(meta):
            raise RuntimeError(f"privileged re-scoring: compute_log_prob returned {len(output)} rows for {len(meta)}")
        got = tq.kv_batch_get(keys=keys, partition_id=PARTITION, select_fields=["log_probs", "response_mask"])
        log_probs = list(response_from_nested(got["log_probs"], got["response_mask"]).unbind())
    finally:
        tq.kv_clear(keys=meta_keys, partition_id=PARTITION)
    stats.plain_baseline = plain_baseline
    stats.seconds += time.perf_counter() - started
    return relative_shifts(log_probs, built.scored, old, masks, plain_baseline)


def _put(batch, tensors: dict[str, list[torch.Tensor]]) -> None:
    import transfer_queue as tq
    from tensordict import TensorDict

    from verl_oar.engines.inputs import nested

    fields = TensorDict({name: nested(rows) for name, rows in tensors.items()}, batch_size=len(batch))
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)


def _scored_rows(result: Rescored, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(shift, int(ok), dtype=torch.long) for shift, ok in zip(like, result.scored, strict=True)]


def validate_privileged(config) -> None:
    """Start-up checks shared by CSCR and OPPO: their keys, and a trainer that can re-score."""
    from verl_oar.integration.validate import estimator_name, validate_success_probability_reward

    name = estimator_name(config)
    (CSCRConfig if name == "cscr" else OPPOConfig).from_algorithm(config.algorithm)
    strategy = config.actor_rollout_ref.actor.strategy
    if strategy not in ("fsdp", "fsdp2", "megatron"):
        raise ValueError(f"algorithm.adv_estimator={name} re-scores responses on the actor's engine; "
                         f"actor_rollout_ref.actor.strategy={strategy!r} is not one of fsdp, fsdp2, megatron.")
    if config.actor_rollout_ref.model.get("use_fused_kernels", False):
        raise ValueError(f"algorithm.adv_estimator={name} needs per-token log-probs at the rollout temperature from "
                         "verl's log-prob pass; actor_rollout_ref.model.use_fused_kernels=True is not supported here. "
                         "Set actor_rollout_ref.model.use_fused_kernels=False.")
    if name == "oppo":
        validate_success_probability_reward(config, name)
        path = OPPOConfig.from_algorithm(config.algorithm).teacher_path
        if path is not None:
            check_teacher(config, path)


def attach_oppo_teacher(config) -> None:
    """Start-up, before verl builds the workers: give them OPPO's teacher to load (``oracle=teacher``)."""
    path = OPPOConfig.from_algorithm(config.algorithm).teacher_path
    if path is not None:
        attach_teacher(config, path)


@register_token_signal("cscr_shifts", fields=CSCR_FIELDS, validate=validate_privileged)
def compute_cscr_shifts(trainer, batch, metrics: dict) -> None:
    """``cscr_pos_shift`` / ``cscr_neg_shift``: log pi(y_t | x + c+/-, y_<t) - old_log_prob_t (nats; in bypass mode
    minus log pi(y_t | x, y_<t) from the same call); ``cscr_scored`` 1 on rows that were re-scored (0: GRPO's
    credit)."""
    cfg = CSCRConfig.from_algorithm(trainer.config.algorithm)
    stats = RescoreStats()
    pos, neg = rescore(trainer, batch, [cfg.pos_template, cfg.neg_template], cfg.overflow, stats,
                       plain_baseline=bypass_mode(trainer.config))
    scored = [torch.full_like(p, int(a and b), dtype=torch.long) for p, a, b in zip(pos.shifts, pos.scored, neg.scored, strict=True)]
    _put(batch, {"cscr_pos_shift": pos.shifts, "cscr_neg_shift": neg.shifts, "cscr_scored": scored})
    metrics.update(stats.metrics("cscr"))


@register_token_signal("oppo_evidence", fields=OPPO_FIELDS, validate=validate_privileged, attach=attach_oppo_teacher)
def compute_oppo_evidence(trainer, batch, metrics: dict) -> None:
    """``oppo_evidence`` (nats): self-oracle, log pi(y_t | x + oracle(y*), y_<t) - old_log_prob_t (in bypass mode
    minus log pi(y_t | x, y_<t) from the same call); teacher, log pi_T(y_t | x + oracle(y*), y_<t) -
    log pi_T(y_t | x, y_<t), both rows in one teacher call. ``oppo_scored`` 1 on rows that were re-scored (0:
    broadcast credit, ``core.oppo``)."""
    cfg = OPPOConfig.from_algorithm(trainer.config.algorithm)
    stats = RescoreStats()
    teacher = cfg.oracle == "teacher"
    (oracle,) = rescore(trainer, batch, [cfg.template], cfg.overflow, stats, teacher=teacher,
                        plain_baseline=teacher or bypass_mode(trainer.config))
    _put(batch, {"oppo_evidence": oracle.shifts, "oppo_scored": _scored_rows(oracle, oracle.shifts)})
    metrics.update(stats.metrics("oppo"))
