"""Answer-span location (verl_oar.answer_span): the answer in the text, and the reasoning / answer
tokens of real tokenizers built locally (no downloads): a trained byte-level BPE (Qwen2-style), a
byte-level vocabulary of the 256 byte symbols with no merges, and a SentencePiece-style (Metaspace)
BPE that is not byte-level and exercises the incremental decoder."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from verl_oar import answer_span
from verl_oar.answer_span import (
    AnswerSpan,
    answer_token_masks,
    decode_with_offsets,
    find_answer_span,
    locate_answer_tokens,
    token_char_offsets,
)

SPECIALS = ["<|endoftext|>", "<|im_end|>"]

CORPUS = [
    "Let's compute 3 × 4 = 12. Then π ≈ 3.14, so the area is 12π.",
    "We get $\\frac{1}{2}$. Therefore the answer is \\boxed{\\frac{1}{2}}.",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "所以答案是 5。The answer is 5. 面积是 3×π 平方米",
    "The final answer is $7$. I hope it is correct.",
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
    alphabet = sorted(set("".join(CORPUS)) | set("abcdefghijklmnopqrstuvwxyz0123456789"))
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
@pytest.mark.parametrize("response", RESPONSES)
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
