"""Metric writers: `metrics.jsonl` and TensorBoard event files (the progress
bars and lines: `vmoe_ext.reporting.progress`, re-exported here).

`WORKDIR/metrics.jsonl` is the machine-readable record other tools read
(docs/training.md, "Outputs and guarantees"): one JSON object per line,

  {"step": 100, "split": "train", "loss": 0.69, "layer_1/load": [0.5, 0.5]}
  {"step": 500, "split": "test", "accuracy": 0.91, "final": true}

Metric values are converted as follows: scalars (Python or numpy/jax 0-d,
any real or bool dtype) become floats; arrays with at least one dimension
and at most `MAX_ARRAY_SIZE` elements become (nested) lists of floats;
strings and None are written as they are; nested mappings are flattened
with "/" ("layer_1/drop_rate"). Non-finite floats are written as Python's
json module writes them (NaN, Infinity), which `read_metrics` parses back.

TensorBoard events go to `WORKDIR/tensorboard` (tensorboardX, no
TensorFlow needed): each numeric scalar under the tag f"{split}/{name}",
each array entry under f"{split}/{name}/{i}" (f"{split}/{name}/{i}/{j}" for
2-D arrays, and so on); strings and None are not sent to TensorBoard.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Mapping, Optional

import numpy as np

# The progress machinery lives in `progress`; imported from here as well.
from vmoe_ext.reporting.progress import (BatchProgress, bars_disabled,
                                         duration, info_line, progress_bar,
                                         progress_line, wall_time)
from vmoe_ext.sharding.multihost import is_main_process

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED = ("step", "split", "final")
MAX_ARRAY_SIZE = 4096
# Train-line metrics that measure time, not the computation: they differ
# between two runs of the same config (and between a run and its resume),
# where every other value of `metrics.jsonl` is reproduced exactly.
TIMING_METRICS = ("images_per_second", "tokens_per_second")
PLOTS_TAG = "plots"


def write_plot_images(workdir: str, step: int) -> list[str]:
  """Sends every `*.png` of `workdir` to TensorBoard as the image
  f"plots/{name}" at `step` (an event file of its own, beside the scalars');
  returns the names. Only process 0 writes; nothing without TensorBoard
  events in `workdir`."""
  logdir = os.path.join(workdir, TENSORBOARD_DIR)
  if not is_main_process() or not os.path.isdir(logdir):
    return []
  names = sorted(n for n in os.listdir(workdir) if n.endswith(".png"))
  if not names:
    return []
  import matplotlib.image
  from tensorboardX import SummaryWriter
  for old in os.listdir(logdir):  # One set of plots: the latest report's.
    if old.startswith("events.out.tfevents.") and old.endswith(".plots"):
      os.remove(os.path.join(logdir, old))
  with SummaryWriter(logdir=logdir, filename_suffix=".plots") as tb:
    for name in names:
      image = matplotlib.image.imread(os.path.join(workdir, name))
      tb.add_image(f"{PLOTS_TAG}/{name[:-4]}", image[..., :3],
                   global_step=int(step), dataformats="HWC")
  return names


def flatten_metrics(metrics: Mapping[str, Any],
                    prefix: str = "") -> dict[str, Any]:
  """Flattens nested mappings into one dict with "/"-joined keys."""
  out: dict[str, Any] = {}
  for key, value in metrics.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(flatten_metrics(value, f"{name}/"))
    else:
      out[name] = value
  return out


def _convert(name: str, value: Any) -> Any:
  """A JSON value for one metric: float, (nested) list of floats, str, None."""
  if value is None or isinstance(value, str):
    return value
  array = np.asarray(value)
  if array.dtype.kind not in "biuf":
    raise TypeError(f"metric {name!r}: unsupported value of dtype "
                    f"{array.dtype} ({type(value).__name__})")
  if array.ndim == 0:
    return float(array)
  if array.size > MAX_ARRAY_SIZE:
    raise ValueError(f"metric {name!r}: array of shape {array.shape} is too "
                     f"large for metrics.jsonl (at most {MAX_ARRAY_SIZE} "
                     "elements)")
  return array.astype(np.float64).tolist()


def _tb_scalars(name: str, value: Any) -> Iterator[tuple[str, float]]:
  """(tag suffix, value) pairs for TensorBoard; nothing for str/None."""
  if value is None or isinstance(value, str):
    return
  if isinstance(value, float):
    yield name, value
    return
  array = np.asarray(value, np.float64)
  for index in np.ndindex(array.shape):
    yield "/".join([name, *map(str, index)]), float(array[index])


class MetricWriter:
  """Appends metrics to `WORKDIR/metrics.jsonl` and TensorBoard events.

  Only process 0 of a multi-process run writes; elsewhere every method is a
  no-op. Lines are flushed to disk as they are written, so a killed run
  keeps every line written before it died.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True):
    """Opens (appending) `workdir/metrics.jsonl` and a TensorBoard writer.

    Args:
      workdir: the run's working directory (created if missing).
      tensorboard: also write TensorBoard event files to
        `workdir/tensorboard`.
    """
    self.workdir = os.fspath(workdir)
    self.path = os.path.join(self.workdir, METRICS_FILE)
    self._enabled = is_main_process()
    self._file = None
    self._tb = None
    self._closed = False
    if not self._enabled:
      return
    os.makedirs(self.workdir, exist_ok=True)
    self._lines = (len(read_metrics(self.workdir))
                   if os.path.exists(self.path) else 0)
    self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      # Imported here: tensorboardX takes ~0.3 s to import.
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(
          logdir=os.path.join(self.workdir, TENSORBOARD_DIR), flush_secs=30)

  def write(self, step: int, split: str, metrics: Mapping[str, Any], *,
            final: bool = False) -> None:
    """Writes one line `{"step", "split", <metrics>..., ["final": true]}`.

    Args:
      step: the train step the metrics belong to.
      split: e.g. "train", "test", "pgd_eps0.01".
      metrics: metric name -> value (see the module docstring for the
        accepted values); nested mappings are flattened with "/".
      final: marks the final evaluation (adds `"final": true`).

    Raises:
      ValueError for a reserved metric name (step, split, final) or an
      oversized array; TypeError for a non-numeric value.
    """
    if self._closed:
      raise ValueError(f"MetricWriter for {self.workdir} is closed")
    if not self._enabled:
      return
    if not isinstance(split, str) or not split:
      raise ValueError(f"split must be a non-empty string, got {split!r}")
    step = int(step)
    record: dict[str, Any] = {"step": step, "split": split}
    for name, value in flatten_metrics(metrics).items():
      if name in RESERVED:
        raise ValueError(f"metric name {name!r} is reserved ({RESERVED})")
      record[name] = _convert(name, value)
    if final:
      record["final"] = True
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    self._lines += 1
    if self._tb is not None:
      self._write_tensorboard(record)

  def num_lines(self) -> int:
    """The number of complete records in `metrics.jsonl` (0 elsewhere);
    counted as they are written, the file is read only when opened."""
    return self._lines if self._enabled else 0

  def truncate(self, after_step: Optional[int] = None, *,
               keep_lines: Optional[int] = None) -> None:
    """Drops records so the record is what it was at a checkpoint.

    Keeps the first `keep_lines` records (what a checkpoint recorded with
    `num_lines`), or, without it, the records whose step is <= `after_step`.
    TensorBoard's event files are rewritten from the kept records, so they
    show the same points as `metrics.jsonl`, none twice.

    For a resumed run: what a killed run wrote after its last checkpoint is
    written again by the resumed one.
    """
    if self._closed:
      raise ValueError(f"MetricWriter for {self.workdir} is closed")
    if (after_step is None) == (keep_lines is None):
      raise ValueError("give exactly one of after_step and keep_lines")
    if not self._enabled:
      return
    self._file.flush()
    records = read_metrics(self.workdir)
    if keep_lines is not None:
      kept = records[:keep_lines]
    else:
      kept = [r for r in records if r["step"] <= after_step]
    self._file.close()
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      for record in kept:
        f.write(json.dumps(record) + "\n")
    os.replace(tmp, self.path)
    self._lines = len(kept)
    self._file = open(self.path, "a", encoding="utf-8")
    if self._tb is not None and len(kept) < len(records):
      self._rewrite_tensorboard(kept)

  def _rewrite_tensorboard(self, records: list[dict[str, Any]]) -> None:
    """Replaces the event files with one holding exactly `records`."""
    from tensorboardX import SummaryWriter
    self._tb.close()
    logdir = os.path.join(self.workdir, TENSORBOARD_DIR)
    for name in os.listdir(logdir):
      if name.startswith("events.out.tfevents."):
        os.remove(os.path.join(logdir, name))
    self._tb = SummaryWriter(logdir=logdir, flush_secs=30)
    for record in records:
      self._write_tensorboard(record)

  def _write_tensorboard(self, record: Mapping[str, Any]) -> None:
    for name, value in record.items():
      if name in RESERVED:
        continue
      for tag, scalar in _tb_scalars(name, value):
        self._tb.add_scalar(f"{record['split']}/{tag}", scalar,
                            global_step=record["step"])

  def flush(self) -> None:
    """Flushes metrics.jsonl and the TensorBoard events to disk."""
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes and closes the files; further writes are errors."""
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    self._closed = True

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, exc_type, *exc) -> None:
    try:
      self.close()
    except OSError:
      if exc_type is None:
        raise  # Else the error already under way (a full disk) is the news.


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """Parses `workdir/metrics.jsonl` into a list of dicts, in file order.

  A last line without its newline (a run killed mid-write) is skipped when it
  is not valid JSON; a malformed line anywhere else raises ValueError.

  Raises:
    FileNotFoundError when the file does not exist.
  """
  path = os.path.join(os.fspath(workdir), METRICS_FILE)
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  records = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if number == len(lines):  # Unterminated last line: a partial write.
        break
      raise ValueError(f"{path}:{number}: malformed line: {e}") from e
  return records


__all__ = ["BatchProgress", "MAX_ARRAY_SIZE", "METRICS_FILE", "MetricWriter",
           "TENSORBOARD_DIR", "bars_disabled", "duration", "flatten_metrics",
           "info_line", "progress_bar", "progress_line", "read_metrics",
           "wall_time"]
