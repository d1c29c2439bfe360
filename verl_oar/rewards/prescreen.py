"""Cheap screens for answers that would stall math-verify: such an answer is *not graded*, never called wrong.

An exponent tower such as ``9^{9^{9^{9}}}`` takes math-verify to its parse limit (5 s per parse, in a worker
that then serves nobody else); a batch with many of them used to starve right answers queued behind. What the
screens catch is counted as its own status (``prescreened``), and a screen never fires when the ground truth
itself trips it (a tower against a tower is graded as usual). Each screen is a linear scan of the answer.

- ``tower``: a power whose exponent holds a power whose exponent holds a power (height >= ``TOWER_HEIGHT``),
  braced or not (``2^{2^{2^{2}}}``, ``9^9^9``). ``x^{2^n}`` (height 2) passes.
- ``huge_exponent``: an integer exponent of ``HUGE_EXPONENT_DIGITS`` digits or more (``7^{12345678}``), or
  a numeric exponent ``b^c`` whose value has that many digits (``10^{10^{10}}``: height 2, yet math-verify
  spends its whole parse limit on it).
- ``huge_factorial``: the factorial of an integer of ``HUGE_FACTORIAL_DIGITS`` digits or more (``10000!``).
- ``too_long``: an answer longer than ``max(LONG_ANSWER_CHARS, LONG_ANSWER_RATIO * len(ground truth))``.
"""

from __future__ import annotations

import math
import re

__all__ = ["HUGE_EXPONENT_DIGITS", "HUGE_FACTORIAL_DIGITS", "LONG_ANSWER_CHARS", "LONG_ANSWER_RATIO",
           "TOWER_HEIGHT", "screen", "tower_height"]

TOWER_HEIGHT = 3
HUGE_EXPONENT_DIGITS = 7
HUGE_FACTORIAL_DIGITS = 4
LONG_ANSWER_CHARS = 400
LONG_ANSWER_RATIO = 20

_HUGE_EXPONENT = re.compile(r"(?:\^|\*\*)\s*\{?\s*\d{%d,}" % HUGE_EXPONENT_DIGITS)
_NUMERIC_DOUBLE_POWER = re.compile(r"\d+\s*\^\s*\{?\s*(\d+)\s*\^\s*\{?\s*(\d+)")
_HUGE_FACTORIAL = re.compile(r"\d{%d,}\s*!" % HUGE_FACTORIAL_DIGITS)


def tower_height(text: str) -> int:
    """The most powers stacked in one exponent chain of ``text`` (``^`` or ``**``; a braced exponent nests,
    an unbraced one chains to the next ``^`` after one atom). ``2^{3^{4}}`` -> 2, ``a^b^c`` -> 2."""
    text = text.replace("**", "^")
    best = 0
    power_depth = [0]        # per open brace group: how many powers enclose it
    chain = 0                # powers in the current unbraced chain (a^b^c)
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == "^":
            j = i + 1
            while j < n and text[j].isspace():
                j += 1
            level = power_depth[-1] + chain + 1
            best = max(best, level)
            if j < n and text[j] == "{":
                power_depth.append(level)
                chain = 0
                i = j + 1
                continue
            chain += 1       # an unbraced exponent: one atom, then maybe another ^
            while j < n and (text[j].isalnum() or text[j] in ".\\"):
                j += 1
            k = j
            while k < n and text[k].isspace():
                k += 1
            if k < n and text[k] == "^":
                i = k
            else:
                i, chain = j, 0
            continue
        if char == "{":
            power_depth.append(power_depth[-1])
        elif char == "}" and len(power_depth) > 1:
            power_depth.pop()
        chain = 0
        i += 1
    return best


def _trips(text: str) -> list[str]:
    reasons = []
    if tower_height(text) >= TOWER_HEIGHT:
        reasons.append("tower")
    if _HUGE_EXPONENT.search(text) or any(
            int(base) > 1 and len(power) < 12 and int(power) * math.log10(int(base)) >= HUGE_EXPONENT_DIGITS - 1
            for base, power in _NUMERIC_DOUBLE_POWER.findall(text)):
        reasons.append("huge_exponent")
    if _HUGE_FACTORIAL.search(text):
        reasons.append("huge_factorial")
    return reasons


def screen(pred: str, truths: list[str]) -> str | None:
    """The first screen ``pred`` trips that no ground truth in ``truths`` trips too, or None (grade it)."""
    if len(pred) > max(LONG_ANSWER_CHARS, LONG_ANSWER_RATIO * max(map(len, truths), default=0)):
        return "too_long"
    truth_reasons = {reason for truth in truths for reason in _trips(truth)}
    for reason in _trips(pred):
        if reason not in truth_reasons:
            return reason
    return None
