"""Markdown helpers shared by the page (render.py) and the parts that write their own tables (gpu_check.py): kept
apart from render.py so that no part has to import the page that imports it."""

from __future__ import annotations


def table(head: str, rows) -> list[str]:
    """A Markdown table: `head` the header cells separated by ' | ', then one line per row of cells."""
    cells = head.split(" | ")
    return ["| " + head + " |", "|" + "---|" * len(cells)] + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def x(v, d=2) -> str:
    return "n/a" if v is None else f"{v:.{d}f}x"


def ms(st) -> str:
    return f"{st['median'] * 1000:,.0f} ms ({st['min'] * 1000:,.0f}-{st['max'] * 1000:,.0f})"


def sec(st, d=3) -> str:
    return f"{st['median']:.{d}f} s ({st['min']:.{d}f}-{st['max']:.{d}f})"


def mb(v) -> str:
    return f"{v:,.0f} MiB"
