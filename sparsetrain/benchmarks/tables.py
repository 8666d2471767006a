"""The one table formatter of the benchmarks and ``make run``: a Markdown pipe table with
columns padded to their width, readable as plain text and pasteable into the docs."""

from __future__ import annotations

from collections.abc import Sequence


def grid(columns: Sequence[str], rows: Sequence[Sequence], right: Sequence[bool] | None = None) -> str:
    """``columns`` and ``rows`` (cells as str, or anything ``str()`` turns into one) as a Markdown
    table. ``right``: right-align this column (default: every column but the first)."""
    cells = [[str(c) for c in columns]] + [["" if v is None else str(v) for v in row] for row in rows]
    for row in cells[1:]:
        if len(row) != len(columns):
            raise ValueError(f"row of {len(row)} cells for {len(columns)} columns: {row}")
    right = list(right) if right is not None else [i > 0 for i in range(len(columns))]
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(len(columns))]

    def line(row):
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w)
                                 for c, w, r in zip(row, widths, right)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if r else ("-" * (w + 2))
                          for w, r in zip(widths, right)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def num(value, digits: int = 1) -> str:
    """A number with ``digits`` decimals; '-' for None / NaN."""
    if value is None or value != value:
        return "-"
    return f"{value:.{digits}f}"
