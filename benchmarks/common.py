"""What every benchmark shares: its ``python -m`` entry point and its text table.

A benchmark module exposes ``configure(parser)`` and ``run(args) -> int``
(``star bench NAME`` calls them) and, for ``python -m benchmarks.NAME``::

    def main(argv: Sequence[str] | None = None) -> int:
        return bench_main("benchmarks.NAME", configure, run, __doc__, argv)

Its table, rows of strings with the titles first, is :func:`text_table`'s.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def summary(doc: str | None) -> str | None:
    """The first paragraph of a module's docstring (its ``--help`` description)."""
    return doc.strip().split("\n\n")[0] if doc else None


def bench_main(
    module: str,
    configure: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    doc: str | None,
    argv: Sequence[str] | None = None,
) -> int:
    """``python -m MODULE``: its parser (``configure``), then ``run``; the exit status."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=summary(doc))
    configure(parser)
    return int(run(parser.parse_args(argv)))


def text_table(
    rows: Sequence[Sequence[object]], *, left: int = 0, rule: bool = False, indent: str = ""
) -> str:
    """``rows`` (the titles first) as columns two spaces apart.

    The first ``left`` columns are aligned left, the others right; ``rule``
    draws a line of dashes under the titles; each line starts with ``indent``
    and ends without spaces.
    """
    cells = [[str(c) for c in row] for row in rows]
    widths = [
        max((len(row[i]) for row in cells if i < len(row)), default=0)
        for i in range(max(map(len, cells), default=0))
    ]
    lines = [
        indent
        + "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=False))
        ).rstrip()
        for row in cells
    ]
    if rule and lines:
        lines.insert(1, indent + "-" * (len(lines[0]) - len(indent)))
    return "\n".join(lines)
