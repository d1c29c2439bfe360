"""What training does with an answer the reward did not grade: counted, left out of the update, stopped past a limit.

``verl_oar.rewards.math_reward`` marks each result ``graded`` (1.0 / 0.0) with its ``grade`` (``timed_out``,
``no_worker``, ``prescreened``, ...). verl keeps those keys in each sample's ``extra_fields["reward_extra_info"]``
but logs none of them in training. For every estimator, GRPO included, when the run grades with that reward
(``reward.custom_reward_function.path`` names ``verl_oar.rewards.math_reward``), the trainer (any v1 mode: its
``_compute_advantage``) does, each step, over the batch's real rows:

1. **logs** ``reward/ungraded_frac`` (rows not graded / rows) and ``reward/grade/<grade>`` (each grade's share);
2. **stops** the run when ``reward/ungraded_frac`` exceeds ``reward_kwargs.max_ungraded_frac`` (default
   ``MAX_UNGRADED_FRAC``), naming the limit, the grades and a few of the answers;
3. **leaves an ungraded answer out of the update**: before the advantage, its score is set to the mean score of
   its group's graded answers (so it moves neither the group's mean nor its baseline; a group with none graded
   gets 0), and after it, its advantages are set to 0 (no policy gradient from it). What remains: the group's
   standard deviation is taken over all its answers, the ungraded ones sitting at the mean, so with ``m`` of ``n``
   graded it is ``sqrt((m-1)/(n-1))`` of the std over the graded ones alone.

Rows whose reward returned no ``graded`` key count as graded (another reward function). verl's legacy trainer
(``trainer.use_v1=false``) does not get this: the reward still says ``graded`` per sample, validation averages it
(``val-aux/{data_source}/graded/mean@N``), training logs nothing.
"""

from __future__ import annotations

__all__ = ["MAX_UNGRADED_FRAC", "GradingMixin", "grades_answers", "grading_report", "max_ungraded_frac",
           "scores_left_out", "ungraded_rows"]

MAX_UNGRADED_FRAC = 0.05
"""default largest share of a step's answers that may go ungraded before the run stops"""
REWARD_MODULE = "verl_oar.rewards.math_reward"


def _reward_kwargs(config) -> dict:
    function = (config.get("reward", None) or {}).get("custom_reward_function", None) or {}
    return dict(function.get("reward_kwargs", None) or {})


def grades_answers(config) -> bool:
    """Whether the run's reward is verl-oar's math reward (which says per answer whether it was graded)."""
    function = (config.get("reward", None) or {}).get("custom_reward_function", None) or {}
    path = str(function.get("path", None) or "")
    return REWARD_MODULE in path or REWARD_MODULE.replace(".", "/") in path


def max_ungraded_frac(config) -> float:
    """``reward.custom_reward_function.reward_kwargs.max_ungraded_frac``, checked to lie in [0, 1]."""
    value = _reward_kwargs(config).get("max_ungraded_frac", MAX_UNGRADED_FRAC)
    try:
        limit = float(value)
    except (TypeError, ValueError):
        limit = -1.0
    if not 0.0 <= limit <= 1.0:
        raise ValueError(f"reward.custom_reward_function.reward_kwargs.max_ungraded_frac={value!r}: must be a share "
                         f"in [0, 1] of a step's answers that may go ungraded (default {MAX_UNGRADED_FRAC})")
    return limit


def ungraded_rows(extra_fields: list, real) -> tuple[list[int], dict[str, int], list[str]]:
    """``(rows not graded, {grade: count} over real rows, preds of the ungraded)`` from each row's
    ``extra_fields`` (dicts with ``reward_extra_info``); ``real`` is a (bs,) bool mask or None (all real)."""
    rows, grades, preds = [], {}, []
    for row, fields in enumerate(extra_fields):
        if real is not None and not bool(real[row]):
            continue
        info = (fields or {}).get("reward_extra_info", None) if isinstance(fields, dict) else None
        info = info or {}
        grade = str(info.get("grade", "graded"))
        grades[grade] = grades.get(grade, 0) + 1
        if "graded" in info and float(info["graded"]) == 0.0:
            rows.append(row)
            preds.append(str(info.get("pred", ""))[:80])
    return rows, grades, preds


