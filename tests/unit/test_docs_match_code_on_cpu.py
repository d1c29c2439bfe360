"""The docs state what the code does: key tables, recipe counts, the testbed's methods, no outside references.

Checked in README.md and docs/**/*.md against the code they describe:

- ``docs/configuration.md``'s ``algorithm.oar.*`` tables (rows ``| `key` | type | `default` | ...``, between
  "## Keys" and the next ``##`` heading) hold exactly the fields of ``core.config.OARConfig``, with its types
  and defaults; each ``docs/algo/<method>.md`` "## Keys" table holds exactly the fields of that method's
  config dataclass (OPPO's ``teacher`` mapping as ``teacher.<key>``), with its defaults (templates excepted:
  the page words them).
- Recipe counts. One way to write one: a number (digits or words, "29" or "Twenty-nine"), at most one
  qualifier (a model, engine or estimator, or "grid": model x estimator x engine; ``_recipe_qualifiers``), then
  "recipes": "29 recipes", "the 28 grid recipes", "the 8 OAR recipes", "the 15 1.5B recipes", "(all 29 recipes)". Every such count must equal what ``recipes/`` holds; an unknown qualifier
  fails, naming the known ones.
- No doc points outside the repository: no "issue <number>", "the issue", "issue's" and no ``../shared``
  (the repository must read on its own).
- A doc that lists the testbed's methods writes them after "one entry each:" as the labels of
  ``verl_oar.testbed.methods.METHODS``, comma-separated, in its order (the list ends at ";" or ")").
- The default demo's steps (any "N steps" in README's demo section, "the demo runs N steps", "Demo budget: ...
  x N steps") equal ``testbed.training_runs.RunSettings.steps``.

Pure Python plus the package imports (torch through ``verl_oar.core``): no model, no verl trainer; the import is
most of its few seconds.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a markdown file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


# --- (a) key tables ----------------------------------------------------------------------------------

def _key_rows(path: Path, start: str, end: str = r"^## ") -> dict[str, list[str]]:
    """`key` -> its row's cells, for table rows between the heading matching ``start`` and the next ``end``."""
    rows: dict[str, list[str]] = {}
    inside = False
    for _, line in _prose(path):
        if re.match(start, line):
            inside = True
            continue
        if inside and re.match(end, line):
            break
        match = re.match(r"^\|\s*`([A-Za-z_][\w.]*)`\s*\|", line)
        if inside and match:
            assert match.group(1) not in rows, f"{_rel(path)}: key `{match.group(1)}` has two rows"
            rows[match.group(1)] = [cell.strip() for cell in line.strip().strip("|").split("|")]
    return rows


def _doc_value(cell: str) -> str:
    """A table cell's value: the first code span's content, else the cell ("0.8", "true", "none")."""
    code = re.search(r"`([^`]*)`", cell)
    return (code.group(1) if code else cell).strip()


def _matches(doc: str, value: object) -> bool:
    """Whether a doc's default ``doc`` writes the code's ``value``."""
    if value is None:
        return doc.lower() == "none"
    if isinstance(value, bool):
        return doc.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(doc) == float(value)
        except ValueError:
            return False
    if value == "":
        return doc in ('""', "''")
    return doc == value


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def test_configuration_oar_table_is_oar_config() -> None:
    from verl_oar.core.config import OARConfig

    rows = _key_rows(ROOT / "docs/configuration.md", r"^## Keys")
    fields = _fields(OARConfig)
    hints = typing.get_type_hints(OARConfig)
    assert sorted(rows) == sorted(fields), (
        f"docs/configuration.md's algorithm.oar tables: missing {sorted(set(fields) - set(rows))}, "
        f"not in OARConfig {sorted(set(rows) - set(fields))}")
    for key, field in fields.items():
        _, kind, default = rows[key][:3]
        assert kind == hints[key].__name__, f"docs/configuration.md `{key}`: type {kind}, code {hints[key].__name__}"
        assert _matches(_doc_value(default), field.default), (
            f"docs/configuration.md `{key}`: default {default}, OARConfig {field.default!r}")


def _estimator_configs() -> dict[str, tuple[type, dict[str, object]]]:
    """docs/algo page -> (its config dataclass, the expected key -> default)."""
    from verl_oar.core.acpo import ACPOConfig
    from verl_oar.core.codapo import CoDaPOConfig
    from verl_oar.core.cscr import CSCRConfig
    from verl_oar.core.oppo import TEACHER_KEYS, OPPOConfig

    out = {}
    for page, cls in (("acpo", ACPOConfig), ("codapo", CoDaPOConfig), ("cscr", CSCRConfig), ("oppo", OPPOConfig)):
        expected: dict[str, object] = {}
        for name, field in _fields(cls).items():
            if name == "teacher" and cls is OPPOConfig:
                expected.update({f"teacher.{key}": None for key in TEACHER_KEYS})
            else:
                expected[name] = field.default
        out[page] = (cls, expected)
    return out


