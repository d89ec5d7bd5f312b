"""The one table writer of the benchmark's report: a table is a title, column specs, rows and a
legend, and every table of the report is written by `table`."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Callable, Mapping, Sequence

WIDTH = 100  # the width of the legend lines


def ratio(value: float | None) -> str:
  """A ratio with 2 decimals below 10, 1 decimal from 10 on; '-' when missing."""
  if value is None:
    return "-"
  return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def ms(seconds: float | None) -> str:
  """Seconds as milliseconds with 1 decimal; '-' when missing."""
  return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def fixed(digits: int, scale: float = 1.0) -> Callable[[float], str]:
  """`value * scale` with `digits` decimals."""
  return lambda value: f"{value * scale:.{digits}f}"


def percent(value: float) -> str:
  return f"{value:.0%}"


def shape(dims: Sequence[int]) -> str:
  """`[S, C]` as `SxC`."""
  return "x".join(map(str, dims))


@dataclasses.dataclass(frozen=True)
class Column:
  """One column: its header, its width, how to read a row's value, how to write it.

  Attributes:
    header: the column's title.
    width: the characters of the column (values are padded to it).
    value: `row -> value`.
    fmt: `value -> text` (default: `ratio`).
    align: ">" (right, numbers) or "<" (left, names).
  """
  header: str
  width: int
  value: Callable[[Mapping], Any]
  fmt: Callable[[Any], str] = ratio
  align: str = ">"

  def cell(self, row: Mapping) -> str:
    return f"{self.fmt(self.value(row)):{self.align}{self.width}}"


def field(header: str, width: int, *keys: str, fmt: Callable[[Any], str] = str,
          align: str = ">") -> Column:
  """A column of `row[keys[0]][keys[1]]...` (a missing key reads as None)."""
  def value(row):
    for key in keys:
      row = row.get(key) if isinstance(row, Mapping) else None
    return row
  return Column(header, width, value, fmt, align)


def table(title: Sequence[str], columns: Sequence[Column], rows: Sequence[Mapping],
          legend: str | Sequence[str], *, label: Callable[[Mapping], str] | None = None,
          wrap_title: bool = False) -> list[str]:
  """One table of the report, as lines, the last one empty.

  Args:
    title: the title's lines (`wrap_title`: one text, wrapped to `WIDTH`).
    columns: the columns, joined by one space.
    rows: one line per row; a row with `skipped` is the line `label(row) skipped: reason`.
    legend: a paragraph (or several), each wrapped to `WIDTH`, after the rows.
    label: names a skipped row (default: its first column's cell).
    wrap_title: wrap `title` (one paragraph) to `WIDTH`.
  """
  header = " ".join(f"{c.header:{c.align}{c.width}}" for c in columns)
  lines = textwrap.wrap(" ".join(title), WIDTH) if wrap_title else list(title)
  lines += [header, "-" * len(header)]
  label = label or columns[0].cell
  for row in rows:
    if "skipped" in row:
      lines += textwrap.wrap(f"{label(row)} skipped: {row['skipped']}", WIDTH,
                             subsequent_indent=" " * 4)
    else:
      lines.append(" ".join(c.cell(row) for c in columns))
  for paragraph in [legend] if isinstance(legend, str) else legend:
    lines += textwrap.wrap(paragraph, WIDTH)
  return lines + [""]
