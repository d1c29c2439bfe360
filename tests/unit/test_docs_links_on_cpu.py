"""Every relative link of the docs resolves: a file or folder that exists, and for ``#anchor`` into a
markdown file, a heading (GitHub's anchor slug) or an explicit ``<a id>`` / ``<a name>`` there.

Scanned: markdown links (inline, images, reference definitions, HTML ``href`` / ``src``) in
README.md and docs/**/*.md, outside code blocks and code spans; and paths named in the comments of
recipes/*.sh and recipes/config/*.yaml and in the module docstrings of benchmarks/*.py: a path under
one of this repository's top folders (``docs/recipes/README.md``; taken from the repository root),
and in a recipe config a sibling config by its bare name (``oar.yaml``). Paths outside this
repository's folders (verl's ``examples/...``) and http(s) links are not checked. Pure Python: no
torch, no verl.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPO_FOLDERS = ("docs", "recipes", "benchmarks", "tests", "scripts", "verl_oar", ".ci")
"""a path in a comment or docstring that starts with one of these is a link into this repository"""
MARKDOWN = ["README.md", "docs/**/*.md"]
COMMENTED = ["recipes/*.sh", "recipes/config/*.yaml"]
DOCSTRINGS = ["benchmarks/*.py"]


# --- GitHub's anchors ------------------------------------------------------------------------------

def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (github-slugger): the rendered text lowercased, every
    character dropped but letters, marks, digits, ``_``, ``-`` and spaces, then spaces -> ``-``."""
    text = re.sub(r"!\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # images -> alt text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links -> their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "").replace("*", "")  # code spans and emphasis markers render as text
    kept = (c for c in text.strip().lower()
            if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc")
    return "".join(kept).replace(" ", "-")


FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((number, line))
    return out


def anchors(markdown: str) -> set[str]:
    """Every anchor of a markdown text: heading slugs (a repeated slug gets -1, -2, ...) and
    explicit ``<a id=...>`` / ``<a name=...>``."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    lines = _prose_lines(markdown)
    for i, (number, line) in enumerate(lines):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m and i + 1 < len(lines) and lines[i + 1][0] == number + 1 and line.strip() \
                and re.match(r"^\s{0,3}(=+|-+)\s*$", lines[i + 1][1]) and not re.match(r"^\s*[-*+>|]", line):
            m = re.match(r"^\s*(.*?)\s*$", line)  # setext heading (text over === or ---)
        if m:
            slug = github_slug(m.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(re.findall(r"<a\s[^>]*?(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", line))
    return found


# --- finding links ---------------------------------------------------------------------------------

INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def markdown_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every link in a markdown text, outside code blocks and code spans."""
    links = []
    for number, line in _prose_lines(text):
        line = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
        for pattern in (INLINE, REFERENCE, HTML):
            links += [(number, target.strip("<>")) for target in pattern.findall(line)]
    return links


PATH = re.compile(r"(?<![\w./{},*-])((?:%s)/[\w./{},*-]*[\w}*/])" % "|".join(re.escape(f) for f in REPO_FOLDERS))
SIBLING_CONFIG = re.compile(r"(?<![\w./{},*-])([\w{},-]+\.yaml)\b")


def _expand(path: str) -> list[str]:
    """``base_{a,b}_{c,d}.yaml`` -> the four names (as a shell would)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for option in m.group(1).split(",") for p in _expand(path[:m.start()] + option + path[m.end():])]


def comment_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the comments of a shell script or YAML file (the text after an unquoted ``#``)."""
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("#!"):
            continue
        quote = None
        for i, c in enumerate(line):
            if quote:
                quote = None if c == quote else quote
            elif c in "\"'":
                quote = c
            elif c == "#" and (i == 0 or line[i - 1].isspace()):
                out.append((number, line[i + 1:]))
                break
    return out


def docstring_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the module docstring of a Python file."""
    module = ast.parse(path.read_text(encoding="utf-8"))
    if not (module.body and isinstance(module.body[0], ast.Expr) and isinstance(module.body[0].value, ast.Constant)
            and isinstance(module.body[0].value.value, str)):
        return []
    first = module.body[0].lineno
    return [(first + i, line) for i, line in enumerate(module.body[0].value.value.splitlines())]


def path_links(lines: list[tuple[int, str]], sibling_configs: bool) -> list[tuple[int, str]]:
    """(line, repo-rooted path) named in comment or docstring text; with ``sibling_configs``, bare
    ``*.yaml`` names too (as ``./name``: resolved next to the file)."""
    links = []
    for number, text in lines:
        for path in PATH.findall(text):
            links += [(number, "/" + p.rstrip(".")) for p in _expand(path)]
        if sibling_configs:
            for name in SIBLING_CONFIG.findall(text):
                links += [(number, "./" + p) for p in _expand(name)]
    return links


# --- checking --------------------------------------------------------------------------------------

def check_link(root: Path, source: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``source``) is dead, or None. A leading ``/`` means the repository
    root (as on GitHub); URLs with a scheme (http:, mailto:, ...) are not checked."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
        return None
    path, _, fragment = target.partition("#")
    path = unquote(path.split("?", 1)[0])
    if not path:
        resolved = source
    elif path.startswith("/"):
        resolved = root / path.lstrip("/")
    else:
        resolved = source.parent / path
    real = resolved.resolve()
    if root.resolve() not in (real, *real.parents):
        return f"{target}: points outside the repository"
    if "*" in path:
        return None if list(root.glob(str(real.relative_to(root.resolve())))) else f"{target}: matches no file"
    if not real.exists():
        return f"{target}: no such file or folder ({real.relative_to(root.resolve())})"
    if fragment and real.suffix.lower() == ".md":
        if unquote(fragment).lower() not in anchors(real.read_text(encoding="utf-8")):
            return f"{target}: no heading with anchor #{fragment} in {real.relative_to(root.resolve())}"
    return None


def links_of(root: Path, source: Path) -> list[tuple[int, str]]:
    rel = source.relative_to(root).as_posix()
    if source.suffix == ".md":
        return markdown_links(source.read_text(encoding="utf-8"))
    if source.suffix == ".py":
        return path_links(docstring_text(source), sibling_configs=False)
    return path_links(comment_text(source), sibling_configs=rel.startswith("recipes/config/"))


def dead_links(root: Path, source: Path) -> list[str]:
    """``file:line: target: why`` for every dead link of ``source``."""
    dead = []
    for number, target in links_of(root, source):
        why = check_link(root, source, target)
        if why:
            dead.append(f"{source.relative_to(root).as_posix()}:{number}: {why}")
    return dead


def sources(root: Path) -> list[Path]:
    return sorted({p for pattern in MARKDOWN + COMMENTED + DOCSTRINGS for p in root.glob(pattern) if p.is_file()})


# --- the tests -------------------------------------------------------------------------------------

SOURCES = sources(ROOT)


def test_the_scan_finds_the_docs_and_their_links():
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"README.md", "docs/README.md", "docs/recipes/README.md", "recipes/launch.sh",
            "recipes/config/oar.yaml", "benchmarks/gpu_scale.py"} <= names
    assert sum(len(links_of(ROOT, p)) for p in SOURCES) > 50


@pytest.mark.parametrize("source", SOURCES, ids=[p.relative_to(ROOT).as_posix() for p in SOURCES])
def test_every_relative_link_resolves(source):
    dead = dead_links(ROOT, source)
    assert not dead, "dead links:\n" + "\n".join(dead)


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("6. Cost and memory measured at the recipes' shapes (one H200)",
         "6-cost-and-memory-measured-at-the-recipes-shapes-one-h200"),
        ("3. Outcome definitions (paper's AS-* ablation)", "3-outcome-definitions-papers-as--ablation"),
        ("Layout and memory (`recipes/config/base_{fsdp2,megatron}.yaml`)",
         "layout-and-memory-recipesconfigbase_fsdp2megatronyaml"),
        ("What **to** compare", "what-to-compare"),
        ("A & B", "a--b"),
        ("[Linked](x.md) heading", "linked-heading"),
        ("Über größe", "über-größe"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def _tree(tmp_path: Path) -> Path:
    """A tiny repository: docs/page.md (two headings, one repeated) and recipes/config/a.yaml."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Set up (one node)\n\ntext\n\n## Set up (one node)\n\nOther\n=====\n\n"
        "<a id=\"custom\"></a>\n```\n# not a heading\n[not](a-link.md)\n```\n", encoding="utf-8")
    (tmp_path / "recipes" / "config").mkdir(parents=True)
    (tmp_path / "recipes" / "config" / "a.yaml").write_text("x: 1\n", encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize(
    ("name", "content", "dead"),
    [
        # markdown: dead file, dead anchor, dead reference definition, dead image, dead HTML link
        ("README.md", "See [the page](docs/missing.md).\n", ["docs/missing.md: no such file"]),
        ("README.md", "See [setup](docs/page.md#set-up-two-nodes).\n", ["no heading with anchor #set-up-two-nodes"]),
        ("README.md", "[ref]: docs/gone.md\n", ["docs/gone.md: no such file"]),
        ("README.md", "![fig](docs/fig.png)\n", ["docs/fig.png: no such file"]),
        ("README.md", '<a href="docs/nope.md">x</a>\n', ["docs/nope.md: no such file"]),
        ("docs/other.md", "[up](../../outside.md)\n", ["points outside the repository"]),
        ("docs/other.md", "[self](#nothing-here)\n", ["no heading with anchor #nothing-here"]),
        # comments of recipes and configs: a moved docs page, a missing sibling config, a brace pattern
        ("recipes/run_x.sh", "#!/usr/bin/env bash\n# Multi-node: see docs/recipes.md.\necho hi\n",
         ["/docs/recipes.md: no such file"]),
        ("recipes/config/b.yaml", "# extends gone.yaml\nx: 1  # and docs/page.md\n", ["./gone.yaml: no such file"]),
        ("recipes/config/c.yaml", "# recipes/config/{a,z}.yaml\n", ["/recipes/config/z.yaml: no such file"]),
        # a benchmark's docstring
        ("benchmarks/b.py", '"""Results: docs/results.md."""\nx = 1\n', ["/docs/results.md: no such file"]),
        # links that resolve (anchors: a repeated heading's -1, setext, explicit <a id>; code is skipped)
        ("README.md", "[a](docs/page.md#set-up-one-node) [b](docs/page.md#set-up-one-node-1) "
                      "[c](docs/page.md#other) [d](docs/page.md#custom) [e](docs/) [f](https://x.invalid/y.md) "
                      "`[g](nowhere.md)`\n\n```\n[h](nowhere.md)\n```\n", []),
        ("recipes/config/d.yaml", "# a.yaml and recipes/config/{a,d}.yaml; verl's examples/x/run.sh\nk: 'v # x.yaml'\n",
         []),
    ],
)
def test_a_dead_link_is_reported(tmp_path, name, content, dead):
    root = _tree(tmp_path)
    source = root / name
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(content, encoding="utf-8")
    found = dead_links(root, source)
    assert len(found) == len(dead), found
    for message, expected in zip(found, dead):
        assert expected in message, found
