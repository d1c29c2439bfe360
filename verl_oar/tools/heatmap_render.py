"""Token heatmaps of one response, as a PNG (matplotlib, Agg) or an HTML fragment; no torch.

Inputs are plain lists over the T tokens of a response:

* ``tokens``: the text of each token (``\\n`` is shown as ``⏎``, a tab as ``⇥``; a token made only
  of spaces as ``·``);
* ``rows``: ``(label, scores)`` with T floats each, an importance row; each row is shown on its own
  scale, divided by its maximum over the response (negative and non-finite values show as 0);
* ``weights``: ``(label, w)`` with T floats, token weights (OAR's, CSCR's, OPPO's credit relative to an
  even spread); a diverging scale centred at 1 (blue < 1 suppressed, red > 1 boosted, white = 1 = GRPO's credit);
* ``masks``: ``(label, mask)`` with T bools, drawn as filled (True) or empty (False) boxes.

Tokens are laid out in lines of ``wrap`` tokens; every row of a line sits under its tokens. PNG
text is drawn with ``parse_math=False``, so a ``$`` in a token never starts mathtext; HTML text is
``html.escape``d.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

__all__ = ["NOTE", "PLOT_EXTRA_HINT", "MissingMatplotlib", "display_token", "html_block", "html_page", "normalised",
           "render_png", "require_matplotlib"]

Row = tuple[str, Sequence[float]]
Mask = tuple[str, Sequence[bool]]

NOTE = (
    "score rows: each row / its max over the response (white 0 -> red 1)",
    "w~ rows: token weight (blue < 1 suppressed, white = 1 = GRPO's even credit, red > 1 boosted); masks: filled = true",
)
"""the legend, one line each"""
MAX_TITLE_CHARS = 160
"""PNG title lines are cut here"""
MAX_TOKEN_CHARS = 16
"""longer tokens are cut (with an ellipsis) so that one token cannot widen a whole line"""


PLOT_EXTRA_HINT = "pip install 'verl-oar[plot]'"
"""the fix for a missing matplotlib: it is verl-oar's ``plot`` extra, not a core dependency"""


class MissingMatplotlib(ImportError):
    """matplotlib, which the PNG figures need, is not installed; the message is one line naming the fix."""


