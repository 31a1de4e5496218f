"""Pieces of reports: markdown tables and bar charts (PNG)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from vmoe_ext.reporting import figures


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]
                   ) -> str:
  """A markdown table; floats are written with 4 decimals."""
  fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(header) + " |",
           "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def bar_chart(values: Mapping[str, float], path: str, *, ylabel: str,
              title: str, ylim: Optional[tuple[float, float]] = None) -> None:
  """Saves a bar chart of `{label: value}` (labels in order) as a PNG."""
  names = list(values)
  fig, ax = figures.subplots(figsize=(10, 3.5))
  ax.bar(np.arange(len(names)), [values[n] for n in names])
  ax.set_xticks(np.arange(len(names)), names, rotation=45, ha="right")
  ax.set(ylabel=ylabel, title=title)
  if ylim is not None:
    ax.set_ylim(*ylim)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