@pytest.mark.parametrize("page", ["acpo", "codapo", "cscr", "oppo"])
def test_algo_key_tables_are_the_config_dataclasses(page: str) -> None:
    cls, expected = _estimator_configs()[page]
    path = ROOT / "docs/algo" / f"{page}.md"
    rows = _key_rows(path, r"^## Keys")
    assert sorted(rows) == sorted(expected), (
        f"{_rel(path)} '## Keys': missing {sorted(set(expected) - set(rows))}, "
        f"not in {cls.__name__} {sorted(set(rows) - set(expected))}")
    for key, value in expected.items():
        if isinstance(value, str) and "{" in value:
            continue  # a prompt template: the page words it
        assert _matches(_doc_value(rows[key][1]), value), (
            f"{_rel(path)} `{key}`: default {rows[key][1]}, {cls.__name__} {value!r}")


# --- (b) recipe counts -------------------------------------------------------------------------------

def _recipes() -> list[str]:
    return sorted(p.name[len("run_"):-len(".sh")] for p in (ROOT / "recipes").glob("run_*.sh"))


def _recipe_qualifiers() -> dict[str, int]:
    """qualifier (lower case; "" = none) -> how many recipes it names, counted from ``recipes/``."""
    names = _recipes()
    per = {m: sum(1 for n in names if re.search(rf"_{m}(_megatron|_teacher)?$", n))
           for m in ("grpo", "oar_g", "oar_p", "cscr", "oppo", "acpo", "codapo")}
    return {
        "": len(names),
        "grid": sum(1 for n in names if not n.endswith("_teacher")),  # model x estimator x engine
        "1.5b": sum(1 for n in names if "_1_5b_" in n), "7b": sum(1 for n in names if "_7b_" in n),
        "megatron": sum(1 for n in names if n.endswith("_megatron")),
        "fsdp2": sum(1 for n in names if not n.endswith("_megatron")),
        "oar": per["oar_g"] + per["oar_p"],
        "oar-g": per["oar_g"], "oar-p": per["oar_p"], "grpo": per["grpo"], "cscr": per["cscr"],
        "oppo": per["oppo"], "acpo": per["acpo"], "codapo": per["codapo"],
    }


_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50}
_NUMBER = (r"\d+|(?:" + "|".join(_TENS) + r")(?:-(?:" + "|".join(w for w in _WORDS if _WORDS[w] < 10) + r"))?|"
           + "|".join(sorted(_WORDS, key=len, reverse=True)))
RECIPE_COUNT = re.compile(rf"\b({_NUMBER})\s+(?:([\w.-]+)\s+)?recipes\b(?!/|\.\w|[\w-])", re.IGNORECASE)
"""a count: a number, at most one qualifier, "recipes" (not a path such as ``recipes/run_...``)"""


def _number(text: str) -> int:
    text = text.lower()
    if text.isdigit():
        return int(text)
    tens, _, units = text.partition("-")
    return _TENS[tens] + (_WORDS[units] if units else 0) if tens in _TENS else _WORDS[tens]