def grading_report(extra_fields: list, real, limit: float, step: int) -> tuple[list[int], dict[str, float]]:
    """``(ungraded rows, {"reward/ungraded_frac", "reward/grade/<grade>"})`` of one step; RuntimeError naming the
    limit, the grades and a few answers when the ungraded share exceeds ``limit``."""
    rows, grades, preds = ungraded_rows(extra_fields, real)
    total = max(1, sum(grades.values()))
    metrics = {"reward/ungraded_frac": len(rows) / total}
    metrics.update({f"reward/grade/{grade}": count / total for grade, count in grades.items()})
    if len(rows) / total > limit:
        raise RuntimeError(
            f"{len(rows)} of {total} answers in step {step} were not graded "
            f"({', '.join(f'{g}: {c}' for g, c in sorted(grades.items()))}), more than "
            f"reward.custom_reward_function.reward_kwargs.max_ungraded_frac={limit}. Answers not graded, e.g. "
            f"{preds[:3]}. Raise reward_kwargs.verify_workers or queue_timeout_s / timeout_s if grading was slow, "
            "or raise max_ungraded_frac to train on with them left out of the update.")
    return rows, metrics


def scores_left_out(scores, uids: list[str], rows: list[int], real=None):
    """(bs, T) sequence scores on their last scored token, with each row in ``rows`` (ungraded) set to the mean total
    score of the graded real rows of its group (same ``uids`` entry), or 0 when the group has none; on the row's last
    nonzero token, or its last token. A new tensor; ``scores`` is not changed."""
    scores = scores.clone()
    left_out = set(rows)
    totals = scores.sum(-1)
    for row in rows:
        graded = [r for r, uid in enumerate(uids) if uid == uids[row] and r not in left_out
                  and (real is None or bool(real[r]))]
        target = float(totals[graded].mean()) if graded else 0.0
        nonzero = scores[row].nonzero()
        last = int(nonzero[-1]) if len(nonzero) else scores.shape[-1] - 1
        scores[row].zero_()
        scores[row, last] = target
    return scores


class GradingMixin:
    """A v1 trainer's ``_compute_advantage`` with the three steps of the module docstring."""

    def _compute_advantage(self, batch, metrics):
        if not grades_answers(self.config):
            return super()._compute_advantage(batch, metrics)
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict
        from verl.workers.utils.padding import response_to_nested

        from verl_oar.integration.signals import real_rows

        limit = max_ungraded_frac(self.config)
        if batch.fields is not None and "extra_fields" not in batch.fields:
            return super()._compute_advantage(batch, metrics)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
        extra = data["extra_fields"]
        extra = extra.tolist() if hasattr(extra, "tolist") else list(extra)
        real = real_rows(batch.tags)
        rows, step_metrics = grading_report(extra, real, limit, int(getattr(self, "global_steps", 0)))
        metrics.update(step_metrics)
        if not rows:
            return super()._compute_advantage(batch, metrics)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["uid", "rm_scores", "response_mask"])
        mask = data["response_mask"]
        padded = data.to_padded_tensor()
        scores = padded["rm_scores"]
        uids = padded.pop("uid")             # a NonTensorStack, as verl's _compute_advantage reads it
        uids = [str(u) for u in (uids.tolist() if hasattr(uids, "tolist") else list(uids))]
        scores = scores_left_out(scores, uids, rows, real)
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                        fields=TensorDict({"rm_scores": response_to_nested(scores, mask)}, batch_size=len(batch)))
        batch = super()._compute_advantage(batch, metrics)
        out = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["advantages"])
        advantages = out.to_padded_tensor()["advantages"].clone()
        advantages[torch.tensor(rows)] = 0.0
        batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                                fields=TensorDict({"advantages": response_to_nested(advantages, mask)},
                                                  batch_size=len(batch)))
        return batch