def require_matplotlib(what: str = "the PNG heatmaps") -> None:
    """Raise :class:`MissingMatplotlib` unless matplotlib imports. Commands call it at their entry
    point, before any work, and turn it into a one-line exit message instead of a traceback."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise MissingMatplotlib(f"{what} need matplotlib, which is not installed ({err}): {PLOT_EXTRA_HINT}") from err


def display_token(token: str) -> str:
    """The visible form of a token: line breaks and tabs as symbols, other control characters
    escaped, a whitespace-only token as middle dots, at most ``MAX_TOKEN_CHARS`` characters."""
    if token and not token.strip(" "):
        return "·" * min(len(token), MAX_TOKEN_CHARS)
    out = []
    for char in token:
        if char == "\n":
            out.append("⏎")
        elif char == "\t":
            out.append("⇥")
        elif char == "\r":
            out.append("␍")
        elif not char.isprintable() and char != " ":
            out.append(char.encode("unicode_escape").decode("ascii"))
        else:
            out.append(char)
    text = "".join(out) or "∅"  # an empty token (a skipped special token) still gets a cell
    return text if len(text) <= MAX_TOKEN_CHARS else text[: MAX_TOKEN_CHARS - 1] + "…"


def normalised(scores: Sequence[float]) -> list[float]:
    """``scores`` / max(scores), in [0, 1]; negative and non-finite values become 0, an all-zero row stays 0."""
    clean = [float(s) if math.isfinite(float(s)) and float(s) > 0 else 0.0 for s in scores]
    top = max(clean, default=0.0)
    return [s / top if top > 0 else 0.0 for s in clean]


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TITLE_CHARS else text[: MAX_TITLE_CHARS - 1] + "…"


def _check(tokens: Sequence[str], named: Sequence[tuple[str, Sequence]]) -> None:
    for label, values in named:
        if len(values) != len(tokens):
            raise ValueError(f"row {label!r} has {len(values)} values for {len(tokens)} tokens")


def _heat_rgb(v: float) -> tuple[int, int, int]:
    """[0, 1] -> white .. red (HTML)."""
    v = min(max(v, 0.0), 1.0)
    return 255, round(255 - 215 * v), round(255 - 225 * v)


def _weight_rgb(w: float, top: float) -> tuple[int, int, int]:
    """OAR weight -> blue (0) .. white (1) .. red (``top``) (HTML)."""
    if not math.isfinite(w):
        return 200, 200, 200
    if w < 1:
        t = min(max(1.0 - w, 0.0), 1.0)
        return round(255 - 215 * t), round(255 - 155 * t), 255
    return _heat_rgb((w - 1.0) / max(top - 1.0, 1e-12))


def _weight_top(weights: Sequence[Row]) -> float:
    """Upper end of the weight scale: at least 2 (1 + beta at the default beta)."""
    finite = [float(w) for _, ws in weights for w in ws if math.isfinite(float(w))]
    return max([2.0, *finite])


# ---------------------------------------------------------------------------------------------------
# PNG
# ---------------------------------------------------------------------------------------------------

_FONT_PT = 9.0
_CHAR_IN = 0.6 * _FONT_PT / 72          # advance of one monospace character, inches
_ROW_IN = 0.22                          # height of one row, inches
_GAP = 0.4                              # space between token cells, characters


def render_png(
    path,
    tokens: list[str],
    rows: list[tuple[str, list[float]]],
    masks: list[tuple[str, list[bool]]] = (),
    title: str = "",
    wrap: int = 48,
    *,
    weights: list[tuple[str, list[float]]] = (),
) -> None:
    """Write the heatmap of one response to ``path`` (PNG).

    Args:
        tokens: T token texts.
        rows: importance rows, T floats each, each normalised by its own max (stated in the figure).
        masks: T bools each, boxes under the rows.
        title: text above the figure (may hold newlines).
        wrap: tokens per line.
        weights: OAR weight rows, T floats each, on a diverging scale centred at 1.
    """
    require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    _check(tokens, [*rows, *weights, *masks])
    wrap = max(1, int(wrap))
    shown = [display_token(t) for t in tokens]
    heat = [(label, normalised(values)) for label, values in rows]
    w_norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=_weight_top(weights))
    reds, diverging = colormaps["Reds"], colormaps["RdBu_r"]

    labels = ["token", *(l for l, _ in heat), *(l for l, _ in weights), *(l for l, _ in masks)]
    label_chars = math.ceil(max(len(l) for l in labels) * 1.2) + 2  # margin: a glyph can be wider than _CHAR_IN
    lines = [range(i, min(i + wrap, len(tokens))) for i in range(0, len(tokens), wrap)] or [range(0)]
    widths = [len(s) + _GAP for s in shown]
    line_chars = max((sum(widths[i] for i in line) for line in lines), default=10.0)
    per_line = len(labels) + 0.6                             # rows of one line, plus a gap
    head = [_cut(part) for part in title.split("\n")] if title else []
    head += list(NOTE) if weights else list(NOTE[:1])
    height_rows = len(lines) * per_line + len(head) * 1.2 + 0.2
    width_chars = max(label_chars + line_chars + 2, max(len(h) for h in head) * 1.1 + 2)

    fig = Figure(figsize=(width_chars * _CHAR_IN, max(height_rows * _ROW_IN, 1.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-label_chars, width_chars - label_chars)
    ax.set_ylim(height_rows, 0)                              # rows grow downwards
    ax.axis("off")
    text_kw = {"family": "monospace", "fontsize": _FONT_PT, "va": "center", "parse_math": False}

    y = 0.6
    for part in head:
        ax.text(-label_chars + 0.5, y, part, ha="left", **text_kw)
        y += 1.2
    boxes, faces, edges = [], [], []

    def box(x0: float, y0: float, width: float, height: float, face, edge="none") -> None:
        boxes.append(Rectangle((x0, y0), width, height))
        faces.append(face)
        edges.append(edge)

    for line in lines:
        x = 0.0
        for i in line:
            band_y = y
            ax.text(x + widths[i] / 2, band_y + 0.5, shown[i], ha="center", **text_kw)
            band_y += 1
            for _, values in heat:
                box(x, band_y + 0.1, widths[i], 0.8, reds(values[i]))
                band_y += 1
            for _, values in weights:
                w = float(values[i])
                box(x, band_y + 0.1, widths[i], 0.8, diverging(w_norm(w)) if math.isfinite(w) else "lightgrey")
                band_y += 1
            for _, values in masks:
                box(x + _GAP / 2, band_y + 0.2, widths[i] - _GAP, 0.6, "dimgray" if values[i] else "none", "gray")
                band_y += 1
            x += widths[i]
        for k, label in enumerate(labels):
            ax.text(-1, y + k + 0.5, label, ha="right", **text_kw)
        y += per_line
    ax.add_collection(PatchCollection(boxes, facecolors=faces, edgecolors=edges, linewidths=0.5))
    fig.savefig(path, dpi=100, facecolor="white")


# ---------------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------------

_CELL = "padding:0 1px;font-family:monospace;white-space:pre;text-align:center;"
_LABEL = '<td style="font-family:monospace;color:#555;padding-right:6px;text-align:right;">{}</td>'


def _span_row(label: str, shown: Sequence[str], line: range, colours: Sequence, values: Sequence[float]) -> str:
    """A table row of the tokens of ``line`` on their colours, each value as the token's tooltip."""
    tip = html.escape(label)
    cells = "".join(
        f'<td style="{_CELL}"><span style="background:rgb{colours[i]};" title="{tip} = {float(values[i]):.4g}">'
        f"{html.escape(shown[i])}</span></td>"
        for i in line
    )
    return "<tr>" + _LABEL.format(tip) + cells + "</tr>"


