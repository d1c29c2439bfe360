"""The real-text arithmetic task (verl_oar/data/arithmetic.py): answers computed by a plain reference, splits
disjoint by arithmetic, deterministic per seed, verl rows the math reward grades."""

from __future__ import annotations

import pytest

from verl_oar.data import arithmetic as ar


@pytest.mark.parametrize("kind", ar.KINDS)
def test_answers_equal_a_plain_evaluation_and_the_splits_share_no_arithmetic(kind):
    spec = ar.TaskSpec(kind=kind)
    train, test = ar.problems(spec, "train"), ar.problems(spec, "test")
    assert train and test
    assert not {p.arithmetic for p in train} & {p.arithmetic for p in test}
    assert len({p.arithmetic for p in train + test}) == len(train) + len(test)  # each arithmetic once
    for p in train + test:
        total, sign, number = 0, 1, ""
        for ch in p.arithmetic + "+":  # a left-to-right reference, not Python's eval
            if ch.isdigit():
                number += ch
            else:
                total, number = total + sign * int(number), ""
                sign = 1 if ch == "+" else -1
        assert p.answer == total >= 0, p
        assert all(n in p.question for n in p.arithmetic.replace("-", "+").split("+")), p


def test_a_seed_fixes_the_split_and_the_words():
    a, b = ar.problems(ar.TaskSpec(seed=3), "test"), ar.problems(ar.TaskSpec(seed=3), "test")
    assert a == b and a != ar.problems(ar.TaskSpec(seed=4), "test")
    with pytest.raises(ValueError, match="unknown kind 'word9'"):
        ar.problems(ar.TaskSpec(kind="word9"), "test")
    with pytest.raises(ValueError, match="split must be"):
        ar.problems(ar.TaskSpec(), "val")


def test_rows_are_verl_rows_that_the_math_reward_grades(tmp_path):
    import pandas as pd

    from verl_oar.rewards.math_reward import compute_score

    paths = ar.write(tmp_path, ar.TaskSpec(kind="word1"))
    frame = pd.read_parquet(paths["test"])
    row = frame.iloc[0]
    assert row["data_source"] == ar.DATA_SOURCE and list(row["prompt"])[0]["role"] == "user"
    content = list(row["prompt"])[0]["content"]
    assert content.startswith(ar.INSTRUCTION) and "Example solution" in content
    assert content.endswith("Problem: " + row["extra_info"]["question"])
    answer = row["reward_model"]["ground_truth"]
    assert compute_score(row["data_source"], f"So it is \\boxed{{{answer}}}.", answer)["score"] == 1.0
    assert compute_score(row["data_source"], f"So it is \\boxed{{{int(answer) + 1}}}.", answer)["score"] == 0.0
    plain = ar.rows(ar.TaskSpec(kind="word1", example=False), "test")[0]["prompt"][0]["content"]
    assert "Example" not in plain


def test_the_label_format_asks_for_an_answer_line_the_reward_grades():
    from verl_oar.rewards.math_reward import compute_score

    text = ar.prompt_text("What is 2 + 2?", True, answer="label")
    assert "Answer: <number>" in text and "\\boxed" not in text and text.endswith("Problem: What is 2 + 2?")
    assert compute_score("x", "2 and 2 make 4.\nAnswer: 4", "4")["score"] == 1.0
    with pytest.raises(ValueError, match="answer must be 'boxed' or 'label'"):
        ar.prompt_text("What is 2 + 2?", True, answer="latex")


def test_the_docs_quote_the_committed_start_statistics():
    """docs/real-model.md's design table is what ``real_task_start.py --table`` renders from the committed results."""
    import json
    from pathlib import Path

    from _benchmarks import load_benchmark

    root = Path(__file__).resolve().parents[2]
    results = json.loads((root / "benchmarks" / "results_real_task_start_cpu.json").read_text())
    table = load_benchmark("real_task_start").table(results)
    assert table in (root / "docs" / "real-model.md").read_text()
    chosen = [d for d in results["designs"] if d["kind"] == "sum1" and d["example"] and not d["brief"]
              and d.get("answer", "boxed") == "boxed"]
    assert len(chosen) == 1 and 0.10 <= chosen[0]["pass_at_1"] <= 0.5  # the task the runs train on, in range
