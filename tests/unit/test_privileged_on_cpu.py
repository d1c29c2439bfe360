"""Privileged prompts (verl_oar.core.privileged_prompt) and the cscr / oppo estimators as verl calls
them (verl_oar.integration.privileged_estimators): registry entries, signals in, formulas out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_oar.core.privileged_prompt import OPPO_ORACLE, check_template, ground_truth, rewrite_messages


def test_rewrite_keeps_system_and_earlier_turns_and_fills_placeholders_once():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "what is {answer}? \\boxed{}"}]
    out = rewrite_messages(messages, OPPO_ORACLE, "42")
    assert out[:3] == messages[:3] and messages[3]["content"] == "what is {answer}? \\boxed{}"  # input untouched
    # the question's own "{answer}" text is not a placeholder: filled in one pass
    assert out[3] == {"role": "user", "content": "what is {answer}? \\boxed{}\n\nThe correct final answer is: 42."}
    assert rewrite_messages(messages, "{question}")[3] == messages[3]  # identity template


def test_bad_templates_rows_and_ground_truth_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="containing {question}"):
        check_template("The answer is {answer}", "algorithm.oppo.template")
    with pytest.raises(ValueError, match="has no {answer}"):
        check_template("{question} think again", "algorithm.oppo.template", needs_answer=True)
    with pytest.raises(ValueError, match="no user message"):
        rewrite_messages([{"role": "system", "content": "x"}], "{question}")
    with pytest.raises(ValueError, match="multimodal"):
        rewrite_messages([{"role": "user", "content": [{"type": "image"}]}], "{question}")
    assert ground_truth({"style": "rule", "ground_truth": 7}) == "7"
    assert ground_truth({"ground_truth": ["1/2", "0.5"]}) == "1/2"
    with pytest.raises(ValueError, match="ground_truth"):
        ground_truth({"style": "rule"})


def _batch(seed=0, groups=2, n=4, t=6):
    g = torch.Generator().manual_seed(seed)
    bs = groups * n
    lengths = torch.randint(2, t + 1, (bs,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    rewards = torch.zeros(bs, t)
    score = (torch.rand(bs, generator=g) < 0.5).float()
    score[0], score[1] = 1.0, 0.0  # group 0 has both outcomes
    rewards[torch.arange(bs), lengths - 1] = score
    index = np.array([f"u{i // n}" for i in range(bs)], dtype=object)
    return rewards, mask, index, g


def test_cscr_estimator_is_grpo_reallocated_by_the_shifts():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.cscr import CSCRConfig, cscr_advantages
    from verl_oar.integration import privileged_estimators  # noqa: F401
    from verl_oar.integration.estimators import grpo_advantage
    from verl_oar.integration.signals import TokenSignals, provide

    rewards, mask, index, g = _batch()
    pos, neg = torch.randn(mask.shape, generator=g) * mask, torch.randn(mask.shape, generator=g) * mask
    scored = torch.ones_like(mask, dtype=torch.long)
    scored[5] = 0  # a skipped row keeps GRPO's credit
    config = {"cscr": {"alpha": 2.0}}
    signals = TokenSignals(tensors={"cscr_pos_shift": pos, "cscr_neg_shift": neg, "cscr_scored": scored})
    with provide(signals):
        adv, returns = get_adv_estimator_fn("cscr")(rewards, mask, index, config=config)
    grpo = grpo_advantage(rewards, mask, index, 1e-6, True)
    keep = torch.ones(len(mask), dtype=torch.bool)
    keep[5] = False
    expected = cscr_advantages(grpo[:, 0], pos, neg, mask * keep[:, None], CSCRConfig(alpha=2.0)).advantages
    torch.testing.assert_close(adv[keep], expected[keep])
    torch.testing.assert_close(adv[5], grpo[5])
    assert torch.equal(adv, returns)
    torch.testing.assert_close(adv.sum(1), grpo.sum(1), atol=1e-5, rtol=1e-5)  # the credit budget
    assert signals.metrics["cscr/sign_violations"] == 0 and signals.metrics["cscr/frac_rows_scored"] == 7 / 8


def test_oppo_estimator_is_the_value_recursion_over_the_evidence():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.oppo import OPPOConfig, group_ids, oppo_advantages
    from verl_oar.integration import privileged_estimators  # noqa: F401
    from verl_oar.integration.signals import TokenSignals, provide

    rewards, mask, index, g = _batch(1)
    evidence = torch.randn(mask.shape, generator=g) * mask
    signals = TokenSignals(tensors={"oppo_evidence": evidence, "oppo_scored": torch.ones_like(mask, dtype=torch.long)})
    with provide(signals):
        adv, _ = get_adv_estimator_fn("oppo")(rewards, mask, index, config={"oppo": {"form": "first_order"}})
    expected = oppo_advantages(evidence, rewards.sum(1), group_ids(list(index)), mask.bool(),
                               OPPOConfig(form="first_order")).advantages
    torch.testing.assert_close(adv, expected)
    assert signals.metrics["oppo/sign_violations"] == 0
    # w~ (dumps, heatmaps): A_t * T / (R - V_0) per row, 0 where R = V_0
    prior = signals.artifacts["values"][:, 0].double()
    for row in range(len(mask)):
        gap, length = float(rewards[row].sum() - prior[row]), float(mask[row].sum())
        want = adv[row] * length / gap if abs(gap) > 1e-6 else torch.zeros_like(adv[row])
        torch.testing.assert_close(signals.artifacts["weights"][row], want.float(), atol=1e-5, rtol=1e-5)
    with provide(TokenSignals(tensors={"oppo_evidence": evidence, "oppo_scored": torch.ones_like(mask, dtype=torch.long)})):
        with pytest.raises(ValueError, match="Valid keys"):
            get_adv_estimator_fn("oppo")(rewards, mask, index, config={"oppo": {"forms": "exact"}})


@pytest.mark.parametrize("estimator, extra, needle", [
    ("cscr", ["+algorithm.cscr.alpah=0.5"], "Valid keys: alpha"),
    ("cscr", ["+algorithm.cscr.pos_template='no placeholder'"], "containing {question}"),
    ("oppo", ["+algorithm.oppo.template='{question} think again'"], "has no {answer}"),
    ("oppo", ["actor_rollout_ref.model.use_fused_kernels=True"], "use_fused_kernels=False"),
])
def test_bad_configurations_stop_the_run_at_start_up_with_the_fix(estimator, extra, needle):
    from _verl_config import compose_ppo_config

    from verl_oar.cpu.overrides import cpu_overrides
    from verl_oar.integration import privileged_estimators  # noqa: F401
    from verl_oar.integration.validate import check_token_signals_supported

    config = compose_ppo_config(cpu_overrides("/ws", adv_estimator=estimator) + extra)
    with pytest.raises(ValueError, match=needle):
        check_token_signals_supported(config, "sync")
    good = compose_ppo_config(cpu_overrides("/ws", adv_estimator=estimator))
    assert [p.name for p in check_token_signals_supported(good, "sync")] == [
        {"cscr": "cscr_shifts", "oppo": "oppo_evidence"}[estimator]]


# --- the pass's rows (integration.privileged_signal.privileged_rows), on a character "tokenizer" ---------------


def _chars(messages) -> list[int]:
    """A stand-in for verl's token builder: one id per character of 'role:content|' per message."""
    return [ord(c) for m in messages for c in f"{m['role']}:{m['content']}|"]


