"""What training does with ungraded answers (verl_oar.integration.grading), on hand-built rows: which rows are
ungraded, and the scores that leave them out of their group's baseline. The trainer path (metric, scores written
back, advantages zeroed) runs through ``main_ppo`` in tests/e2e/test_real_model_e2e_on_cpu.py."""

from __future__ import annotations

import pytest
import torch

from verl_oar.integration.grading import scores_left_out, ungraded_rows


def test_ungraded_rows_are_read_from_the_rewards_extra_info():
    info = [{"reward_extra_info": {"graded": 1.0, "grade": "exact", "pred": "1"}},
            {"reward_extra_info": {"graded": 0.0, "grade": "timed_out", "pred": "9^9"}},
            {"reward_extra_info": {"score": 1.0}},                       # another reward function: graded
            None,                                                        # no extra fields
            {"reward_extra_info": {"graded": 0.0, "grade": "no_worker", "pred": "2"}}]   # a padding row
    rows, grades, preds = ungraded_rows(info, torch.tensor([True, True, True, True, False]))
    assert rows == [1] and preds == ["9^9"]
    assert grades == {"exact": 1, "timed_out": 1, "graded": 2}


def _scores(totals, length=5, lengths=None):
    scores = torch.zeros(len(totals), length)
    for row, total in enumerate(totals):
        last = (lengths[row] if lengths else length) - 1
        scores[row, last] = total
    return scores


def test_an_ungraded_answer_takes_its_groups_graded_mean_and_so_moves_neither_mean_nor_advantage():
    # group a: 1, 0, ungraded, 1 -> the ungraded one gets 2/3; group b: all but one ungraded; group c: none graded
    uids = ["a", "a", "a", "a", "b", "b", "c", "c"]
    totals = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    lengths = [5, 3, 2, 5, 4, 5, 1, 5]
    scores = _scores(totals, lengths=lengths)
    out = scores_left_out(scores, uids, [2, 5, 6, 7])
    assert out.sum(-1).tolist() == pytest.approx([1.0, 0.0, 2 / 3, 1.0, 1.0, 1.0, 0.0, 0.0])
    assert out[2, 4] == pytest.approx(2 / 3)          # a zero score sits on the row's last token
    assert torch.equal(scores.sum(-1), torch.tensor(totals))   # the input is not changed
    # GRPO on the result: the group's mean is the graded mean, so the ungraded answer's advantage is exactly 0
    group = out.sum(-1)[:4]
    assert float(group.mean()) == pytest.approx(2 / 3) and float(group[2] - group.mean()) == pytest.approx(0.0)


def test_a_padding_row_never_counts_as_a_graded_member_of_a_group():
    uids = ["a", "a", "a"]
    scores = _scores([1.0, 0.0, 0.0])
    out = scores_left_out(scores, uids, [2], real=torch.tensor([False, True, True]))
    assert out.sum(-1)[2] == 0.0                        # only row 1 (score 0) is a graded real member


def test_a_step_with_more_ungraded_answers_than_the_limit_stops_naming_the_limit_and_the_answers():
    from verl_oar.integration.grading import grading_report

    info = [{"reward_extra_info": {"graded": 0.0, "grade": "no_worker", "pred": "9^{9^{9}}"}}] * 2 + \
           [{"reward_extra_info": {"graded": 1.0, "grade": "refuted", "pred": "3"}}] * 6
    rows, metrics = grading_report(info, None, limit=0.25, step=7)
    assert rows == [0, 1] and metrics == {"reward/ungraded_frac": 0.25, "reward/grade/no_worker": 0.25,
                                          "reward/grade/refuted": 0.75}
    with pytest.raises(RuntimeError, match=r"2 of 8 answers in step 7 .*no_worker: 2.*max_ungraded_frac=0.2\..*9\^"):
        grading_report(info, None, limit=0.2, step=7)
