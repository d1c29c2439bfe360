"""pick_max variants where credit assignment is the bottleneck: many more filler tokens per pick.

On the committed start (2 filler words per gap: 26 non-causal reasoning tokens for 2 picks) every method
reaches 0.9-1.0 held-out accuracy within ~12 steps, so broadcasting one advantage over a response costs
little. The variants keep the task, the reward, the model's shape and the warm start's recipe, and put
more filler words in every gap (``filler_words``; ``word_length`` stays 3), so that a broadcast advantage
lands on ever more tokens the reward does not depend on:

=========  ============  =====================  =====================  ==============================
variant    filler words  non-causal tokens      response tokens        folder
           per gap       per response (x fill2) (max_response_tokens)
=========  ============  =====================  =====================  ==============================
fill2      2             26 (1x)                55                     ``testbed/start`` (the start)
fill8      8             98 (3.8x)              127                    ``testbed/variants/fill8``
fill32     32            386 (14.8x)            415                    ``testbed/variants/fill32``
fill64     64            770 (29.6x)            799                    ``testbed/variants/fill64``
=========  ============  =====================  =====================  ==============================

Each committed folder has the layout of ``testbed/start`` (model, data, reward.py, testbed.json; no OPPO
teacher: ``python -m verl_oar.testbed.teacher DIR`` builds one) and was built by ONE command::

    python -m verl_oar.testbed.variants fill8     # or fill32; --out DIR to build elsewhere, --force to rebuild

(one torch thread, as the start; ``fill2`` is the start itself, built by ``python -m verl_oar.testbed.workspace``).
Every existing consumer takes the folder: ``python -m verl_oar.testbed.demo --testbed DIR``, ``quality
--testbed DIR``, ``training_runs`` through a :class:`~verl_oar.testbed.workspace.Testbed`, the fast runner's
``--testbed DIR``; :func:`load_variant` also checks that the folder was built from the variant's spec. The
prompts (train and held-out) are the start's: the digits do not depend on the filler settings.

The longer variants' warm starts begin from the start's model (``TestbedSpec.init_from``; fill64's from fill32's,
``Variant.starts_from``: from the start's, three budgets never learnt to copy across 385 filler tokens), which already
picks and copies: from a fresh model, 1000 steps of 32 on fill8 still copied its picks into the answer 19% of
the time (~0.17 s/step alone); from the start, 600 steps did 100%. At the build, on 64 held-out prompts
(``testbed.json``; 2 cores of an AMD EPYC shared with other jobs, so the seconds are upper bounds):

=========  ======================  =======  ======  =======  ======  ===========  ====  ======
variant    warm start              sampled  greedy  answers  copies  filler ent.  data  build s
=========  ======================  =======  ======  =======  ======  ===========  ====  ======
fill2      4000 x 32, fresh        0.36     0.41    1.00     1.00    1.87         2.02  296
fill8      1000 x 32, from start   0.375    0.34    1.00     1.00    2.08         2.06  373
fill32     2400 x 16, from start   0.56     0.44    1.00     1.00    2.12         2.07  1256
fill64     2400 x 16, from fill32  0.36     0.44    1.00     0.98    2.10         2.08  1778
=========  ======================  =======  ======  =======  ======  ===========  ====  ======

("data": :func:`data_filler_entropy`, what a model that learnt the data exactly shows). On all 200 held-out
prompts, two sampling seeds, the three start alike: sampled 0.50-0.54 / 0.48-0.55 / 0.53-0.57, greedy 0.465 /
0.475 / 0.495 (the 64-prompt figures of fill2 and fill8 are on the low side). fill32's warm start of 1500 x 32
(same cost) sampled well but its greedy decoding lost count of the repeated-letter words after the first pick and
never ended (greedy accuracy 0): 2400 x 16 gave a steady greedy path from ~1200 steps on (probe: 0.34-0.39).
Alone on one core the fill32 build takes ~14 minutes (0.34 s/step at batch 16); 1256 s under load.

Per variant, only what the length needs changes: ``max_position_embeddings`` holds the longest prompt
plus response (``workspace.check_spec`` refuses a spec that does not), and the warm-start budget (steps,
batch) is chosen so that one build takes at most ~15 minutes on one core while the model still learns
the format; ``pick_max_prob`` keeps the start's sampled accuracy in ~0.3-0.45.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from verl_oar.testbed.workspace import (
    COMMITTED,
    MANIFEST,
    Testbed,
    TestbedSpec,
    build_testbed,
    check_spec,
    max_response_tokens,
)

__all__ = ["VARIANTS", "Variant", "build_variant", "data_filler_entropy", "filler_tokens", "load_variant", "variant"]

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Variant:
    """A named pick_max testbed: the spec its folder is built from, and the folder."""

    name: str
    spec: TestbedSpec
    directory: Path
    why: str
    starts_from: str = "fill2"
    """the variant whose built model the warm start begins from (``spec.init_from`` is its fingerprint)"""

    @property
    def build_command(self) -> str:
        if self.directory == COMMITTED:
            start = COMMITTED.relative_to(HERE.parents[2])
            return f"OMP_NUM_THREADS=1 python -m verl_oar.testbed.workspace {start} --force"
        return f"python -m verl_oar.testbed.variants {self.name} --force"


START = TestbedSpec()
"""the committed start's spec (``fill2``); the longer variants' warm starts begin from its model"""


def _variant(name: str, why: str, starts_from: Variant | None = None, **changes) -> Variant:
    """``starts_from``: the variant whose model the warm start begins from (default: the committed start)."""
    if changes:
        changes["init_from"] = (starts_from.spec if starts_from is not None else START).fingerprint()
    spec = replace(START, **changes)
    check_spec(spec)
    return Variant(name, spec, COMMITTED if not changes else HERE / name, why,
                   starts_from.name if starts_from is not None else "fill2")


_FILL32 = _variant("fill32", "32 filler words per gap: 193 non-causal tokens per pick",
                   filler_words=32, max_position_embeddings=512, warm_start_steps=2400, warm_start_batch_size=16)
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        _variant("fill2", "the committed start: 2 filler words per gap, 13 non-causal tokens per pick"),
        _variant("fill8", "8 filler words per gap: 49 non-causal tokens per pick", filler_words=8,
                 warm_start_steps=1000),
        _FILL32,
        # from fill32's model: three builds from the start's (2400, 4800 and 9600 x 16) failed the gate (the picks
        # copied into the answer 0.10, 0.45, 0.02 of the time; benchmarks/results_fill64_builds_cpu.json)
        _variant("fill64", "64 filler words per gap: 385 non-causal tokens per pick", _FILL32, filler_words=64,
                 max_position_embeddings=1024, warm_start_steps=2400, warm_start_batch_size=16),
    )
}
"""every variant by name, shortest first"""


def variant(name: str) -> Variant:
    """The variant called ``name``; a clear error naming the known ones otherwise."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"no pick_max variant {name!r}; known: {', '.join(VARIANTS)}") from None