def _rows(templates, responses, *, limit=float("inf"), overflow="truncate", padding=None, answers=None, questions=None):
    from verl_oar.integration.privileged_signal import RescoreStats, privileged_rows

    n = len(responses)
    messages = [[{"role": "user", "content": (questions or [f"q{i}" for i in range(n)])[i]}] for i in range(n)]
    prompts = [torch.tensor(_chars(m)) for m in messages]
    responses = [torch.tensor(r, dtype=torch.long) for r in responses]
    stats = RescoreStats()
    built = privileged_rows(templates, [f"k{i}" for i in range(n)], messages, prompts, responses,
                            [torch.ones_like(r) for r in responses], answers or ["7"] * n, padding or [False] * n,
                            _chars, limit, overflow, stats)
    return built, stats, prompts


def test_rows_are_template_major_with_the_rewritten_prompt_then_the_response():
    built, stats, prompts = _rows(["{question}", "{question} A={answer}"], [[1, 2, 3], [4]], answers=["7", "8"])
    assert built.keys == ["t0/k0", "t0/k1", "t1/k0", "t1/k1"] and built.scored == [True] * 4
    assert torch.equal(built.rows[0]["prompts"], prompts[0])                     # identity: the rollout's prompt
    assert bytes(built.rows[3]["prompts"].tolist()).decode() == "user:q1 A=8|"   # the answer filled in
    for row in built.rows:
        assert torch.equal(row["input_ids"], torch.cat([row["prompts"], row["responses"]]))
        assert torch.equal(row["position_ids"], torch.arange(len(row["input_ids"])))
    assert [t["seq_len"] for t in built.tags] == [len(r["input_ids"]) for r in built.rows]
    assert stats.rows == 4 and stats.prompt_tokens_added == [0, 0, 4, 4] and stats.truncated == stats.skipped == 0


