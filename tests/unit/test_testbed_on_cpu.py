"""The pick_max testbed (verl_oar.testbed): the oracle of causal tokens on hand-checked responses and
two tokenizers, the generator, recall at top-K% on constructed rankings, and the counterfactual test
with a hand-written "model" whose answers are known exactly. No model is trained; seconds on CPU."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verl_oar.core.answer_span import decode_with_offsets
from verl_oar.cpu.workspace import build_tokenizer
from verl_oar.testbed.pick_max import (
    DATA_SOURCE,
    make_problems,
    oracle_batch,
    oracle_token_masks,
    parse_response,
    rl_rows,
)
from verl_oar.core.token_ranking import (
    delete,
    entropy_scores,
    mean_recall,
    occlude,
    random_scores,
    rank_candidates,
    recall_at,
    top_count,
    top_fraction_mask,
)
from verl_oar.testbed.importance_quality import CounterfactualExample, accuracy_drop, answer_accuracy, greedy_answer

CANONICAL = "qzt kdm 7 abx fod 5 kle pqa \\boxed{75}"
MARKER = "\\boxed{"


# --- the oracle in the text ------------------------------------------------------------------------

ORACLE_CASES = [
    # (text, causal strings (the picks), copies_picks); None = no oracle (no answer)
    (CANONICAL, ["7", "5"], True),
    ("qzt kdm 3 abx fod 5 kle pqa \\boxed{35}", ["3", "5"], True),            # a wrong pick is still causal
    ("qzt kdm 7 abx fod 5 kle pqa \\boxed{77}", ["7", "5"], False),           # answer not copied
    ("ab 7 cd 5 \\boxed{ 75 }", ["7", "5"], True),                            # other filler, spaces in the box
    ("7 5 \\boxed{75}", ["7", "5"], True),                                    # no filler at all
    ("qzt 7 kdm \\boxed{7}", ["7"], True),                                    # one pick only
    ("qzt kdm abx \\boxed{75}", [], False),                                   # no pick: an empty oracle
    ("q 7 x 5 y 2 \\boxed{75}", ["7", "5", "2"], False),                      # a third digit counts too
    ("q 7 x 5 y \\boxed{75} then 9", ["7", "5"], True),                      # after the answer: ignored
    ("q 7 x \\boxed{1} y 5 \\boxed{75}", ["7", "1", "5"], False),         # the last box is the answer
    ("qzt kdm 7 abx fod 5 kle pqa", None, None),                              # no answer
    ("qzt kdm 7 abx fod 5 kle pqa \\boxed{75", None, None),                  # unclosed box (truncated)
]


@pytest.mark.parametrize(("text", "causal", "copies"), ORACLE_CASES)
def test_oracle_on_hand_checked_responses(text, causal, copies):
    trace = parse_response(text)
    if causal is None:
        assert trace is None
        return
    assert [text[s:e] for s, e in trace.causal] == causal
    assert trace.copies_picks is copies


def test_oracle_char_offsets_of_the_canonical_response():
    trace = parse_response(CANONICAL)
    assert trace.picks == ((8, 9), (18, 19))
    assert (trace.answer.marker_start, trace.answer.start, trace.answer.end) == (28, 35, 37)


def _marked(text: str, offsets, mask) -> str:
    return "".join(text[a:b] for (a, b), m in zip(offsets, mask.tolist()) if m)


def test_token_masks_on_the_workspace_byte_tokenizer():
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(CANONICAL, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ids[:-1] == list(CANONICAL.encode())      # one token per byte
    masks = oracle_token_masks(ids, tokenizer)
    assert masks.causal.shape == masks.reasoning.shape == masks.answer.shape == (len(ids),)
    assert masks.causal.nonzero().squeeze(1).tolist() == [8, 18]
    assert masks.reasoning.nonzero().squeeze(1).tolist() == list(range(CANONICAL.index("\\boxed")))
    assert bytes(torch.tensor(ids)[masks.answer].tolist()) == b"75"
    assert not (masks.causal & ~masks.reasoning).any() and not masks.reasoning[-1]   # eos: neither


@pytest.fixture(scope="module")
def merged_bpe():
    """A byte-level BPE trained on pick_max responses without the pre-tokenizer's word split, so that
    merges put causal and non-causal characters in one token (e.g. ' 7 ')."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.response for p in make_problems(400, 2, seed=1, pick_max_prob=0.5, word_length=1)],
                            trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def test_token_masks_on_a_merging_tokenizer(merged_bpe):
    text = "a b 7 c d 5 e f \\boxed{75}"
    ids = merged_bpe.encode(text, add_special_tokens=False) + [merged_bpe.eos_token_id]
    decoded, offsets = decode_with_offsets(ids, merged_bpe, skip_special_tokens=True)
    assert decoded == text and len(ids) < len(text)          # some tokens hold several characters
    masks = oracle_token_masks(ids, merged_bpe)
    picks = [(m.start(), m.end()) for m in re.finditer(r"\d", text[: text.index("\\")])]
    for t, (a, b) in enumerate(offsets):                       # a token is causal iff it overlaps a pick
        assert bool(masks.causal[t]) == any(a < e and b > s for s, e in picks)
    assert _marked(text, offsets, masks.causal).count("7") == 1
    mixed = [text[a:b] for (a, b), m in zip(offsets, masks.causal.tolist()) if m and not text[a:b].isdigit()]
    assert mixed, "the tokenizer should merge digits with other characters"


