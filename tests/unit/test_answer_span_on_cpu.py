"""Answer-span location (verl_oar.core.answer_span): the answer in the text, and the reasoning / answer
tokens of real tokenizers built locally (no downloads): a trained byte-level BPE (Qwen2-style), a
byte-level vocabulary of the 256 byte symbols with no merges, and a SentencePiece-style (Metaspace)
BPE that is not byte-level and exercises the incremental decoder."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verl_oar.core import answer_span
from verl_oar.core.answer_span import (
    AnswerSpan,
    answer_token_masks,
    decode_with_offsets,
    find_answer_span,
    format_answer_span,
    locate_answer_tokens,
    parse_answer_span,
    token_char_offsets,
)

SPECIALS = ["<|endoftext|>", "<|im_end|>"]

CORPUS = [
    "Let's compute 3 × 4 = 12. Then π ≈ 3.14, so the area is 12π.",
    "We get $\\frac{1}{2}$. Therefore the answer is \\boxed{\\frac{1}{2}}.",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "所以答案是 5。The answer is 5. 面积是 3×π 平方米",
    "The final answer is $7$. I hope it is correct.",
    "We need 6 × 7 first.\nAnswer: 42\n**Answer:** $x$; **Final Answer**: 12, since 12 is even.",
    "## Final Answer\n\n$$3\\pi$$ so Final Answer: The answer is (1, 2), y = 4 because 1,000.",
]


# Responses in the answer formats of real math RL data: (response, answer content, marker at marker_start),
# checked by hand; located through every tokenizer below.
FORMATS = [
    ("Compute 6 × 7 first.\nAnswer: 42", "42", "Answer:"),                              # DAPO-Math
    ("We need π/2.\n**Answer:** $\\frac{\\pi}{2}$", "\\frac{\\pi}{2}", "**Answer:**"),
    ("So x = 12.\n\n**Final Answer**: 12.", "12", "**Final Answer**"),
    ("面积是 3×π.\n## Final Answer\n\n$$3\\pi$$", "3\\pi", "## Final Answer"),
    ("Final Answer: The final answer is $7$. I hope it is correct.", "7", "Final Answer:"),  # Minerva
    ("The final answer is $\\frac{1}{2}$.", "\\frac{1}{2}", "The final answer is"),
    ("Thus \\[ \\boxed{42} \\]", "42", "\\boxed"),
    ("所以 $\\boxed 5$。", "5", "\\boxed"),
    ("The answer is 3, since 3 is odd.", "3", "The answer is"),
    ("Total: 1,000 coins. The answer is 1,000, so we stop.", "1,000", "The answer is"),
    ("The answer is (1, 2); because both work.", "(1, 2)", "The answer is"),
    ("The answer is x = 3, y = 4.", "x = 3, y = 4", "The answer is"),
    ("推理。\nAnswer: 面积 3π", "面积 3π", "Answer:"),
    ("#### 8\nAnswer: 9", "9", "Answer:"),
]


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def bpe():
    """A small trained byte-level BPE, like Qwen2's (ByteLevel pre-tokenizer and decoder)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return _wrap(tok)