def _mask_row(label: str, line: range, values: Sequence[bool]) -> str:
    """A table row of filled (True) or empty (False) boxes."""
    tip = html.escape(label)
    cells = "".join(
        f'<td style="{_CELL}color:#444;" title="{tip} = {bool(values[i])}">{"■" if values[i] else "□"}</td>'
        for i in line
    )
    return "<tr>" + _LABEL.format(tip) + cells + "</tr>"


def html_block(
    tokens: list[str],
    rows: list[tuple[str, list[float]]],
    masks: list[tuple[str, list[bool]]] = (),
    title: str = "",
    *,
    weights: list[tuple[str, list[float]]] = (),
    wrap: int = 48,
) -> str:
    """One response as an HTML fragment (inline styles, no external assets): per line of ``wrap``
    tokens, a table with one row of coloured token spans per score row and weight row (the value is
    the span's tooltip), then one row of boxes per mask. Arguments as :func:`render_png`."""
    _check(tokens, [*rows, *weights, *masks])
    shown = [display_token(t) for t in tokens]
    top = _weight_top(weights)
    coloured = [(label, [_heat_rgb(v) for v in normalised(values)], values) for label, values in rows]
    coloured += [(label, [_weight_rgb(float(w), top) for w in values], values) for label, values in weights]
    parts = ['<div style="margin:1em 0;font-family:sans-serif;">']
    if title:
        parts.append(f'<div style="font-weight:bold;">{html.escape(title).replace(chr(10), "<br>")}</div>')
    note = "; ".join(NOTE if weights else NOTE[:1])
    parts.append(f'<div style="font-size:small;color:#555;">{html.escape(note)}</div>')
    wrap = max(1, int(wrap))
    for start in range(0, max(len(tokens), 1), wrap):
        line = range(start, min(start + wrap, len(tokens)))
        parts.append('<table style="border-collapse:collapse;margin:4px 0;">')
        parts += [_span_row(label, shown, line, colours, values) for label, colours, values in coloured]
        parts += [_mask_row(label, line, values) for label, values in masks]
        parts.append("</table>")
    parts.append("</div>")
    return "\n".join(parts)


def html_page(blocks: list[str], title: str) -> str:
    """A complete HTML page holding ``blocks`` (from :func:`html_block`) under ``title``."""
    head = html.escape(title)
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{head}</title></head>\n'
        f'<body style="font-family:sans-serif;margin:1em;">\n<h2>{head}</h2>\n'
        + "\n<hr>\n".join(blocks)
        + "\n</body></html>\n"
    )
