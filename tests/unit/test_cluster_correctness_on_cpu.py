"""Configurations in which a cluster run would silently train the wrong thing or stop mid-run: each is either
made right or refused at start-up naming the cause and the fix (KL in the reward, the reward's range, OPPO's
degenerate key pair, rollout-correction bypass mode, rows the privileged pass cannot score, privileged prompts
past the context, CoDaSampling beside DAPO's group filter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _verl_config import compose_ppo_config

from verl_oar.cpu.overrides import cpu_overrides
from verl_oar.integration import codapo_estimator, privileged_estimators  # noqa: F401  (register codapo, cscr, oppo)


def _batch(seed=0, groups=3, n=4, t=6):
    """(rm_scores (bs, t) with a 0/1 score on each row's last token, response mask, uid per row, generator)."""
    g = torch.Generator().manual_seed(seed)
    bs = groups * n
    lengths = torch.randint(2, t + 1, (bs,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    scores = torch.zeros(bs, t)
    score = (torch.rand(bs, generator=g) < 0.5).float()
    score[0], score[1] = 1.0, 0.0
    scores[torch.arange(bs), lengths - 1] = score
    index = np.array([f"u{i // n}" for i in range(bs)], dtype=object)
    return scores, mask, index, g


def _startup(estimator, *overrides):
    from verl_oar.integration.validate import check_token_signals_supported

    return check_token_signals_supported(compose_ppo_config(cpu_overrides("/ws", adv_estimator=estimator) + list(overrides)),
                                         "sync")


# --- 2. KL in the reward: CoDaPO reads the verifier's score, OPPO refuses -----------------------------------------


def _kl_folded(scores, mask, g, coef=0.05):
    """token_level_rewards as verl's v1 trainer builds them with algorithm.use_kl_in_reward=true (apply_kl_penalty)."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import FixedKLController
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty

    old = -torch.rand(mask.shape, generator=g) * mask
    ref = old - 0.3 * torch.rand(mask.shape, generator=g) * mask
    data = DataProto.from_dict({"token_level_scores": scores, "old_log_probs": old, "ref_log_prob": ref,
                                "response_mask": mask})
    data, _ = apply_kl_penalty(data, FixedKLController(coef), kl_penalty="kl")
    return data.batch["token_level_rewards"], old


@pytest.mark.parametrize("compose", [False, True])
def test_codapo_value_reads_the_verifier_score_not_the_kl_folded_reward(compose):
    """With the KL penalty folded into token_level_rewards, no response sums to exactly 1.0: CoDaPO's value must come
    from rm_scores (what CoDaSampling selects on), the GRPO advantage it scales from verl's rewards (KL included)."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.codapo import question_values
    from verl_oar.core.oppo import group_ids
    from verl_oar.integration.estimators import grpo_advantage
    from verl_oar.integration.signals import TokenSignals, provide

    scores, mask, index, g = _batch(4)
    rewards, old = _kl_folded(scores, mask, g)
    assert not (rewards.sum(1) == 1.0).any()  # what the value read before: every question at weight_offset
    value, _ = question_values(scores.sum(1), old, mask, group_ids(list(index)), 0.1)
    assert (value > 0.1 + 1e-3).any()
    tensors = {"old_log_probs": old, "rm_scores": scores}
    if compose:  # CoDaPO's value on another token estimator's advantages (ACPO's)
        from verl_oar.integration import acpo_estimator  # noqa: F401

        tensors.update(acpo_surrogate=old.neg(), acpo_entropy=old.neg())
        with provide(TokenSignals(tensors=dict(tensors))):
            inner, _ = get_adv_estimator_fn("acpo")(rewards, mask, index, config={})
        signals = TokenSignals(tensors=dict(tensors))
        with provide(signals):
            adv, _ = get_adv_estimator_fn("acpo")(rewards, mask, index, config={"codapo": {"compose": True}})
        torch.testing.assert_close(adv, value[:, None].float() * inner)
    else:
        signals = TokenSignals(tensors=dict(tensors))
        with provide(signals):
            adv, _ = get_adv_estimator_fn("codapo")(rewards, mask, index, config={})
        grpo = grpo_advantage(rewards, mask, index, 1e-6, True)  # verl's GRPO of the KL-folded rewards
        torch.testing.assert_close(adv, (value[:, None] * grpo).float() * mask)
    assert signals.metrics["codapo/accuracy/mean"] > 0


def test_codapo_and_compose_fetch_the_verifier_score_with_kl_in_the_reward():
    ref = ["algorithm.use_kl_in_reward=true"]
    assert [p.name for p in _startup("codapo", *ref)] == ["old_log_probs", "verifier_scores"]
    assert [p.name for p in _startup("oar_g", *ref, "+algorithm.codapo.compose=true")] == [
        "token_importance", "old_log_probs", "verifier_scores"]


# --- 3. OPPO's reward range, refused at start-up where verl's config tells ------------------------------------


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.use_kl_in_reward=true"],
     r"use_kl_in_reward=true subtracts the KL penalty .* algorithm.use_kl_in_reward=false actor_rollout_ref.actor.use_kl_loss=true"),
    (["algorithm.use_kl_in_reward=true", "+algorithm.codapo.compose=true"], "use_kl_loss=true"),
    (["reward.reward_model.enable=true", "reward.custom_reward_function.path=null"], r"reward.reward_model.enable=true without a custom reward function .* unbounded"),
    (["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=true"],
     "overlong_buffer_cfg.enable=false"),
])
def test_oppo_refuses_rewards_that_are_not_success_probabilities_at_start_up(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        _startup("oppo", *overrides)


def test_oppo_accepts_a_reward_model_behind_a_custom_reward_function_and_checks_each_batch():
    """A custom function may map the model's score into [0, 1]: not knowable at start-up, so each batch is checked."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.integration.signals import TokenSignals, provide

    assert [p.name for p in _startup("oppo", "reward.reward_model.enable=true",
                                     "reward.custom_reward_function.path=/x/score.py")] == ["oppo_evidence"]
    scores, mask, index, g = _batch(5)
    scores[2, int(mask[2].sum()) - 1] = -1.0  # one row scored -1 (as verl's math_dapo scores a wrong answer)
    signals = TokenSignals(tensors={"oppo_evidence": torch.zeros_like(mask), "oppo_scored": torch.ones_like(mask).long()})
    with provide(signals), pytest.raises(ValueError, match=r"success probability, in \[0, 1\]; got \[-1.0\].*math_dapo"):
        get_adv_estimator_fn("oppo")(scores, mask, index, config={})


# --- 4. OPPO's degenerate key pair --------------------------------------------------------------------------------


def test_oppo_group_std_scale_without_zeroing_uniform_groups_is_refused_naming_both_keys():
    from verl_oar.core.oppo import OPPOConfig

    with pytest.raises(ValueError, match=r"scale=group_std with algorithm.oppo.zero_uniform_groups=false .*"
                                         r"zero_uniform_groups=true.*scale=none"):
        OPPOConfig.from_algorithm({"oppo": {"scale": "group_std", "zero_uniform_groups": False}})
    with pytest.raises(ValueError, match="zero_uniform_groups=false"):
        _startup("oppo", "+algorithm.oppo.scale=group_std", "+algorithm.oppo.zero_uniform_groups=false")
    OPPOConfig(scale="group_std")  # with zeroing (the default), and either key alone, are fine
    OPPOConfig(zero_uniform_groups=False)


# --- 5. a row the privileged pass could not score keeps broadcast credit of its own sequence quantity ----------


@pytest.mark.parametrize("scale", ["none", "group_std"])
def test_an_unscored_oppo_row_keeps_its_r_minus_v0_spread_evenly_and_is_counted(scale):
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.oppo import OPPOConfig, group_ids, oppo_advantages
    from verl_oar.integration.signals import TokenSignals, provide

    scores, mask, index, g = _batch(6)
    evidence = torch.randn(mask.shape, generator=g) * mask
    scored = torch.ones_like(mask, dtype=torch.long)
    skipped = [0, 1, 7]  # rows 0 and 1: both outcomes of group u0
    scored[skipped] = 0
    signals = TokenSignals(tensors={"oppo_evidence": evidence, "oppo_scored": scored})
    with provide(signals):
        adv, _ = get_adv_estimator_fn("oppo")(scores, mask, index, config={"oppo": {"scale": scale}})
    r = scores.sum(1).double()
    groups = group_ids(list(index))
    full = oppo_advantages(evidence, scores.sum(1), groups, mask, OPPOConfig(scale=scale))  # every row scored
    for row in range(len(mask)):
        mates = r[groups == groups[row]]
        if row not in skipped:  # the other rows are as if every row had been scored (the prior reads all rewards)
            torch.testing.assert_close(adv[row], full.advantages[row])
            continue
        prior = float(mates.mean().clamp(1e-3, 1 - 1e-3))
        length = float(mask[row].sum())
        std = float(mates.std()) if scale == "group_std" else None
        want = 0.0 if bool((mates == mates[0]).all()) else (float(r[row]) - prior) / length / (1 if std is None else std + 1e-6)
        torch.testing.assert_close(adv[row], (want * mask[row]).float(), atol=1e-6, rtol=1e-5)
        assert adv[row].sum().abs() > 0 or want == 0.0
    assert signals.metrics["oppo/broadcast_rows"] == 3 and signals.metrics["oppo/frac_rows_scored"] == 9 / 12
    assert signals.metrics["oppo/sign_violations"] == 0


def test_an_unscored_cscr_row_keeps_grpos_uniform_credit_and_is_counted():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.integration.estimators import grpo_advantage
    from verl_oar.integration.signals import TokenSignals, provide

    scores, mask, index, g = _batch(7)
    pos, neg = torch.randn(mask.shape, generator=g) * mask, torch.randn(mask.shape, generator=g) * mask
    scored = torch.ones_like(mask, dtype=torch.long)
    scored[[0, 5]] = 0
    signals = TokenSignals(tensors={"cscr_pos_shift": pos, "cscr_neg_shift": neg, "cscr_scored": scored})
    with provide(signals):
        adv, _ = get_adv_estimator_fn("cscr")(scores, mask, index, config={})
    grpo = grpo_advantage(scores, mask, index, 1e-6, True)
    torch.testing.assert_close(adv[[0, 5]], grpo[[0, 5]])
    assert signals.metrics["cscr/broadcast_rows"] == 2 and signals.metrics["cscr/budget_error"] < 1e-5
    torch.testing.assert_close(signals.artifacts["weights"][[0, 5]], mask[[0, 5]])


# --- the privileged pass on an in-memory TransferQueue, scored by a tiny Qwen2 (findings 1 and 6) ---------------

TEMPERATURE = 0.7
SYSTEM = "You are a careful math tutor."
QUESTIONS = ["What is 2+3?", "Tom has 3 apples and eats one. How many are left?", "What is 7*6?", "Is 9 prime?"]
ANSWERS = ["5", "2", "42", "no, since 9 = 3 x 3"]


class _Store:
    """An in-memory stand-in of TransferQueue's kv interface (put / get / clear by key and partition), holding each
    row's fields as verl's nested layout does (1-D tensors per row, python objects for non-tensor fields)."""

    def __init__(self):
        self.data: dict[str, dict[str, dict]] = {}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        part = self.data.setdefault(partition_id, {})
        for name in fields.keys():
            value = fields[name]
            rows = list(value.unbind()) if isinstance(value, torch.Tensor) else list(value)
            for key, row in zip(keys, rows, strict=True):
                part.setdefault(key, {})[name] = row

    def kv_batch_get(self, keys, partition_id, select_fields):
        part = self.data[partition_id]
        out = {}
        for name in select_fields:
            rows = [part[key][name] for key in keys]
            out[name] = torch.nested.as_nested_tensor(rows, layout=torch.jagged) if torch.is_tensor(rows[0]) else rows
        return out

    def kv_clear(self, keys, partition_id):
        for key in keys:
            self.data.get(partition_id, {}).pop(key, None)


def _response_log_probs(model, prompt, response):
    """log pi(response_t | prompt, response_<t) at the rollout temperature, float64: the plain reference."""
    ids = torch.cat([torch.as_tensor(prompt), torch.as_tensor(response)])[None]
    with torch.no_grad():
        logits = model(ids).logits[0].double() / TEMPERATURE
    return torch.log_softmax(logits[len(prompt) - 1: -1], -1).gather(-1, torch.as_tensor(response)[:, None])[:, 0]


class _Worker:
    """verl's ``compute_log_prob`` worker call over the store: each row's log-probs over its whole sequence, as the
    engine writes them (position t predicts token t + 1; the last is padding), by the tiny Qwen2."""

    def __init__(self, store, model):
        self.store, self.model, self.calls = store, model, 0

    def compute_log_prob(self, meta):
        assert meta.extra_info["temperature"] == TEMPERATURE and not meta.extra_info["compute_loss"]
        self.calls += 1
        rows = self.store.data[meta.partition_id]
        for key in meta.keys:
            row = rows[key]
            lp = _response_log_probs(self.model, row["input_ids"][:1], row["input_ids"][1:])
            row["log_probs"] = torch.cat([lp, torch.zeros(1, dtype=lp.dtype)]).float()
        return meta


@pytest.fixture(scope="module")
def chat():
    """(tokenizer with ChatML, verl's rollout token builder for it, a tiny float64 Qwen2 over its vocabulary)."""
    from _tiny_models import tiny_qwen2
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from verl_oar.cpu.workspace import build_tokenizer

    tokenizer = build_tokenizer()
    builder = create_continuous_token_builder(tokenizer, hf_model_type="qwen2", chat_template_kwargs={})
    return tokenizer, builder, tiny_qwen2(vocab=len(tokenizer))


def _privileged_pass(monkeypatch, chat, estimator, bypass, limit=10_000, seed=0):
    """Run ``estimator``'s signal provider (verl_oar.integration.privileged_signal) on four rows of a batch in the
    store; old_log_probs are the plain prompt's log-probs plus a rollout-engine mismatch (N(0, 0.05) per token).
    Returns (store, batch, metrics, plain log-probs, messages, responses, worker)."""
    import transfer_queue
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta

    from verl_oar.integration import privileged_signal

    tokenizer, builder, model = chat
    store = _Store()
    for name in ("kv_batch_put", "kv_batch_get", "kv_clear"):
        monkeypatch.setattr(transfer_queue, name, getattr(store, name))
    g = torch.Generator().manual_seed(seed)
    questions, answers = QUESTIONS, ANSWERS
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    responses = [torch.tensor(tokenizer.encode(f"So it is \\boxed{{{a}}}.", add_special_tokens=False)
                              + [tokenizer.eos_token_id]) for a in answers]
    prompts = [torch.tensor(builder.build_initial_tokens(m)) for m in messages]
    plain = [_response_log_probs(model, p, r) for p, r in zip(prompts, responses)]
    old = [(lp + 0.05 * torch.randn(lp.shape, generator=g, dtype=lp.dtype)).float() for lp in plain]
    keys = [f"u{i}_0_0" for i in range(len(questions))]
    store.kv_batch_put(keys, "train", {
        "raw_prompt": messages, "prompts": prompts, "responses": responses,
        "response_mask": [torch.ones_like(r) for r in responses], "old_log_probs": old,
        "reward_model": [{"ground_truth": a} for a in answers]})
    worker = _Worker(store, model)

    class Trainer:
        config = OmegaConf.create({"algorithm": {"adv_estimator": estimator,
                                                 "rollout_correction": {"bypass_mode": bypass}},
                                   "actor_rollout_ref": {"rollout": {"temperature": TEMPERATURE}}})
        actor_rollout_wg = worker
        _verl_oar_model_facts = ("qwen2", limit)
        _verl_oar_token_builder = builder

        def _balance_batch(self, meta, metrics, logging_prefix):  # verl reorders rows across ranks: so do we
            return KVBatchMeta(keys=meta.keys[::-1], tags=meta.tags[::-1], partition_id=meta.partition_id,
                               extra_info=meta.extra_info)

    batch = KVBatchMeta(keys=keys, tags=[{} for _ in keys], partition_id="train")
    metrics: dict = {}
    provider = {"cscr": privileged_signal.compute_cscr_shifts, "oppo": privileged_signal.compute_oppo_evidence}[estimator]
    provider(Trainer(), batch, metrics)
    assert not store.data.get(privileged_signal.PARTITION)  # the pass's partition is cleared
    return store, batch, metrics, plain, messages, responses, worker


@pytest.mark.parametrize("estimator", ["cscr", "oppo"])
def test_bypass_mode_takes_the_shift_against_the_plain_prompt_rescored_in_the_same_pass(monkeypatch, chat, estimator):
    """old_log_probs are the rollout engine's in bypass mode: the shift must not contain that mismatch."""
    from verl_oar.core.cscr import CSCRConfig
    from verl_oar.core.oppo import OPPOConfig
    from verl_oar.core.privileged_prompt import rewrite_messages

    tokenizer, builder, model = chat
    field, template = {"cscr": ("cscr_pos_shift", CSCRConfig().pos_template),
                       "oppo": ("oppo_evidence", OPPOConfig().template)}[estimator]
    answers = ANSWERS
    for bypass in (True, False):
        store, batch, metrics, plain, messages, responses, worker = _privileged_pass(monkeypatch, chat, estimator, bypass)
        rows = store.data["train"]
        for i, key in enumerate(batch.keys):
            prompt = tokenizer.apply_chat_template(rewrite_messages(messages[i], template, answers[i]),
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
            privileged = _response_log_probs(model, prompt, responses[i])
            baseline = plain[i] if bypass else rows[key]["old_log_probs"].double()
            torch.testing.assert_close(rows[key][field].double(), privileged - baseline, atol=2e-5, rtol=0)
        templates = 2 if estimator == "cscr" else 1  # one call in all; the plain prompt's rows only in bypass mode
        assert worker.calls == 1 and metrics[f"{estimator}/rescore/rows"] == len(plain) * (templates + bypass)
        assert metrics[f"{estimator}/rescore/plain_baseline"] == float(bypass)


# --- 6. a privileged prompt past the context: the question is shortened, never the chat header or template -------


def test_an_overflowing_privileged_prompt_keeps_header_system_prompt_and_template_and_shortens_the_question(chat):
    from verl_oar.core.privileged_prompt import OPPO_ORACLE
    from verl_oar.integration.privileged_signal import RescoreStats, privileged_rows

    tokenizer, builder, _ = chat
    question = "Tom has 3 apples. " * 8 + "How many apples does Tom have?"
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in (question, "What is 2+3?")]
    prompts = [torch.tensor(builder.build_initial_tokens(m)) for m in messages]
    responses = [torch.tensor(tokenizer.encode("So \\boxed{24}.", add_special_tokens=False) + [tokenizer.eos_token_id])] * 2
    masks = [torch.ones_like(r) for r in responses]

    def rows(limit, overflow="truncate"):
        stats = RescoreStats()
        built = privileged_rows([OPPO_ORACLE], ["a", "b"], messages, prompts, responses, masks, ["24", "5"], [False] * 2,
                                builder.build_initial_tokens, limit, overflow, stats)
        return built, stats

    full = len(builder.build_initial_tokens(messages[0][:1] + [{"role": "user", "content": OPPO_ORACLE.format(
        question=question, answer="24")}]))
    limit = full + len(responses[0]) - 40  # 40 tokens too many for row a; row b fits
    built, stats = rows(limit)
    text = tokenizer.decode(built.rows[0]["prompts"])
    head = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nTom has 3 apples."
    tail = "How many apples does Tom have?\n\nThe correct final answer is: 24.<|im_end|>\n<|im_start|>assistant\n"
    assert text.startswith(head) and text.endswith(tail) and " [...] " in text, text  # core.privileged_prompt.ELISION
    assert len(built.rows[0]["input_ids"]) == limit  # byte-level tokens: the most of the question that fits
    assert built.scored == [True, True] and stats.truncated == 1 and stats.skipped == 0
    assert tokenizer.decode(built.rows[1]["prompts"]).endswith("What is 2+3?\n\nThe correct final answer is: 5.<|im_end|>\n"
                                                               "<|im_start|>assistant\n")
    empty = len(builder.build_initial_tokens(messages[0][:1] + [{"role": "user", "content": OPPO_ORACLE.format(
        question="", answer="24")}]))
    built, stats = rows(empty + len(responses[0]) - 1)  # not even an empty question fits row a: skipped, counted
    assert built.scored[0] is False and stats.skipped == 1 and torch.equal(built.rows[0]["prompts"], prompts[0])
    built, stats = rows(limit, overflow="skip")
    assert built.scored == [False, True] and stats.skipped == 1 and stats.truncated == 0


def test_the_pass_scores_a_shortened_question_and_leaves_rows_that_cannot_fit_unscored(monkeypatch, chat):
    """Through the whole pass (in-memory TransferQueue, tiny Qwen2): row 1's oracle prompt is shortened, the
    evidence is taken under it; a context so small that a row cannot fit leaves it unscored (evidence 0)."""
    from verl_oar.core.privileged_prompt import OPPO_ORACLE, fit_question

    tokenizer, builder, model = chat
    limit = 121  # rows 0-2 fit with a few characters of their question, row 3 (a long answer) not even without
    store, batch, metrics, plain, messages, responses, _ = _privileged_pass(monkeypatch, chat, "oppo", False, limit=limit)
    rows = store.data["train"]
    assert metrics["oppo/rescore/truncated"] == 3 and metrics["oppo/rescore/skipped"] == 1
    for i, key in enumerate(batch.keys):
        ids, _ = fit_question(messages[i], OPPO_ORACLE, ANSWERS[i], builder.build_initial_tokens, limit - len(responses[i]))
        if ids is None:
            assert (rows[key]["oppo_scored"] == 0).all() and (rows[key]["oppo_evidence"] == 0).all()
            continue
        assert (rows[key]["oppo_scored"] == 1).all()
        want = _response_log_probs(model, ids, responses[i]) - rows[key]["old_log_probs"].double()
        torch.testing.assert_close(rows[key]["oppo_evidence"].double(), want, atol=2e-5, rtol=0)
