"""The benchmarks' table formatter: ``grid`` (a Markdown pipe table with padded columns) and
``num``, shared with the command line's end-of-run tables (``sparsetrain.launch.report``)."""

from __future__ import annotations

from sparsetrain.launch.report import grid, num

__all__ = ["grid", "num"]