def test_oracle_batch_pads_and_skips_rows_without_an_answer():
    tokenizer = build_tokenizer()
    texts = [CANONICAL, "qzt 7 kdm 5 no answer", "ab 4 cd \\boxed{4}"]
    rows = [list(t.encode()) for t in texts]
    width = max(map(len, rows)) + 2
    responses = torch.full((3, width), tokenizer.pad_token_id)
    mask = torch.zeros(3, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        responses[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
    out = oracle_batch(responses, mask, tokenizer)
    assert out["found"].tolist() == [True, False, True]
    assert not out["causal"][1].any() and not out["reasoning"][1].any()
    assert out["causal"][2].nonzero().squeeze(1).tolist() == [3]
    assert not (out["reasoning"] & ~mask).any()


# --- generator -------------------------------------------------------------------------------------


def test_generator_is_deterministic_and_digits_ignore_the_text_settings():
    a, b = make_problems(50, 2, seed=7, pick_max_prob=0.4), make_problems(50, 2, seed=7, pick_max_prob=0.4)
    assert a == b
    assert [p.pairs for p in a] != [p.pairs for p in make_problems(50, 2, seed=8, pick_max_prob=0.4)]
    assert [p.pairs for p in a] == [p.pairs for p in make_problems(50, 2, seed=7, pick_max_prob=0.9, words=5)]
    assert all(len(p.pairs) == 2 and all(x != y and 0 <= x <= 9 and 0 <= y <= 9 for x, y in p.pairs) for p in a)


@pytest.mark.parametrize(("prob", "words"), [(0.0, 2), (1.0, 2), (0.4, 0), (0.4, 3)])
def test_warm_start_responses_pick_the_larger_digit_with_the_stated_probability(prob, words):
    problems = make_problems(400, 2, seed=3, pick_max_prob=prob, words=words)
    second_larger = picked_max = 0
    for p in problems:
        trace = parse_response(p.response)
        assert trace is not None and trace.copies_picks and len(trace.picks) == 2
        letters = re.findall(r"[a-z]+", p.response[: trace.answer.marker_start])
        assert len(letters) == 3 * words and all(len(w) == 3 for w in letters)
        for (x, y), (s, e) in zip(p.pairs, trace.picks):
            pick = int(p.response[s:e])
            assert pick in (x, max(x, y))          # the first digit, or the larger one
            if y > x:
                second_larger += 1
                picked_max += pick == y
        assert p.prompt == "max: " + " | ".join(f"{x} {y}" for x, y in p.pairs)
        assert p.answer == "".join(str(max(x, y)) for x, y in p.pairs)
    assert picked_max / second_larger == pytest.approx(prob, abs=0.06)


@pytest.mark.parametrize("repeat_prob", [0.0, 0.15, 1.0])
def test_repeated_letter_gaps_come_with_the_stated_probability_and_keep_the_oracle(repeat_prob):
    problems = make_problems(400, 2, seed=5, pick_max_prob=0.4, repeat_prob=repeat_prob)
    gaps = repeated = 0
    for p in problems:
        trace = parse_response(p.response)
        assert trace is not None and trace.copies_picks and len(trace.picks) == 2
        for gap in re.split(r" \d ", p.response[: trace.answer.marker_start].strip()):
            words = gap.split()
            assert len(words) == 2 and all(len(w) == 3 and w.isalpha() for w in words)
            gaps += 1
            repeated += len(set("".join(words))) == 1
    # a gap of random letters is one letter throughout with probability 26**-5, negligible here
    assert gaps == 3 * len(problems)
    assert repeated / gaps == pytest.approx(repeat_prob, abs=0.03)
    with pytest.raises(ValueError, match="repeat_prob"):
        make_problems(3, 2, seed=0, pick_max_prob=0.4, repeat_prob=1.5)


def test_rl_rows():
    problems = make_problems(3, 2, seed=0, pick_max_prob=0.4)
    rows = rl_rows(problems, "train")
    assert [r["data_source"] for r in rows] == [DATA_SOURCE] * 3
    assert rows[1]["prompt"] == [{"role": "user", "content": problems[1].prompt}]
    assert rows[1]["reward_model"] == {"style": "rule", "ground_truth": problems[1].answer}
    assert rows[1]["extra_info"]["index"] == 1 and rows[1]["extra_info"]["pairs"] == [list(x) for x in problems[1].pairs]


# --- recall ----------------------------------------------------------------------------------------

R, ORACLE = 20, [3, 11, 17]                 # 20 candidates, 3 of them causal


def _recall_inputs():
    candidates = torch.zeros(24, dtype=torch.bool)
    candidates[2:22] = True                  # positions 2..21
    oracle = torch.zeros(24, dtype=torch.bool)
    oracle[[p + 2 for p in ORACLE]] = True
    return candidates, oracle


def test_top_count_rounding_and_minimum():
    assert top_count(0.1, 30) == 3 and top_count(0.3, 10) == 3 and top_count(0.01, 10) == 1
    assert top_count(1.0, 7) == 7 and top_count(0.5, 0) == 0
    with pytest.raises(ValueError):
        top_count(0.0, 10)


def test_recall_of_perfect_reversed_and_constant_rankings():
    candidates, oracle = _recall_inputs()
    fracs = [0.05, 0.1, 0.15, 0.5, 0.85, 1.0]
    perfect = oracle.float() + 0.01 * torch.arange(24)           # oracle first, any order after
    assert recall_at(perfect, candidates, oracle, fracs) == {0.05: 1 / 3, 0.1: 2 / 3, 0.15: 1.0, 0.5: 1.0,
                                                              0.85: 1.0, 1.0: 1.0}
    assert recall_at(-perfect, candidates, oracle, fracs) == {0.05: 0.0, 0.1: 0.0, 0.15: 0.0, 0.5: 0.0,
                                                               0.85: 0.0, 1.0: 1.0}
    constant = torch.zeros(24)
    first = recall_at(constant, candidates, oracle, fracs, torch.Generator().manual_seed(5))
    assert first == recall_at(constant, candidates, oracle, fracs, torch.Generator().manual_seed(5))
    assert first[1.0] == 1.0 and all(v in (0, 1 / 3, 2 / 3, 1) for v in first.values())
    gen = torch.Generator().manual_seed(0)                       # random ties: mean recall ~ frac
    mean = sum(recall_at(constant, candidates, oracle, [0.5], gen)[0.5] for _ in range(400)) / 400
    assert abs(mean - 0.5) < 0.06


def test_top_fraction_mask_stays_within_candidates_and_nests():
    candidates, _ = _recall_inputs()
    scores = random_scores((24,), torch.Generator().manual_seed(1))
    ranked = rank_candidates(scores, candidates)
    assert ranked.tolist() == sorted(range(2, 22), key=lambda t: -scores[t].item())
    small = top_fraction_mask(scores, candidates, 0.01)
    big = top_fraction_mask(scores, candidates, 0.5)
    assert small.sum() == 1 and big.sum() == 10 and not (small & ~big).any() and not (big & ~candidates).any()
    assert top_fraction_mask(scores, torch.zeros(24, dtype=torch.bool), 0.5).sum() == 0


def test_recall_rejects_bad_oracles_and_mean_recall_skips():
    candidates, oracle = _recall_inputs()
    with pytest.raises(ValueError):
        recall_at(torch.zeros(24), candidates, torch.zeros(24, dtype=torch.bool), [0.5])
    outside = oracle.clone()
    outside[0] = True
    with pytest.raises(ValueError):
        recall_at(torch.zeros(24), candidates, outside, [0.5])
    scores = torch.stack([oracle.float(), -oracle.float(), oracle.float()])
    oracles = torch.stack([oracle, oracle, torch.zeros(24, dtype=torch.bool)])
    summary = mean_recall(scores, candidates.expand(3, -1), oracles, torch.tensor([True, True, True]), [0.15])
    assert summary.recall == {0.15: 0.5} and (summary.counted, summary.skipped) == (2, 1)
    summary = mean_recall(scores, candidates.expand(3, -1), oracles, torch.tensor([False, True, True]), [0.15])
    assert summary.recall == {0.15: 0.0} and (summary.counted, summary.skipped) == (1, 2)


def test_entropy_scores_are_shifted_to_the_token_they_produced():
    logits = torch.zeros(2, 4, 8)
    logits[:, 1, 0] = 1e4                          # position 1 is certain: token 2 gets entropy 0
    h = entropy_scores(logits)
    assert h.shape == (2, 4)
    assert torch.allclose(h[:, 0], torch.zeros(2)) and torch.allclose(h[:, 2], torch.zeros(2))
    assert torch.allclose(h[:, 1], torch.full((2,), math.log(8))) and torch.allclose(h[:, 3], h[:, 1])
    logits[0, 2] = -math.inf
    logits[0, 2, 3] = 0.0                          # -inf logits: entropy 0, not NaN
    assert entropy_scores(logits)[0, 3] == 0


# --- counterfactual --------------------------------------------------------------------------------


def copy_last_digits(ids: torch.Tensor) -> torch.Tensor:
    """A byte-level "model" that answers, after the last ``\\boxed{``, the last run of digits before
    it, then ``}``: (1, L) ids -> (1, L, 256) logits, one-hot at the last position."""
    data = bytes(ids[0].tolist())
    cut = data.rfind(MARKER.encode())
    context, so_far = data[:cut], data[cut + len(MARKER):]
    digits = re.findall(rb"\d+", context)
    target = (digits[-1] if digits else b"") + b"}"
    ok = len(so_far) < len(target) and target.startswith(so_far)
    logits = torch.zeros(1, ids.shape[1], 256)
    logits[0, -1, target[len(so_far)] if ok else ord("}")] = 1.0
    return logits


def _decode(ids) -> str:
    return bytes(ids).decode()


def _b(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode()))


MARKER_IDS = list(MARKER.encode())


def test_occlude_and_delete_shapes():
    ids = torch.arange(6)
    mask = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.bool)
    assert occlude(ids, mask, 99).tolist() == [0, 99, 2, 99, 99, 5]
    assert occlude(ids[None].expand(2, -1), mask, 99).shape == (2, 6)
    assert delete(ids, mask).tolist() == [0, 2, 5]
    assert delete(ids, torch.zeros(6, dtype=torch.bool)).tolist() == ids.tolist()
    with pytest.raises(ValueError):
        delete(ids[None], mask)