def recipe_counts(path: Path) -> list[tuple[int, str, int, str]]:
    """(line, qualifier, stated count, the words) of every recipe count in a doc, code blocks included."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in RECIPE_COUNT.finditer(line):
            found.append((number, (match.group(2) or "").lower(), _number(match.group(1)), match.group(0)))
    return found


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_recipe_counts_are_the_recipes(path: Path) -> None:
    actual = _recipe_qualifiers()
    wrong = []
    for line, qualifier, stated, words in recipe_counts(path):
        if qualifier not in actual:
            wrong.append(f"line {line}: '{words}': unknown qualifier '{qualifier}' (write one of "
                         f"{sorted(q for q in actual if q)} or none, or add it to _recipe_qualifiers)")
        elif stated != actual[qualifier]:
            wrong.append(f"line {line}: '{words}' but recipes/ holds {actual[qualifier]}")
    assert not wrong, f"{_rel(path)}: " + "; ".join(wrong)


# --- (c) no references outside the repository --------------------------------------------------------

OUTSIDE = re.compile(r"\bissue\s*#?\d+|\bthe issue\b|\bissue's\b|\.\./shared\b|/work/shared", re.IGNORECASE)


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_no_reference_outside_the_repository(path: Path) -> None:
    hits = [f"line {n}: {m.group(0)!r}" for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for m in OUTSIDE.finditer(line)]
    assert not hits, (f"{_rel(path)} refers to something outside the repository ({'; '.join(hits)}): "
                      "state the fact itself (what was asked, measured or known) instead")


# --- (d) the testbed's methods -------------------------------------------------------------------------

METHOD_LIST = re.compile(r"one entry each:\s*([^;)]*)")


def test_the_method_list_pattern_reads_a_list() -> None:
    match = METHOD_LIST.search("(one entry each: GRPO, OAR-G x CoDaPO; the default ...")
    assert match and [s.strip() for s in match.group(1).split(",")] == ["GRPO", "OAR-G x CoDaPO"]


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_testbed_method_lists_are_methods(path: Path) -> None:
    from verl_oar.testbed.methods import METHODS

    labels = [m.label for m in METHODS.values()]
    for number, line in _prose(path):
        for match in METHOD_LIST.finditer(line):
            listed = [item.strip() for item in match.group(1).split(",") if item.strip()]
            assert listed == labels, (
                f"{_rel(path)} line {number} lists the testbed's methods as {listed}; "
                f"verl_oar/testbed/methods.py METHODS: {', '.join(labels)}")


def test_recipe_count_reader() -> None:
    """The count reader on the forms the docs use (and a word-number)."""
    assert RECIPE_COUNT.search("Twenty-nine recipes in").group(1) == "Twenty-nine"
    assert _number("Twenty-nine") == 29 and _number("eight") == 8 and _number("28") == 28
    assert RECIPE_COUNT.search("the 28 grid recipes").group(2) == "grid"
    assert RECIPE_COUNT.search("(all 29 recipes)").group(2) is None
    assert RECIPE_COUNT.search("The 15 1.5B recipes.").group(2) == "1.5B"
    assert RECIPE_COUNT.search("NNODES=2 RAY_ADDRESS=http://<head>:8265 bash recipes/run_x.sh") is None


# --- the demo's default steps and methods -------------------------------------------------------------

def _demo_claims(path: Path) -> list[tuple[int, int]]:
    """(line, steps) of every statement of the default demo's steps: "N steps" anywhere in README.md's section
    whose heading names the demo (its text joined over line breaks), "the demo runs N steps" and "Demo budget:
    ... x N steps" anywhere."""
    found = []
    lines = path.read_text(encoding="utf-8").splitlines()
    section = None
    for number, line in enumerate(lines, 1):
        if line.startswith("#"):
            section = line.lower()
        text = line + " " + (lines[number] if number < len(lines) else "")
        if path.name == "README.md" and path.parent == ROOT and section and "demo" in section:
            found += [(number, int(m.group(1))) for m in re.finditer(r"\b(\d+) steps\b", line)]
        found += [(number, int(m.group(1))) for m in re.finditer(r"the demo runs (\d+) steps", text, re.IGNORECASE)]
        found += [(number, int(m.group(1))) for m in re.finditer(r"Demo budget\*?\*?:[^|]*? x (\d+) steps", line)]
    return sorted(set(found))


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_the_demo_default_steps_are_run_settings(path: Path) -> None:
    from verl_oar.testbed.training_runs import RunSettings

    wrong = [f"line {n}: {steps} steps" for n, steps in _demo_claims(path) if steps != RunSettings.steps]
    assert not wrong, (f"{_rel(path)} states the default demo's steps as {'; '.join(wrong)}; "
                       f"verl_oar/testbed/training_runs.py RunSettings.steps = {RunSettings.steps}")


def test_the_demo_claims_reader_finds_the_forms() -> None:
    assert re.search(r"Demo budget\*?\*?:[^|]*? x (\d+) steps", "5. **Demo budget**: 1 seed x 3 methods (GRPO) x 10 "
                     "steps (validation").group(1) == "10"


def test_configuration_math_reward_table_is_the_rewards_defaults() -> None:
    """docs/configuration.md's math-reward table: every keyword ``compute_score`` and the trainer read, their types
    and defaults (``verify_workers``' default depends on the machine's cores: its cell says so)."""
    import inspect

    from verl_oar.integration.grading import MAX_UNGRADED_FRAC
    from verl_oar.rewards.math_reward import compute_score

    rows = _key_rows(ROOT / "docs/configuration.md", r"^## The math reward")
    params = inspect.signature(compute_score).parameters
    expected = {name: params[name].default for name in ("timeout_s", "queue_timeout_s", "verify_workers")}
    expected["max_ungraded_frac"] = MAX_UNGRADED_FRAC
    assert sorted(rows) == sorted(expected), sorted(rows)
    for key, default in expected.items():
        cell = _doc_value(rows[key][2])
        if key == "verify_workers":
            assert cell == "min(4, cores)", cell
        else:
            assert _matches(cell, default), f"docs/configuration.md `{key}`: default {cell}, code {default!r}"