def test_rows_past_the_context_get_their_question_shortened_from_the_middle_or_are_skipped_and_counted():
    questions = ["abcdefghij" * 4, "0123456789" * 4]
    built, stats, _ = _rows(["{question} A"], [[1, 2, 3], [4, 5]], limit=20, questions=questions)
    assert [len(r["input_ids"]) for r in built.rows] == [20, 20] and built.scored == [True, True]
    # "user:" + question + " A|": the question keeps its two ends around " [...] ", the template and header stay
    assert bytes(built.rows[0]["prompts"].tolist()).decode() == "user:a [...] j A|"
    assert bytes(built.rows[1]["prompts"].tolist()).decode() == "user:01 [...] 9 A|"
    assert stats.truncated == 2 and stats.skipped == 0
    built, stats, prompts = _rows(["{question} A"], [[1, 2, 3], [4, 5]], limit=20, overflow="skip", questions=questions)
    assert built.scored == [False, False] and stats.skipped == 2 and stats.truncated == 0
    assert torch.equal(built.rows[1]["prompts"], prompts[1])  # scored on the rollout prompt, its result unused
    long = "{question} " + "x" * 40  # the template alone overflows: not even an empty question fits
    built, stats, _ = _rows([long], [[1, 2, 3]], limit=20)
    assert built.scored == [False] and stats.skipped == 1 and stats.truncated == 0
    built, stats, _ = _rows([long], [list(range(1, 25))], limit=20)  # the response alone fills the context
    assert built.scored == [False] and stats.skipped == 1


def test_padding_rows_keep_their_prompt_and_an_empty_response_is_a_row_of_its_own():
    built, stats, prompts = _rows(["{question} {answer}"], [[], [9]], padding=[False, True], answers=["5", None])
    assert len(built.rows[0]["responses"]) == 0 and len(built.rows[0]["input_ids"]) == len(built.rows[0]["prompts"])
    assert torch.equal(built.rows[1]["prompts"], prompts[1]) and built.tags[1]["is_padding"]
    assert stats.prompt_tokens_added == [2]  # padding rows are not rewritten, nor counted


# --- OPPO's teacher oracle: keys and start-up refusals (integration.teacher.check_teacher) ---------------------


def test_teacher_keys_are_checked():
    from verl_oar.core.oppo import OPPOConfig

    cfg = OPPOConfig.from_algorithm({"oppo": {"oracle": "teacher", "teacher": {"path": "/models/t"}}})
    assert cfg.teacher_path == "/models/t" and OPPOConfig().teacher_path is None
    for node, needle in (({"oracle": "teacher"}, "needs the teacher model"), ({"teacher": {"path": "t"}}, "oracle=self ignores it"),
                         ({"oracle": "teacher", "teacher": {"path": "t", "tp": 2}}, "Valid keys: path"),
                         ({"oracle": "tutor"}, "one of \\('self', 'teacher'\\)")):
        with pytest.raises(ValueError, match=needle):
            OPPOConfig.from_algorithm({"oppo": node})


def _save_teacher(root, tokenizer, vocab_size=None):
    from transformers import Qwen2Config

    root.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(root)
    Qwen2Config(vocab_size=vocab_size or len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=96).save_pretrained(root)
    return root


def test_a_teacher_that_cannot_score_the_actors_ids_stops_the_run_at_start_up(tmp_path):
    from _verl_config import compose_ppo_config

    from verl_oar.cpu.overrides import cpu_overrides
    from verl_oar.cpu.workspace import build_tokenizer
    from verl_oar.integration import privileged_estimators  # noqa: F401
    from verl_oar.integration.validate import check_token_signals_supported

    ws = tmp_path / "ws"
    build_tokenizer().save_pretrained(ws / "model")
    good = _save_teacher(tmp_path / "good", build_tokenizer())
    extra = build_tokenizer()
    extra.add_tokens(["<extra_token>"])
    other_eos = build_tokenizer()
    other_eos.eos_token = other_eos.pad_token
    cases = [
        (_save_teacher(tmp_path / "vocab", extra), [], "vocabulary differs"),
        (_save_teacher(tmp_path / "small", build_tokenizer(), vocab_size=8), [], "embedding has 8 rows"),
        (tmp_path / "missing", [], "cannot load its tokenizer and config"),
        (good, ["actor_rollout_ref.actor.strategy=megatron"], "not supported for it yet"),
    ]
    for path, extra_overrides, needle in cases:
        config = compose_ppo_config(cpu_overrides(str(ws), adv_estimator="oppo") + extra_overrides + [
            "+algorithm.oppo.oracle=teacher", f"+algorithm.oppo.teacher.path={path}"])
        with pytest.raises(ValueError, match=needle):
            check_token_signals_supported(config, "sync")
    # another eos (an Instruct teacher of a base actor) is fine: the teacher only scores given ids
    check_token_signals_supported(compose_ppo_config(cpu_overrides(str(ws), adv_estimator="oppo") + [
        "+algorithm.oppo.oracle=teacher", f"+algorithm.oppo.teacher.path={_save_teacher(tmp_path / 'eos', other_eos)}"]), "sync")
    config = compose_ppo_config(cpu_overrides(str(ws), adv_estimator="oppo") + [
        "+algorithm.oppo.oracle=teacher", f"+algorithm.oppo.teacher.path={good}"])
    (provider,) = check_token_signals_supported(config, "sync")
    provider.attach(config)  # what the trainer does before verl builds the workers
    assert config.actor_rollout_ref.oar_teacher.path == str(good)