@pytest.fixture(scope="module")
def bytes_only():
    """The 256 byte symbols and no merges: every multi-byte character spans several tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(SPECIALS)} | {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return _wrap(tok)


@pytest.fixture(scope="module")
def metaspace():
    """SentencePiece-style BPE ("▁" for spaces): not byte-level, decoded incrementally."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    characters = "".join(CORPUS) + "".join(response for response, _, _ in FORMATS)
    alphabet = sorted(set(characters) | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[*SPECIALS, "<unk>"], initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return _wrap(tok)


TOKENIZERS = ["bpe", "bytes_only", "metaspace"]


# --- the answer in the text ------------------------------------------------------------------------

TEXT_CASES = [
    # (text, answer content or None, marker text at marker_start)
    ("First \\boxed{10}, then correcting: the total is \\boxed{12\\pi}.", "12\\pi", "\\boxed"),
    ("Therefore $x = \\boxed{\\frac{1}{2}}$ and we are done.", "\\frac{1}{2}", "\\boxed"),
    ("So the set is \\boxed{\\{1, 2\\}}", "\\{1, 2\\}", "\\boxed"),
    ("\\boxed{ \\sqrt{\\frac{a}{b}} }", "\\sqrt{\\frac{a}{b}}", "\\boxed"),
    ("framed: \\fbox{42}", "42", "\\fbox"),
    ("Hence \\boxed 5$ is it", "5", "\\boxed"),
    ("Hence \\boxed{4} and later \\boxed{5", None, None),                 # truncated in the last box
    ("#### 7\nhmm, maybe \\boxed{8", "7", "####"),                        # unclosed box falls through
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72.\n#### 72", "72", "####"),
    ("#### 1\nnope\n####   2  \nend", "2", "####"),
    ("The answer is 42.", "42", "The answer is"),
    ("so THE ANSWER IS: 3.14. More text", "3.14", "THE ANSWER IS"),
    ("the answer is $\\frac{1}{2}$.\nDone", "\\frac{1}{2}", "the answer is"),      # one $ pair stripped
    ("The final answer is $7$. I hope it is correct.", "7", "The final answer is"),
    ("The answer isn't obvious, is it", None, None),
    ("The answer is", None, None),
    ("\\boxed{}", None, None),
    ("#### \n", None, None),
    ("I am not sure what to do.", None, None),
    ("", None, None),
    ("所以答案是 \\boxed{3×π}。", "3×π", "\\boxed"),
    ("\\boxedx{3}", None, None),
    # a box in display or inline math: the delimiters never enter the span
    ("\\[ \\boxed{42} \\]", "42", "\\boxed"),
    ("\\[ \\boxed 42 \\]", "42", "\\boxed"),
    ("\\( \\boxed 42 \\)", "42", "\\boxed"),
    ("so $\\boxed{42}$.", "42", "\\boxed"),
    ("so $\\boxed 42$.", "42", "\\boxed"),
    ("The answer is 9.\n\\boxed{10}", "10", "\\boxed"),                    # a box beats everything
    # labels: DAPO-Math's "Answer:" line, markdown variants
    ("Compute 6 * 7.\nAnswer: 42", "42", "Answer: 42"),
    ("so it is 41... no.\nanswer: 42\n", "42", "answer:"),
    ("**Answer:** $\\frac{1}{2}$", "\\frac{1}{2}", "**Answer:**"),
    ("**Answer**: 12.", "12", "**Answer**:"),
    ("ANSWER : -3", "-3", "ANSWER :"),
    ("x\n  > __Answer__: 5", "5", "> __Answer__"),                       # marker: first non-blank
    ("Answer: 4\nchecking...\nAnswer: 5", "5", "Answer: 5"),              # the last label
    ("Answer: *x*", "*x*", "Answer:"),                                    # no opening emphasis: * is content
    ("Answer: 3, since 3 is odd.", "3", "Answer:"),
    ("Answers: 5 and 6", None, None),
    ("Answer the question. The answer is 4.", "4", "The answer is"),     # no colon: not a label
    ("Answer:\n\n", None, None),
    ("The answer is 9.\nAnswer:", "9", "The answer is"),                  # the last label is empty
    ("Final Answer: 7", "7", "Final Answer"),
    ("**Final Answer**: 7", "7", "**Final Answer**"),
    ("**Final Answer:** 7", "7", "**Final Answer:**"),
    ("## Final Answer\n\n$$\\frac{\\pi}{4}$$", "\\frac{\\pi}{4}", "## Final Answer"),
    ("**Final Answer**\n\\[\n2\\sqrt{3}.\n\\]", "2\\sqrt{3}", "**Final Answer**"),   # display block
    ("Final Answer: The final answer is $7$. I hope it is correct.", "7", "Final Answer:"),  # Minerva
    ("### Final Answer\nThus the answer is 12, because 3 * 4 = 12.", "12", "### Final Answer"),
    ("Answer:\nThe answer is 9.", "9", "Answer:"),
    ("#### Final Answer\n9", "9", "#### Final Answer"),                  # label beats #### at one place
    ("##### 5", None, None),                                             # exactly four #
    # equal rank: the later marker; rank 2 beats rank 3
    ("Answer: 8\n#### 9", "9", "####"),
    ("#### 9\nAnswer: 8", "8", "Answer:"),
    ("Answer: 8\nThe answer is 9.", "8", "Answer:"),
    # saying form: math delimiters
    ("The final answer is $42$.", "42", "The final answer is"),
    ("The answer is \\(\\frac{1}{2}\\).", "\\frac{1}{2}", "The answer is"),
    ("The answer is $$x^2$$", "x^2", "The answer is"),
    ("The answer is $1$ and $2$.", "$1$ and $2$", "The answer is"),       # not one pair: kept
    ("The final answer is:\n\n\\[\n\\frac{3}{4}\n\\]", "\\frac{3}{4}", "The final answer is:"),
    ("The answer is\n42", None, None),                                   # no colon: same line only
    ("My final answer is 0.5.", "0.5", "My final answer is"),
    ("Final answer is 6", "6", "Final answer is"),
    ("The answer is 3。所以", "3", "The answer is"),
    # saying form: the justification cut-off
    ("The answer is 3, since 3 is odd.", "3", "The answer is"),
    ("THE ANSWER IS 7, SINCE", "7", "THE ANSWER IS"),
    ("The answer is 3; because 3 is odd", "3", "The answer is"),
    ("The answer is 12, as computed above.", "12", "The answer is"),
    ("The answer is 3 because 3 is odd.", "3", "The answer is"),         # bare "because"
    ("The answer is $x^2$, where $x$ is the side.", "x^2", "The answer is"),
    ("The answer is 5, i.e. five.", "5", "The answer is"),
    ("The answer is 7, sincerely", "7, sincerely", "The answer is"),      # whole words only
    ("The answer is 1,000", "1,000", "The answer is"),                    # no space: a number
    ("The answer is 1,000, so we are done.", "1,000", "The answer is"),
    ("The answer is (1, 2), which is the only pair", "(1, 2)", "The answer is"),
    ("The answer is [0, 1), since f is increasing", "[0, 1)", "The answer is"),
    ("The answer is \\{1, 2\\}, and no other set.", "\\{1, 2\\}", "The answer is"),
    ("The answer is $a, b$, so", "a, b", "The answer is"),                 # no cut inside $...$
    ("The answer is x = 3, y = 4.", "x = 3, y = 4", "The answer is"),     # a list of values
    ("The answer is x = 3, and y = 4.", "x = 3", "The answer is"),        # ", and" cuts (documented)
    ("The answer is $5, so she pays.", "$5", "The answer is"),            # a lone $ is a character
    ("The answer is 1, 2, 3, ...", "1, 2, 3, ...", "The answer is"),      # an ellipsis keeps its dots
]


@pytest.mark.parametrize(("text", "content", "marker"), TEXT_CASES)
def test_find_answer_span(text, content, marker):
    span = find_answer_span(text)
    if content is None:
        assert span is None
        return
    assert isinstance(span, AnswerSpan)
    assert text[span.start:span.end] == content
    assert text[span.marker_start:].startswith(marker)
    assert span.marker_start < span.start < span.end


# --- characters of each token --------------------------------------------------------------------

RESPONSES = [
    "Let's compute 3 × 4 = 12. Then π ≈ 3.14.\nFirst guess: \\boxed{10}. Actually the total is \\boxed{12π}.",
    "We get $\\frac{1}{2}$.\nTherefore \\boxed{\\frac{1}{2}}",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72",
    "所以答案是 5。The answer is 5.",
    "面积是 \\boxed{3×π}",
    "Hence \\boxed 5$ is it",
    "#### 7\nwait \\boxed{8",
]


def check_mapping(tokenizer, ids, text, offsets):
    assert text == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert len(offsets) == len(ids)
    starts = [s for s, _ in offsets]
    assert starts == sorted(starts)
    assert all(0 <= s <= e <= len(text) for s, e in offsets)
    covered = set()
    for s, e in offsets:
        covered.update(range(s, e))
    assert covered == set(range(len(text)))       # every character comes from some token


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("response", RESPONSES + [response for response, _, _ in FORMATS])
def test_locate_answer_tokens(request, name, response):
    tokenizer = request.getfixturevalue(name)
    ids = [*tokenizer.encode(response, add_special_tokens=False), tokenizer.eos_token_id]
    text, offsets = decode_with_offsets(ids, tokenizer, skip_special_tokens=True)
    check_mapping(tokenizer, ids, text, offsets)
    span = find_answer_span(text)
    located = locate_answer_tokens(ids, tokenizer)
    assert (located is None) == (span is None)
    if located is None:
        return
    reasoning, answer = located
    assert len(reasoning) == len(answer) == len(ids)
    assert not any(r and a for r, a in zip(reasoning, answer))
    # reasoning: exactly the tokens that end before the marker; a prefix of the response
    first_other = reasoning.index(False)
    assert all(reasoning[:first_other]) and not any(reasoning[first_other:])
    assert all(offsets[i][1] <= span.marker_start for i in range(first_other))
    assert offsets[first_other][1] > span.marker_start
    # answer: a contiguous run whose decoded text covers the answer content
    picked = [i for i, a in enumerate(answer) if a]
    assert picked == list(range(picked[0], picked[-1] + 1))
    content = text[span.start:span.end]
    assert content in tokenizer.decode(ids[picked[0]:picked[-1] + 1], skip_special_tokens=True)
    assert offsets[picked[0]][0] <= span.start and offsets[picked[-1]][1] >= span.end
    # the end-of-sequence token is never reasoning nor answer
    assert not reasoning[-1] and not answer[-1]


def test_multibyte_characters_span_several_byte_tokens(bytes_only):
    text = "× π 中"
    ids = bytes_only.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))                  # one token per byte
    offsets = token_char_offsets(ids, bytes_only)
    assert offsets == [(0, 1), (0, 1), (1, 2), (2, 3), (2, 3), (3, 4), (4, 5), (4, 5), (4, 5)]
    # a truncated response that ends inside a character decodes to U+FFFD, consistently
    text, offsets = decode_with_offsets(ids[:-1], bytes_only)
    assert text == bytes_only.decode(ids[:-1]) and text.endswith("\ufffd")
    assert offsets[-2:] == [(4, 5), (4, 5)]