def test_answer_accuracy_with_a_known_model():
    prompt = _b("sum: 3 7 ")
    reasonings = [_b("3 +7=10 "), _b("3 +7=11 "), _b("3 +7=10 ok ")]
    assert answer_accuracy(copy_last_digits, prompt, reasonings, MARKER_IDS, "10", _decode) == 2 / 3

    def as_output(ids):  # like a transformers model: an output object with .logits
        return SimpleNamespace(logits=copy_last_digits(ids))

    assert answer_accuracy(as_output, prompt, reasonings, MARKER_IDS, " 10 ", _decode) == 2 / 3
    full = torch.cat([prompt, reasonings[0], torch.tensor(MARKER_IDS)])
    assert greedy_answer(copy_last_digits, full, _decode) == "10"
    assert greedy_answer(copy_last_digits, full, _decode, max_new_tokens=2) is None  # "10}" needs 3
    assert math.isnan(answer_accuracy(copy_last_digits, prompt, [], MARKER_IDS, "10", _decode))


def test_accuracy_drop_for_known_rankings():
    texts = [("3 ok +7=10 so +2=12 ok ", "12"), ("3 ok +7=11 so ", "10")]   # right, wrong
    examples = [CounterfactualExample(_b("sum: 3 7 2 "), _b(t), truth) for t, truth in texts]
    direct = []
    for text, _ in texts:
        mask = torch.zeros(len(text))
        a, b = [m.span() for m in re.finditer(r"\d+", text)][-1]   # the last number: what the model copies
        mask[a:b] = 1.0
        direct.append(mask)
    fracs = [0.05, 0.5, 1.0]
    kw = {"answer_marker_ids": MARKER_IDS, "decode": _decode}
    for perturb, extra in (("occlude", {"neutral_id": ord(" ")}), ("delete", {})):
        perfect = accuracy_drop(copy_last_digits, examples, direct, fracs, perturb=perturb, **kw, **extra)
        assert perfect.original == 0.5 and perfect.count == 2
        assert perfect.modified == {0.05: 0.0, 0.5: 0.0, 1.0: 0.0}
        assert perfect.drop == {0.05: 0.5, 0.5: 0.5, 1.0: 0.5}
        # direct tokens last, the rest earliest-first: the last total survives until frac = 1
        direct_last = [-100 * m - 0.01 * torch.arange(len(m)) for m in direct]
        late = accuracy_drop(copy_last_digits, examples, direct_last, fracs, perturb=perturb, **kw, **extra)
        assert late.drop == {0.05: 0.0, 0.5: 0.0, 1.0: 0.5}
    constant = [torch.zeros(len(t)) for t, _ in texts]
    runs = [accuracy_drop(copy_last_digits, examples, constant, fracs, perturb="delete", **kw,
                          generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0] == runs[1] and runs[0].drop[1.0] == 0.5
    with pytest.raises(ValueError):
        accuracy_drop(copy_last_digits, examples, direct, fracs, perturb="occlude", **kw)