def load_variant(name: str, directory: str | Path | None = None) -> Testbed:
    """The built testbed of variant ``name`` (its committed folder, or ``directory``), checked against the
    variant's spec by fingerprint; a clear error with the build command when it is missing or stale."""
    from verl_oar.cpu.workspace import read_manifest

    v = variant(name)
    root = Path(directory).expanduser().resolve() if directory is not None else v.directory
    manifest = read_manifest(root, MANIFEST)
    expected = v.spec.fingerprint()
    if manifest is None or manifest.get("fingerprint") != expected:
        found = "nothing" if manifest is None else f"fingerprint {manifest.get('fingerprint')}"
        command = v.build_command if directory is None else f"python -m verl_oar.testbed.variants {name} --out {root}"
        raise FileNotFoundError(f"variant {name}: {root} holds {found}, not a build of its spec (fingerprint "
                                f"{expected}); build it: {command}")
    return Testbed(root, manifest)


def build_variant(name: str, directory: str | Path | None = None, *, force: bool = False) -> Testbed:
    """Build variant ``name`` into its folder (or ``directory``); reuses a build with the same fingerprint."""
    v = variant(name)
    init = load_variant(v.starts_from) if v.spec.init_from and v.starts_from != "fill2" else None
    return build_testbed(v.directory if directory is None else directory, v.spec, force=force, init=init)


def filler_tokens(spec: TestbedSpec) -> int:
    """Non-causal reasoning tokens of a warm-start response (byte tokenizer: one per character): the
    letters and spaces of every gap, and the space after each pick."""
    return (spec.pairs + 1) * spec.filler_words * (spec.word_length + 1) + spec.pairs


def data_filler_entropy(spec: TestbedSpec) -> float:
    """Entropy (nats) of the warm-start data's own next-token distribution, averaged over the non-causal
    reasoning tokens of a response: what a model that learnt the data exactly would show as
    ``filler_entropy``. Spaces are certain; a gap's first letter is uniform (ln 26); a later letter is
    uniform once the gap has shown two different letters, else a mixture of "the gap's letter again"
    (the posterior that the gap is a repeated one, ``filler_repeat_prob`` a priori) and uniform."""
    r, letters, k26 = spec.filler_repeat_prob, spec.filler_words * spec.word_length, 26.0
    per_gap = 0.0
    for k in range(1, letters + 1):
        if k == 1 or r == 0.0:
            per_gap += math.log(k26)
            continue
        all_same = r + (1 - r) * k26 ** -(k - 2)  # P(the gap's first k-1 letters are one letter)
        repeat = r / all_same                     # posterior that the gap repeats it
        same, other = repeat + (1 - repeat) / k26, (1 - repeat) / k26
        mixed = -same * math.log(same) - (k26 - 1) * other * math.log(other) if other > 0 else 0.0
        per_gap += all_same * mixed + (1 - all_same) * math.log(k26)
    return (spec.pairs + 1) * per_gap / filler_tokens(spec)


def describe(v: Variant) -> dict:
    """Spec facts of a variant (no build needed)."""
    return {"name": v.name, "directory": str(v.directory), "why": v.why, "filler_words": v.spec.filler_words,
            "pairs": v.spec.pairs, "filler_tokens": filler_tokens(v.spec),
            "max_response_tokens": max_response_tokens(v.spec),
            "max_position_embeddings": v.spec.max_position_embeddings,
            "data_filler_entropy": round(data_filler_entropy(v.spec), 4),
            "warm_start": f"{v.spec.warm_start_steps} x {v.spec.warm_start_batch_size}",
            "fingerprint": v.spec.fingerprint(), "build": v.build_command}