def test_invalid_utf8_in_the_middle(bytes_only):
    lead = bytes_only.encode("中", add_special_tokens=False)[:2]           # 2 of its 3 bytes
    ids = [*bytes_only.encode("a", add_special_tokens=False), *lead, *bytes_only.encode("7b", add_special_tokens=False)]
    text, offsets = decode_with_offsets(ids, bytes_only)
    assert text == "a\ufffd7b" == bytes_only.decode(ids)
    assert offsets == [(0, 1), (1, 2), (1, 2), (2, 3), (3, 4)]


def test_special_tokens_are_zero_width_when_skipped(bpe):
    ids = [*bpe.encode("x #### 3", add_special_tokens=False), bpe.eos_token_id, bpe.pad_token_id]
    text, offsets = decode_with_offsets(ids, bpe, skip_special_tokens=True)
    assert text == "x #### 3" and offsets[-2:] == [(8, 8), (8, 8)]
    full = token_char_offsets(ids, bpe)                                     # not skipped
    assert full[-2] == (8, 8 + len("<|im_end|>"))


def test_byte_level_path_needs_no_per_token_decode(bpe, bytes_only, monkeypatch):
    def fail(*_args, **_kwargs):
        raise AssertionError("the incremental decoder ran for a byte-level tokenizer")

    monkeypatch.setattr(answer_span, "_incremental_offsets", fail)
    for tokenizer in (bpe, bytes_only):
        ids = tokenizer.encode(RESPONSES[0], add_special_tokens=False)
        assert locate_answer_tokens(ids, tokenizer) is not None


