"""One rank's error must not hang the others: a check of one rank's rows that fails in verl-oar's importance pass
stops the pass on every rank with the original message (``engines.rank_errors``), on two gloo ranks of verl's real
FSDP2 engine (tests/engine/engine_rank_error_check.py; a rank that never finishes a case counts as hung after
90 s, as it would hang under NCCL), and on one rank the original exception is raised unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
LIMIT_S = 60.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_errors")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "engine_rank_error_check.py"), str(out)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "VERL_PLATFORM": "cpu"},
                          cwd=HERE, check=False)
    lines = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, (proc.stdout[-3000:], proc.stderr[-5000:])
    result = lines[0]
    assert result["hung"] is None and result["crashed"] is None, result
    return [result["ranks"][str(r)] for r in range(2)]


def _stopped_on_both_ranks_with(ranks, case: str, original: str) -> None:
    for rank, cases in enumerate(ranks):
        outcome = cases[case]
        assert "error" in outcome, (rank, outcome)
        assert outcome["error"].startswith("RuntimeError: verl-oar's importance pass stopped on every rank"), outcome
        assert "rank 1: " in outcome["error"] and "rank 0" not in outcome["error"], outcome
        assert original in outcome["error"], (rank, outcome)
        assert outcome["seconds"] < LIMIT_S, (rank, outcome)


def test_an_answer_locator_failing_on_one_ranks_rows_stops_every_rank_with_its_message(ranks):
    _stopped_on_both_ranks_with(ranks, "locator", "ValueError: this locator cannot read 'Ten minus four'")


def test_an_outcome_head_check_failing_on_one_ranks_rows_stops_every_rank_with_its_message(ranks):
    _stopped_on_both_ranks_with(ranks, "check", "RuntimeError: OAR-G's outcome logits (lm_head of the final hidden "
                                "states) differ from FSDPQwen2ForCausalLM's own logits by up to")
    assert all("post-processes its logits" in r["check"]["error"] for r in ranks), ranks


def test_the_ranks_still_meet_in_the_next_pass(ranks):
    for rank, cases in enumerate(ranks):
        assert cases["in_step"].get("ok") is True and cases["in_step"]["seconds"] < LIMIT_S, (rank, cases)


def test_on_one_rank_the_original_exception_is_raised_where_it_was():
    from verl_oar.engines.rank_errors import RankErrors, raised_on_every_rank

    original = ValueError("the rank's own message")
    with pytest.raises(ValueError) as raised, raised_on_every_rank():
        raise original
    assert raised.value is original

    def check():
        raise original

    errors = RankErrors()
    with pytest.raises(ValueError) as raised:
        errors.deferred(check)()  # not deferred: nothing waits for this rank
    assert raised.value is original and errors.error is None
    errors.agree()  # nothing recorded: no error
