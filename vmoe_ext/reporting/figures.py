"""Figures that the library writes to files, made without pyplot.

A `matplotlib.figure.Figure` that no pyplot state holds: drawing one neither
switches the process's matplotlib backend nor opens a window, so a notebook
keeps its inline backend and a long job keeps no figures alive after their
PNG is written (`fig.savefig` renders with matplotlib's Agg file canvas).
"""

from __future__ import annotations

from typing import Any, Optional


def subplots(nrows: int = 1, ncols: int = 1, *,
             figsize: tuple[float, float], layout: Optional[str] = None,
             **kwargs: Any) -> tuple[Any, Any]:
  """`(figure, axes)` as `pyplot.subplots` gives them (`kwargs`: e.g.
  `squeeze=False`; `layout`: the figure's layout engine, e.g.
  "constrained"), but outside pyplot."""
  from matplotlib.figure import Figure
  fig = Figure(figsize=figsize, layout=layout)
  return fig, fig.subplots(nrows, ncols, **kwargs)
