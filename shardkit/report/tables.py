"""Tables that fit the terminal: short numbers, whole names, columns chosen by width.

Every table the command line prints is built here from ``Column``s: names (recipes,
meshes, paths) are never cut; numbers are short (``1.4G``, ``654M``: binary prefixes, the
unit in the title); columns are added in priority order while the table fits the width,
and those left out are named in the caption (``--wide`` shows every column).

Example:
  >>> rows = [{"recipe": "dp_tsp_gspmd", "bytes": 1.4 * 2**30}, {"recipe": "fsdp", "bytes": 654 * 2**20}]
  >>> table = fit_table(
  ...     [Column("recipe", lambda r: r["recipe"], keep=True),
  ...      Column("total", lambda r: short_bytes(r["bytes"]))],
  ...     rows, width=80)
  >>> print(to_lines(table, 80)[2:])
  ['dp_tsp_gspmd   1.4G', 'fsdp           654M']
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

__all__ = [
    "BYTES",
    "Column",
    "fit_table",
    "print_table",
    "short_bytes",
    "short_seconds",
    "spec_text",
    "table_width",
    "to_lines",
]

#: What the short byte counts mean, for a table's title.
BYTES = "K/M/G = KiB/MiB/GiB"


def short_bytes(n: float | None) -> str:
    """``n`` bytes in at most four characters, binary prefixes: ``'1.4G'``, ``'654M'``.

    Example:
      >>> [short_bytes(x) for x in (512, 1000, 1536, 654 * 2**20, 1.43 * 2**30, None)]
      ['512', '1.0K', '1.5K', '654M', '1.4G', '–']
    """
    if n is None:
        return "–"
    sign, n = ("-" if n < 0 else ""), abs(float(n))
    if n < 1000:
        return f"{sign}{n:.0f}"
    for unit in "KMGTPE":
        n /= 1024
        if n < 9.95:
            return f"{sign}{n:.1f}{unit}"
        if n < 999.5 or unit == "E":
            return f"{sign}{n:.0f}{unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def short_seconds(s: float) -> str:
    """``s`` seconds in a few characters: ``'1.2s'``, ``'35ms'``, ``'4.1µs'``.

    Example:
      >>> [short_seconds(x) for x in (1.234, 0.0352, 4.1e-6, 125.0)]
      ['1.23s', '35.2ms', '4.1µs', '125s']
    """
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= size:
            return f"{s / size:.3g}{unit}"
    return f"{s * 1e9:.3g}ns"


def spec_text(mesh_axes: Iterable[Sequence[str]]) -> str:
    """A ``PartitionSpec`` on one line: per dimension its mesh axes (``+`` between two),
    ``·`` for a dimension not split.

    Example:
      >>> spec_text([(), ("fsdp",), (), ("tensor",), ()])
      '·,fsdp,·,tensor,·'
      >>> spec_text([("data", "fsdp"), ()])
      'data+fsdp,·'
      >>> spec_text([])
      'P()'
    """
    parts = ["+".join(axes) if axes else "·" for axes in mesh_axes]
    return ",".join(parts) if parts else "P()"


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: its header, how a row fills its cell, and whether it is a name.

    ``keep`` columns (names: recipe, mesh, path) are always shown, whole; the others are
    shown in ``priority`` order (lower first, then their order) while the table fits.
    """

    header: str
    cell: Callable[[Any], str]
    keep: bool = False
    priority: int = 0
    #: default: names to the left, numbers to the right
    justify: Literal["left", "right", "center"] | None = None

    def __post_init__(self) -> None:
        if self.justify is None:
            object.__setattr__(self, "justify", "left" if self.keep else "right")


def _table(
    columns: Sequence[Column],
    cells: Sequence[Sequence[str]],
    title: str | None,
    caption: str | None,
) -> Table:
    table = Table(
        title=title,
        caption=caption,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
        title_justify="left",
        caption_justify="left",
    )
    for c in columns:
        table.add_column(c.header, justify=c.justify, no_wrap=True)
    for row in cells:
        table.add_row(*row)
    return table


def table_width(table: Table) -> int:
    """The columns ``table`` takes printed whole (its widest line)."""
    console = Console(width=10_000, file=io.StringIO())
    return Measurement.get(console, console.options, table).maximum


def fit_table(
    columns: Sequence[Column],
    rows: Iterable[Any],
    *,
    width: int,
    wide: bool = False,
    title: str | None = None,
    caption: str | None = None,
) -> Table:
    """A table of ``rows`` with the columns that fit ``width`` (all of them if ``wide``).

    Names (``keep`` columns) are always shown whole; the caption names the columns left
    out and how to see them (``--wide``).
    """
    rows = list(rows)
    cells = [[c.cell(r) for c in columns] for r in rows]
    chosen = [i for i, c in enumerate(columns) if c.keep or wide]
    order = sorted(
        (i for i, c in enumerate(columns) if i not in chosen), key=lambda i: columns[i].priority
    )
    for i in order:  # the most important first; a wide one left out may let a narrow one in
        trial = sorted([*chosen, i])
        table = _table(
            [columns[j] for j in trial], [[r[j] for j in trial] for r in cells], None, None
        )
        if table_width(table) <= width:
            chosen = trial
    left_out = [columns[i].header for i in range(len(columns)) if i not in chosen]
    notes = [caption] if caption else []
    if left_out:
        notes.append(f"--wide adds: {', '.join(left_out)}")
    return _table(
        [columns[i] for i in chosen],
        [[r[i] for i in chosen] for r in cells],
        title,
        "\n".join(notes) or None,
    )


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` without cutting a cell: wider than the console, it runs over (as
    ``--wide`` asks) instead of wrapping or cropping names."""
    needed = table_width(table)
    if needed <= console.width:
        console.print(table)
        return
    narrow = console.width
    console.width = needed  # rich renders no wider than its console
    try:
        console.print(table, crop=False)
    finally:
        console.width = narrow


def to_lines(table: Table, width: int) -> list[str]:
    """``table`` as plain text lines at ``width`` columns (trailing blanks stripped)."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    print_table(console, table)
    return [line.rstrip() for line in buffer.getvalue().splitlines()]
