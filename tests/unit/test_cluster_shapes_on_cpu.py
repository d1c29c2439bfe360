"""What a cluster run meets that a single-turn CPU run does not, checked without Ray: agent-loop
sessions with several outputs (grouped like verl's v1 GRPO), verl's synthetic padding rows (kept out
of every ``oar/*`` metric), the stop when most answers cannot be located, worker classes that are
not verl's (refused at start-up), and the reward's graded answer span (OAR grounds on it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl_oar.cpu.workspace import build_tokenizer
from verl_oar.engines.inputs import ANSWER_SPAN, add_outcome_masks
from verl_oar.integration.estimators import compute_oar_g_advantage
from verl_oar.integration.fallback_guard import NoAnswerError, NoAnswerGuard
from verl_oar.integration.signals import TokenSignals, provide
from verl_oar.integration.signals import real_rows, session_final_rows


def _nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


# --- agent-loop sessions -------------------------------------------------------------------------


def test_session_final_rows_read_verls_keys():
    keys = ["u1_0_0", "u1_0_1", "u1_1_0", "u2_0_0", "u2_0_2", "u2_0_1", "pad3f_0_0"]
    assert session_final_rows(keys).tolist() == [1, 1, 2, 4, 4, 4, 6]
    assert session_final_rows(["a_0_0", "a_1_0", "b_0_0"]) is None            # one output per session
    assert session_final_rows(["my_uid_with_underscores_3_0"]) is None
    with pytest.raises(RuntimeError, match="not of verl's form"):
        session_final_rows(["nounderscore"])


def test_base_advantage_groups_sessions_by_their_final_output_like_verls_v1_grpo():
    """With every weight 1 (no answer located), OAR's advantages are verl's own v1 GRPO advantages for
    a batch whose sessions return several outputs (``compute_advantage_for_multi_trajectories``)."""
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    keys = ["a_0_0", "a_0_1", "a_1_0", "a_2_0", "a_2_1", "a_2_2", "b_0_0", "b_1_0", "b_1_1"]
    uid = [k.split("_")[0] for k in keys]
    bs, length = len(keys), 5
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(bs, length)
    mask[1, 3:] = 0
    mask[4, 1:2] = 0                                                    # a hole (a tool output)
    rewards = torch.zeros(bs, length)
    rewards[torch.arange(bs), mask.cumsum(1).argmax(1)] = torch.rand(bs, generator=g).round()
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": mask.clone()},
                               non_tensors={"uid": np.array(uid, dtype=object)})
    want = compute_advantage_for_multi_trajectories(data, keys, "grpo", num_repeat=1).batch["advantages"]
    zeros = torch.zeros(bs, length, dtype=torch.long)
    signals = TokenSignals(tensors={"oar_importance": torch.rand(bs, length, generator=g), "oar_reasoning_mask": zeros,
                                    "oar_answer_mask": zeros}, session_final=session_final_rows(keys))
    with provide(signals):
        got, _ = compute_oar_g_advantage(token_level_rewards=rewards, response_mask=mask,
                                         index=np.array(uid, dtype=object), config={})
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want)


# --- verl's synthetic padding rows ---------------------------------------------------------------


def test_padding_rows_do_not_count_in_any_metric():
    """verl appends rows with an empty response (tag ``is_padding``) to make the batch divisible; they
    have no answer, and would otherwise count as no-answer fallbacks."""
    length = 6
    real = torch.rand(4, length, generator=torch.Generator().manual_seed(1))
    reasoning = torch.zeros(4, length, dtype=torch.long)
    reasoning[:, :4] = 1
    answer = torch.zeros(4, length, dtype=torch.long)
    answer[:, 4] = 1
    rewards = torch.zeros(4, length)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    index = np.array(["g"] * 4, dtype=object)

    def run(importance, reasoning, answer, rewards, mask, index, rows=None):
        signals = TokenSignals(tensors={"oar_importance": importance, "oar_reasoning_mask": reasoning,
                                        "oar_answer_mask": answer}, real_rows=rows)
        with provide(signals):
            adv, _ = compute_oar_g_advantage(token_level_rewards=rewards, response_mask=mask, index=index, config={})
        return adv, signals.metrics

    want_adv, want = run(real, reasoning, answer, rewards, torch.ones(4, length), index)
    pad = lambda t, fill=0: torch.cat([t, torch.full((2, *t.shape[1:]), fill, dtype=t.dtype)])  # noqa: E731
    tags = [{}] * 4 + [{"is_padding": True}] * 2
    got_adv, got = run(pad(real), pad(reasoning), pad(answer), pad(rewards), pad(torch.ones(4, length)),
                       np.array(["g"] * 4 + ["pad"] * 2, dtype=object), rows=real_rows(tags))
    assert got == want and got["fallback/frac_no_answer"] == 0.0
    torch.testing.assert_close(got_adv[:4], want_adv)
    assert (got_adv[4:] == 0).all()
    assert real_rows([{}, {"is_padding": False}]) is None


# --- the no-answer stop --------------------------------------------------------------------------


def _streak(n: int, steps: int) -> dict[str, float]:
    return {"oar/fallback/no_answer_streak": float(n), "oar/fallback/no_answer_steps": float(steps)}


def test_no_answer_guard_stops_after_patience_consecutive_steps_above_the_stop_rate():
    guard = NoAnswerGuard(max_frac=0.5, patience=3, stop_frac=0.5)
    assert guard.observe(1, {"fallback/frac_no_answer": 0.9}) == _streak(1, 1)
    guard.observe(2, {"fallback/frac_no_answer": 0.8})
    guard.observe(3, {"fallback/frac_no_answer": 0.5})                # not above: the streak restarts
    guard.observe(4, {"fallback/frac_no_answer": 0.6})
    guard.observe(5, {"fallback/frac_no_answer": 0.7})
    with pytest.raises(NoAnswerError, match=r"3 consecutive steps \(4-6\).*data.max_response_length.*"
                                            r"answer_locator.*no_answer_action=warn"):
        guard.observe(6, {"fallback/frac_no_answer": 1.0})


def test_a_later_drop_in_answers_warns_and_is_counted_and_stops_only_past_the_stop_rate(capsys):
    """The default config's guard: a policy that writes fewer answers mid-run (60-85% without one) keeps training,
    each such step warned about and counted; past no_answer_stop_frac (0.9) for 3 steps it stops."""
    from _verl_config import compose_ppo_config

    guard = NoAnswerGuard.from_config(compose_ppo_config(["algorithm.adv_estimator=oar_g"]))
    assert (guard.warmup, guard.patience, guard.max_frac, guard.stop_frac, guard.first_steps) == (10, 3, 0.5, 0.9, 3)
    for step in range(1, 11):
        guard.observe(step, {"fallback/frac_no_answer": 0.2})
    for step, frac in zip(range(11, 21), (0.6, 0.85, 0.7, 0.95, 0.8, 0.6, 0.85, 0.7, 0.4, 0.9)):
        out = guard.observe(step, {"fallback/frac_no_answer": frac})
    assert out == _streak(0, 9)  # nine steps above 0.5, one above 0.9: no stop
    err = capsys.readouterr().err
    assert err.count("WARNING: step") == 9 and "step 12: 85% of the responses had no locatable" in err
    guard.observe(21, {"fallback/frac_no_answer": 0.95})
    guard.observe(22, {"fallback/frac_no_answer": 1.0})
    with pytest.raises(NoAnswerError, match=r"3 consecutive steps \(21-23\) more than 90%.*no_answer_stop_frac"):
        guard.observe(23, {"fallback/frac_no_answer": 0.92})


def test_a_locator_that_finds_no_answer_in_the_first_steps_stops_the_run_whatever_the_action():
    from _verl_config import compose_ppo_config

    config = compose_ppo_config(["algorithm.adv_estimator=oar_g", "+algorithm.oar.no_answer_action=warn"])
    guard = NoAnswerGuard.from_config(config)
    guard.observe(1, {"fallback/frac_no_answer": 1.0})
    guard.observe(2, {"fallback/frac_no_answer": 1.0})
    with pytest.raises(NoAnswerError, match=r"no response of the run's first 3 training steps had a locatable final "
                                            r"answer.*answer_locator=pkg://.*no_answer_first_steps=0"):
        guard.observe(3, {"fallback/frac_no_answer": 1.0})
    # one located answer in the first steps passes the check for good; a base model's answerless warm-up does not stop
    guard = NoAnswerGuard.from_config(config)
    for step, frac in ((1, 1.0), (2, 0.97), (3, 1.0), (4, 1.0), (5, 1.0)):
        assert guard.observe(step, {"fallback/frac_no_answer": frac}) == _streak(0, 0)
    off = NoAnswerGuard.from_config(compose_ppo_config(["algorithm.adv_estimator=oar_g",
                                                        "+algorithm.oar.no_answer_first_steps=0"]))
    for step in (1, 2, 3, 4):
        off.observe(step, {"fallback/frac_no_answer": 1.0})
    # a run resumed past the first steps does not repeat the check
    resumed = NoAnswerGuard.from_config(compose_ppo_config(["algorithm.adv_estimator=oar_g"]))
    for step in (4, 5, 6):
        resumed.observe(step, {"fallback/frac_no_answer": 1.0})


def test_no_answer_guard_ignores_the_warm_up_steps_a_base_model_needs():
    """The default config's guard: a run whose first 10 steps mostly lack an answer (a base model learning
    the format) is not stopped; the same fractions after the warm-up are."""
    from _verl_config import compose_ppo_config

    guard = NoAnswerGuard.from_config(compose_ppo_config(["algorithm.adv_estimator=oar_g"]))
    assert (guard.warmup, guard.patience) == (10, 3)
    for step in range(1, 11):
        assert guard.observe(step, {"fallback/frac_no_answer": 0.95}) == _streak(0, 0)
    guard.observe(11, {"fallback/frac_no_answer": 0.95})
    guard.observe(12, {"fallback/frac_no_answer": 0.95})
    with pytest.raises(NoAnswerError, match=r"\(11-13\).*no_answer_warmup"):
        guard.observe(13, {"fallback/frac_no_answer": 0.95})
    with pytest.raises(ValueError, match="no_answer_warmup=-1 is invalid"):
        NoAnswerGuard.from_config(compose_ppo_config(["algorithm.adv_estimator=oar_g", "+algorithm.oar.no_answer_warmup=-1"]))


def test_no_answer_guard_warns_instead_when_asked(capsys):
    from _verl_config import compose_ppo_config

    config = compose_ppo_config(["algorithm.adv_estimator=oar_g", "+algorithm.oar.no_answer_action=warn",
                                 "+algorithm.oar.no_answer_patience=1"])
    guard = NoAnswerGuard.from_config(config)
    assert guard.observe(17, {"fallback/frac_no_answer": 0.95}) == _streak(1, 1)  # after the warm-up
    assert "GRPO under another name" in capsys.readouterr().err


def test_the_testbed_runs_keep_the_stop_rule_the_study_ran_under():
    from verl_oar.testbed.methods import NO_ANSWER_STOP, METHODS

    seed, neutral = 0, 32
    for name in ("oar_g", "oar_p", "oar_g_codapo"):
        assert NO_ANSWER_STOP in METHODS[name].algorithm(seed, neutral, None), name
    assert NO_ANSWER_STOP == "+algorithm.oar.no_answer_stop_frac=0.5"


@pytest.mark.parametrize(
    "key, value, match",
    [("no_answer_max_frac", 1.5, "a fraction in"), ("no_answer_patience", 0, "an integer >= 1"),
     ("no_answer_stop_frac", -0.1, "a fraction in"), ("no_answer_stop_frac", 0.4, "below no_answer_max_frac=0.5"),
     ("no_answer_first_steps", -1, "0: no start-up check"),
     ("no_answer_action", "ignore", "'error' .stop the run. or 'warn'"), ("answer_locator", 3, "pkg://module.function")],
)
def test_no_answer_and_locator_keys_are_validated(key, value, match):
    from verl_oar.core.config import OARConfig

    with pytest.raises(ValueError, match=match):
        OARConfig(**{key: value})


def test_a_locator_that_cannot_load_is_refused_at_startup():
    from _verl_config import compose_ppo_config

    from verl_oar.integration.trainer import check_token_signals_supported

    config = compose_ppo_config(["algorithm.adv_estimator=oar_g", "actor_rollout_ref.actor.strategy=fsdp2",
                                 "+algorithm.oar.answer_locator=pkg://no_such_module_xyz.locate"])
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        check_token_signals_supported(config, "sync")


# --- worker classes ------------------------------------------------------------------------------


def test_worker_classes_are_checked_at_startup():
    import ray
    from verl.trainer.ppo.utils import Role
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from verl_oar.integration.worker import OARActorRolloutRefWorker, OARWorkerMixin, with_oar_worker

    class MyWorker(ActorRolloutRefWorker):
        pass

    class MyOARWorker(OARWorkerMixin, MyWorker):
        pass

    mapping = {Role.ActorRollout: ray.remote(ActorRolloutRefWorker), Role.RefPolicy: ray.remote(MyWorker)}
    with_oar_worker(mapping, "oar_g")                                 # the ref does not score importance here
    assert mapping[Role.ActorRollout].__ray_actor_class__ is OARActorRolloutRefWorker
    assert mapping[Role.RefPolicy].__ray_actor_class__ is MyWorker
    with pytest.raises(ValueError, match=r"RefPolicy worker is .*MyWorker.*class MyWorker\(OARWorkerMixin"):
        with_oar_worker(dict(mapping), "oar_g", ref_scores=True)
    mine = {Role.ActorRollout: ray.remote(MyOARWorker)}
    with_oar_worker(mine, "oar_p")
    assert mine[Role.ActorRollout].__ray_actor_class__ is MyOARWorker
    with pytest.raises(ValueError, match="ActorRollout worker is .*MyWorker.*OARWorkerMixin"):
        with_oar_worker({Role.ActorRollout: ray.remote(MyWorker)}, "oar_g")


def test_a_mixed_in_worker_exposes_the_registered_methods():
    from verl.single_controller.base.decorator import MAGIC_ATTR

    from verl_oar.integration.worker import OARActorRolloutRefWorker

    for name in ("compute_log_prob", "compute_token_importance", "compute_ref_token_importance"):
        assert hasattr(getattr(OARActorRolloutRefWorker, name), MAGIC_ATTR), name


# --- the reward's answer span ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_outcome_masks_ground_on_the_rewards_span_and_count_where_each_answer_came_from(tokenizer):
    from verl_oar.core.answer_span import find_answer_span
    from verl_oar.engines.inputs import SOURCE_LOCATOR, SOURCE_NONE, SOURCE_REWARD, SOURCE_REWARD_REJECTED

    enc = tokenizer.encode
    texts = ["So 3 + 4 = 7. The answer is 7", "Two numbers: 12 and 5. So \\boxed{17}", "I give up",
             "Sum: 9 then 10 so \\boxed{10}"]
    responses = [torch.tensor(enc(t) + [tokenizer.eos_token_id]) for t in texts]
    prompts = [torch.tensor(enc("Q?"))] * len(texts)
    data = TensorDict({"prompts": _nested(prompts), "responses": _nested(responses),
                       "response_mask": _nested([torch.ones_like(r) for r in responses])}, batch_size=[4])
    # row 0: the reward graded "3 + 4" (not what the locator would pick); row 1: none given (locator);
    # row 2: no answer; row 3: a span past the end of the text (rejected: the locator is used)
    m0 = texts[0].index("3 + 4")
    data[ANSWER_SPAN] = torch.tensor([[m0, m0, m0 + 5], [-1, -1, -1], [-1, -1, -1], [0, 500, 502]])
    reasoning, answer, source = add_outcome_masks(data, tokenizer)
    assert source.tolist() == [SOURCE_REWARD, SOURCE_LOCATOR, SOURCE_NONE, SOURCE_REWARD_REJECTED]
    decode = lambda row: tokenizer.decode(responses[row][answer[row, : len(responses[row])].bool()])  # noqa: E731
    assert decode(0).strip() == "3 + 4" and decode(1) == "17" and decode(3) == "10"
    assert tokenizer.decode(responses[0][reasoning[0, : len(responses[0])].bool()]) == "So "
    span = find_answer_span(texts[3])
    assert texts[3][span.start:span.end] == "10"


def test_a_multi_turn_responses_tool_tokens_are_context_not_reasoning(tokenizer):
    """response_mask 0 marks tokens the model did not generate (tool outputs): the answer is located
    in the whole response text, as verl's reward decodes it, but only the model's tokens are reasoning."""
    enc = tokenizer.encode
    model_part, tool_part, final = enc("I will add 3 and 4. "), enc("[tool: 7] "), enc("So \\boxed{7}")
    response = torch.tensor(model_part + tool_part + final)
    mask = torch.tensor([1] * len(model_part) + [0] * len(tool_part) + [1] * len(final))
    data = TensorDict({"prompts": _nested([torch.tensor(enc("Q?"))]), "responses": _nested([response]),
                       "response_mask": _nested([mask])}, batch_size=[1])
    reasoning, answer, source = add_outcome_masks(data, tokenizer)
    assert source.tolist() == [1]
    assert (reasoning[0].bool() & ~mask.bool()).sum() == 0                     # no tool token is reasoning
    assert reasoning[0].sum() == len(model_part) + len(enc("So "))
    assert tokenizer.decode(response[answer[0].bool()]) == "7"


def test_group_ids_give_each_padding_row_a_group_of_its_own_for_every_estimator():
    """core.groups.group_ids is the one grouping (OPPO's prior, CoDaPO's accuracy, CoDaSampling's values): real rows
    by uid in order of first appearance, each of verl's synthetic padding rows alone, whatever uid it carries."""
    from verl_oar.core.groups import group_ids

    index = ["a", "b", "a", "pad", "pad", "b"]
    assert group_ids(index).tolist() == [0, 1, 0, 2, 2, 1]
    real = torch.tensor([True, True, True, False, False, True])
    assert group_ids(index, real).tolist() == [0, 1, 0, 2, 3, 1]
    assert group_ids(["a", "a"], torch.tensor([True, False])).tolist() == [0, 1]  # a padding row copying a real uid
