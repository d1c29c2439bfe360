"""The files both modes write to ``--out``: ``heatmap_<row>.png`` per response, ``heatmap.html`` with all of
them and ``heatmap.json`` (the report, with the paths of the files under ``files``); drawn by ``heatmap_render``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["View", "write_report"]

View = tuple[list, list, list, str]
"""one response's figure: (score rows, w~ rows, masks, title), each row ``(label, T values)`` as
``heatmap_render.render_png`` takes them"""


def write_report(report: dict, views: Sequence[View], out: Path, wrap: int, page_title: str) -> None:
    """The PNG of each record of ``report["rows"]`` (with its view), the HTML page and the JSON, in ``out``;
    their paths go into ``report["files"]`` before the JSON is written."""
    from verl_oar.tools.heatmap_render import html_block, html_page, render_png

    out.mkdir(parents=True, exist_ok=True)
    pngs, blocks = [], []
    for record, (rows, weights, masks, title) in zip(report["rows"], views, strict=True):
        png = out / f"heatmap_{record['row']}.png"
        render_png(png, record["tokens"], rows, masks, title=title, wrap=wrap, weights=weights)
        blocks.append(html_block(record["tokens"], rows, masks, title, weights=weights, wrap=wrap))
        pngs.append(str(png))
    report["files"] = {"png": pngs, "html": str(out / "heatmap.html"), "json": str(out / "heatmap.json")}
    Path(report["files"]["html"]).write_text(html_page(blocks, page_title), encoding="utf-8")
    Path(report["files"]["json"]).write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