def test_incremental_decoder_is_linear(metaspace):
    ids = metaspace.encode(" ".join(RESPONSES), add_special_tokens=False)
    calls = 0
    decode = metaspace.decode

    class Counting:
        def __getattr__(self, name):
            return getattr(metaspace, name)

        def decode(self, *args, **kwargs):
            nonlocal calls
            calls += 1
            return decode(*args, **kwargs)

    text, offsets = decode_with_offsets(ids, Counting(), skip_special_tokens=True)
    check_mapping(metaspace, ids, text, offsets)
    assert calls <= 3 * len(ids) + 2


@pytest.mark.parametrize("name", TOKENIZERS)
def test_degenerate_responses(request, name):
    tokenizer = request.getfixturevalue(name)
    assert locate_answer_tokens([], tokenizer) is None
    assert decode_with_offsets([], tokenizer) == ("", [])
    one = tokenizer.encode("4", add_special_tokens=False)
    assert len(one) == 1 and locate_answer_tokens(one, tokenizer) is None
    assert locate_answer_tokens([tokenizer.eos_token_id], tokenizer) is None


@pytest.mark.parametrize("name", TOKENIZERS)
def test_answer_token_masks_batch(request, name):
    tokenizer = request.getfixturevalue(name)
    rows = [[*tokenizer.encode(r, add_special_tokens=False), tokenizer.eos_token_id] for r in RESPONSES]
    rows.append([])                                                        # empty response
    rows.append(tokenizer.encode("I am not sure.", add_special_tokens=False))
    width = max(map(len, rows)) + 2
    responses = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        responses[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    reasoning, answer, found = answer_token_masks(responses, mask, tokenizer)
    assert reasoning.dtype == answer.dtype == found.dtype == torch.bool
    assert reasoning.shape == answer.shape == responses.shape and found.shape == (len(rows),)
    assert not (reasoning & ~mask.bool()).any() and not (answer & ~mask.bool()).any()
    for i, row in enumerate(rows):
        located = locate_answer_tokens(row, tokenizer)
        assert bool(found[i]) == (located is not None)
        if located is None:
            assert not reasoning[i].any() and not answer[i].any()
        else:
            assert reasoning[i, :len(row)].tolist() == located[0]
            assert answer[i, :len(row)].tolist() == located[1]
    assert found.tolist() == [True, True, True, True, True, True, True, False, False]


# --- random responses ---------------------------------------------------------------------------

PROSE = st.text(alphabet=st.sampled_from(list("abc xyz 0123456789=+-.,()×π中文面积\n")), max_size=40)
ANSWER = st.text(alphabet=st.sampled_from(list("0123456789xπ×中+-/")), min_size=1, max_size=8)
LAYOUTS = [
    ("{prose}\\boxed{{{answer}}}{tail}", "\\boxed"),
    ("{prose}\\boxed{{\\frac{{{answer}}}{{2}}}}{tail}", "\\boxed"),
    ("{prose}\n#### {answer}", "####"),
    ("{prose} The answer is {answer}.", "The answer is"),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prose=PROSE, answer=ANSWER, layout=st.sampled_from(LAYOUTS), tail=st.sampled_from(["", ".", " done", "$."]))
def test_random_responses_byte_level(bpe, prose, answer, layout, tail):
    template, marker = layout
    response = template.format(prose=prose, answer=answer, tail=tail)
    ids = [*bpe.encode(response, add_special_tokens=False), bpe.eos_token_id]
    text, offsets = decode_with_offsets(ids, bpe, skip_special_tokens=True)
    assert text == response
    check_mapping(bpe, ids, text, offsets)
    span = find_answer_span(text)
    assert span is not None and text[span.marker_start:].startswith(marker)
    expected = answer if "frac" not in template else f"\\frac{{{answer}}}{{2}}"
    assert text[span.start:span.end] == expected.strip()
    reasoning, is_answer = locate_answer_tokens(ids, bpe)
    picked = [i for i, a in enumerate(is_answer) if a]
    assert expected.strip() in bpe.decode(ids[picked[0]:picked[-1] + 1])
    assert all(offsets[i][1] <= span.marker_start for i, r in enumerate(reasoning) if r)


# --- the answer formats of real data, token by token ----------------------------------------------


def _encode(tokenizer, response):
    return [*tokenizer.encode(response, add_special_tokens=False), tokenizer.eos_token_id]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize(("response", "content", "marker"), FORMATS)
def test_format_answer_tokens_exactly(request, name, response, content, marker):
    """The answer tokens are exactly the minimal run that decodes to the content; the reasoning tokens are
    exactly the longest prefix whose decoding stops at or before the marker (checked by decoding,
    independently of the offsets the implementation uses)."""
    tokenizer = request.getfixturevalue(name)
    ids = _encode(tokenizer, response)
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert text == response
    span = find_answer_span(text)
    assert text[span.start:span.end] == content and text.startswith(marker, span.marker_start)
    reasoning, answer = locate_answer_tokens(ids, tokenizer)

    def decoded(a, b):
        return tokenizer.decode(ids[a:b], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    k = sum(reasoning)
    assert reasoning == [True] * k + [False] * (len(ids) - k)
    assert text[:span.marker_start].startswith(decoded(0, k))
    assert not text[:span.marker_start].startswith(decoded(0, k + 1))     # one more token crosses the marker
    picked = [i for i, a in enumerate(answer) if a]
    first, last = picked[0], picked[-1]
    assert picked == list(range(first, last + 1)) and first >= k
    assert content in decoded(first, last + 1)
    assert content not in decoded(first + 1, last + 1) and content not in decoded(first, last)   # minimal
    assert not answer[-1] and not reasoning[-1]                             # end of sequence


JUSTIFICATIONS = ["since", "because", "as", "so", "which", "where", "and", "therefore", "given", "Since",
                  "BECAUSE", "hence", "thus", "but"]
VALUES = st.one_of(
    st.integers(-10**6, 10**6).map(str),
    st.integers(1, 999).map(lambda n: f"{n},{n % 1000:03d}"),                  # thousands separators
    st.sampled_from(["(1, 2)", "x = 3, y = 4", "\\frac{1}{2}", "[0, 1)", "\\{1, 2\\}", "3.5", "2\\sqrt{3}"]),
)
DELIMITERS = st.sampled_from([("", ""), ("$", "$"), ("\\(", "\\)"), ("$$", "$$")])
TAIL = st.text(alphabet=st.sampled_from(list("abcdxyz 0123456789+=(),;.$")), max_size=30)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prose=PROSE, value=VALUES, delimiters=DELIMITERS, sep=st.sampled_from([",", ";"]),
       word=st.sampled_from(JUSTIFICATIONS), tail=TAIL)
def test_a_justification_never_enters_the_answer(bpe, prose, value, delimiters, sep, word, tail):
    """"The answer is V, <justification ...>": the answer is V (without its math delimiters), and its
    tokens end before the justification word."""
    response = f"{prose} The answer is {delimiters[0]}{value}{delimiters[1]}{sep} {word} {tail}"
    span = find_answer_span(response)
    assert response[span.start:span.end] == value
    ids = _encode(bpe, response)
    text, offsets = decode_with_offsets(ids, bpe, skip_special_tokens=True)
    reasoning, answer = locate_answer_tokens(ids, bpe)
    word_start = response.rindex(f"{sep} {word} ") + len(sep) + 1
    assert max(end for (_, end), a in zip(offsets, answer) if a) <= word_start
    assert word.lower() not in bpe.decode([i for i, a in zip(ids, answer) if a]).lower()


# --- pluggable locators and given spans -------------------------------------------------------------


def _batch(tokenizer, texts):
    rows = [_encode(tokenizer, t) for t in texts]
    width = max(map(len, rows)) + 1
    responses = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        responses[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return rows, responses, mask


def first_box(text):
    """A custom locator: the *first* box, marker included."""
    start = text.find("\\boxed{")
    if start < 0:
        return None
    return AnswerSpan(start, start + 7, text.index("}", start))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_custom_locator(request, name):
    tokenizer = request.getfixturevalue(name)
    text = "First \\boxed{10}, then \\boxed{12}."
    ids = _encode(tokenizer, text)
    reasoning, answer = locate_answer_tokens(ids, tokenizer, locator=first_box)
    assert "10" in tokenizer.decode([i for i, a in zip(ids, answer) if a])
    assert "First" in tokenizer.decode([i for i, r in zip(ids, reasoning) if r]) and "\\" not in \
        tokenizer.decode([i for i, r in zip(ids, reasoning) if r])
    assert locate_answer_tokens(ids, tokenizer, locator=lambda _: None) is None
    assert locate_answer_tokens(ids, tokenizer, locator=None) == locate_answer_tokens(ids, tokenizer)
    rows, responses, mask = _batch(tokenizer, [text, "no box here", "#### 3"])
    reasoning_b, answer_b, found = answer_token_masks(responses, mask, tokenizer, locator=first_box)
    assert found.tolist() == [True, False, False]
    assert answer_b[0, :len(ids)].tolist() == answer and reasoning_b[0, :len(ids)].tolist() == reasoning


@pytest.mark.parametrize("name", TOKENIZERS)
def test_given_spans_override_the_locator(request, name):
    tokenizer = request.getfixturevalue(name)
    texts = ["First \\boxed{10}, then \\boxed{12}.", "Answer: 7", "no answer in sight", "#### 5"]
    rows, responses, mask = _batch(tokenizer, texts)
    spans = [first_box(texts[0]), None, AnswerSpan(0, 3, 9), None]         # row 2: "answer", found nowhere else
    reasoning, answer, found = answer_token_masks(responses, mask, tokenizer, spans=spans)
    assert found.tolist() == [True, True, True, True]
    expected = [
        locate_answer_tokens(rows[0], tokenizer, locator=first_box),
        locate_answer_tokens(rows[1], tokenizer),                          # None: the locator decides
        locate_answer_tokens(rows[2], tokenizer, locator=lambda _: AnswerSpan(0, 3, 9)),
        locate_answer_tokens(rows[3], tokenizer),
    ]
    for i, row in enumerate(rows):
        assert (reasoning[i, :len(row)].tolist(), answer[i, :len(row)].tolist()) == expected[i]
        assert not reasoning[i, len(row):].any() and not answer[i, len(row):].any()
    assert "answer" in tokenizer.decode([t for t, a in zip(rows[2], answer[2].tolist()) if a])
    # given spans and a locator that finds nothing
    _, answer_none, found_none = answer_token_masks(responses, mask, tokenizer, locator=lambda _: None, spans=spans)
    assert found_none.tolist() == [True, False, True, False]
    assert torch.equal(answer_none[0], answer[0]) and not answer_none[1].any()


def test_reward_span_grounds_the_same_tokens(bpe):
    """math_reward's ``answer_span`` string, parsed and given as a span, marks the tokens the built-in
    locator marks: OAR grounds on exactly what the verifier graded."""
    from verl_oar.rewards.math_reward import compute_score

    texts = [response for response, _, _ in FORMATS] + ["nothing to grade"]
    rows, responses, mask = _batch(bpe, texts)
    spans = [parse_answer_span(compute_score("math500", t, "")["answer_span"]) for t in texts]
    assert spans[-1] is None and all(s is not None for s in spans[:-1])
    given = answer_token_masks(responses, mask, bpe, locator=lambda _: None, spans=spans)
    built_in = answer_token_masks(responses, mask, bpe)
    assert all(torch.equal(a, b) for a, b in zip(given, built_in))


def bad_locator_returning(value):
    def bad_locator(text):
        return value
    return bad_locator


@pytest.mark.parametrize(("value", "problem"), [
    ((0, 1, 2), "must return"),
    ("0:1:2", "must return"),
    (AnswerSpan(0, 1, 99), "0 <= marker_start <= start < end <= 9"),
    (AnswerSpan(3, 2, 4), "0 <= marker_start"),
    (AnswerSpan(0, 4, 4), "non-empty"),
    (AnswerSpan(-1, 0, 2), "0 <= marker_start"),
    (AnswerSpan(0, 1.0, 2), "must be integers"),
    (AnswerSpan(False, True, 2), "must be integers"),
])
def test_bad_locator_results_are_named(bytes_only, value, problem):
    ids = _encode(bytes_only, "#### 1234")
    with pytest.raises(ValueError, match=re.escape(problem)) as error:
        locate_answer_tokens(ids, bytes_only, locator=bad_locator_returning(value))
    assert "bad_locator_returning.<locals>.bad_locator" in str(error.value) and repr(value) in str(error.value)
    _, responses, mask = _batch(bytes_only, ["#### 1234"])
    with pytest.raises(ValueError, match="bad_locator"):
        answer_token_masks(responses, mask, bytes_only, locator=bad_locator_returning(value))
    if isinstance(value, AnswerSpan):
        with pytest.raises(ValueError, match=re.escape("spans[0] (given to answer_token_masks)")):
            answer_token_masks(responses, mask, bytes_only, spans=[value])


def test_numpy_offsets_are_accepted(bytes_only):
    np = pytest.importorskip("numpy")
    ids = _encode(bytes_only, "#### 12")
    span = AnswerSpan(np.int64(0), np.int64(5), np.int64(7))
    assert locate_answer_tokens(ids, bytes_only, locator=lambda _: span) == locate_answer_tokens(ids, bytes_only)


def test_spans_must_match_the_batch(bytes_only):
    _, responses, mask = _batch(bytes_only, ["#### 1", "#### 2"])
    with pytest.raises(ValueError, match="1 spans for 2 responses"):
        answer_token_masks(responses, mask, bytes_only, spans=[None])


# --- the span as a string --------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ("1:2:3", AnswerSpan(1, 2, 3)),
    (" 0:0:15\n", AnswerSpan(0, 0, 15)),
    ("", None),
    ("   ", None),
    (None, None),
    (AnswerSpan(4, 5, 6), AnswerSpan(4, 5, 6)),
])
def test_parse_answer_span(value, expected):
    assert parse_answer_span(value) == expected


@pytest.mark.parametrize("value", [
    "1:2", "1:2:3:4", "a:b:c", "-1:2:3", "1.0:2:3", "1:2:3 extra", "１:２:３", "3:2:4", "1:2:2",
    5, 1.5, float("nan"), b"1:2:3", [1, 2, 3],
])
def test_parse_answer_span_rejects_garbage(value):
    with pytest.raises(ValueError, match="answer span"):
        parse_answer_span(value)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 10**6))
def test_format_and_parse_are_inverse(marker_start, gap, length):
    span = AnswerSpan(marker_start, marker_start + gap, marker_start + gap + length)
    assert parse_answer_span(format_answer_span(span)) == span
    assert format_answer_span(None) == "" and parse_answer_span(format_answer_span(None)) is None
