"""Robustness on external evaluation datasets (docs/robustness.md,
"Evaluation datasets"): corrupted
datasets with mCE (ImageNet-C, CIFAR-10-C), accuracy on 200-class subsets
(ImageNet-A/R) and out-of-distribution detection AUPR (ImageNet-O).

Configured by `robustness.datasets`, a mapping from a name (used in the
`metrics.jsonl` split `dataset/NAME`, `corrupted/NAME` or `ood/NAME` and in
the report) to an entry with a `kind`:

* `kind="corrupted"`: top-1 accuracy on every (corruption, severity) split of
  a corrupted dataset; per-corruption error averaged over severities; the
  mean corruption error; and, normalised by AlexNet's errors, the ImageNet-C
  mCE. Fields: `source` (a TFDS source whose `tfds_name` is the base name,
  e.g. "imagenet2012_corrupted" or "cifar10_corrupted", read as builder
  configs `NAME/{corruption}_{severity}`; or a folder source laid out as
  `path/{corruption}/{severity}/{class}/{file}`, the released ImageNet-C
  layout), `corruptions` (None: the 15 ImageNet-C corruptions), `severities`
  (default 1..5) and `baseline`: "auto" (default: AlexNet-normalised mCE when
  the 15 ImageNet-C corruptions at severities 1..5 of the TFDS
  `imagenet2012_corrupted` are evaluated, else the unnormalised mean),
  "alexnet" (always normalise, e.g. for an ImageNet-C folder; needs the 15
  corruptions) or None (unnormalised).
* `kind="accuracy"`: top-1 / top-5 accuracy on a source, with `class_subset`
  None, "imagenet_a", "imagenet_r" or a list of class indices: the logits
  are restricted to those classes before the argmax (ImageNet-A/R protocol).
  `label_space` "full" (default; labels are model classes, as in TFDS
  `imagenet_a`/`imagenet_r`) or "subset" (label j means `class_subset[j]`,
  as for the sorted class folders of the released ImageNet-A/R). A label
  outside the subset is an error, not a silent miss.
* `kind="ood"`: AUPR of out-of-distribution detection with OOD as the
  positive class and anomaly score `-max softmax` (ImageNet-O protocol).
  `source` holds the OOD examples, `in_source` (default "test") the
  in-distribution ones. With a `class_subset`, in-distribution examples of
  other classes are left out and both sets' logits are restricted to the
  subset before the softmax (as when ImageNet-O is scored against the
  ImageNet validation images of its 200 classes). The chance level (the OOD
  fraction) is reported next to it.

Each kind is a `DatasetKind` registered in `DATASET_KINDS` (its fields,
its config check, its evaluation, its metrics lines and report sections):
a new kind is one module plus one line there (docs/robustness.md, "Add an
evaluation").

Sources: "test" (the run's own test split), a TFDS source
`{"tfds_name", "split", "data_dir", "image_key", "label_key",
"max_examples"}` (`data_dir` defaults to `data.data_dir`; array_record data is
read batch by batch without TensorFlow) or a folder source
`{"path", "max_examples"}` (class sub-folders, read with PIL). `max_examples`
takes that many evenly spaced examples. Every image is resized to the model's
input size (`data.image_size`, else the test images' size) with the same
square resize as the training pipeline, and must have the test images' number
of channels; except that with a streamed test split (`data.pp_eval`) the
images of `accuracy` and `ood` sources (full-size photos: ImageNet-A/R/O) go
through `data.pp_eval` instead (`stream_eval.EvalFit`, e.g.
resize_small(256) + central_crop(224)); corrupted sets (ImageNet-C: already
224 px crops) keep the square resize.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from vmoe_ext.classification import topk_correct
from vmoe_ext.data.corruptions import CORRUPTIONS
from vmoe_ext.data.dataset import ArrayDataset
from vmoe_ext.data.readers import ArrayReader, ExampleReader, evenly_spaced
from vmoe_ext.data.stream_eval import EvalFit, streams_evaluation
from vmoe_ext.errors import ConfigError, require
from vmoe_ext.evaluate.corruption_metrics import (ALEXNET_ERRORS,
                                                  corruption_errors, mce,
                                                  normalized_corruption_errors)
from vmoe_ext.evaluate.evaluator import Evaluator
from vmoe_ext.evaluate.imagenet_subsets import (IMAGENET_A_CLASSES,
                                                IMAGENET_R_CLASSES)
from vmoe_ext.evaluate.metrics import mask_logits, ood_aupr, topk_accuracy
from vmoe_ext.registry import Registry
from vmoe_ext.reporting.report_parts import bar_chart, markdown_table
from vmoe_ext.reporting.writers import MetricWriter, progress_bar

# `robustness.datasets.NAME.kind` -> its `DatasetKind`. A new kind of
# evaluation is one module plus one line here (docs/robustness.md, "Add an
# evaluation").
DATASET_KINDS = Registry("dataset kind", {
    "corrupted": "vmoe_ext.evaluate.datasets:CorruptedDatasets",
    "accuracy": "vmoe_ext.evaluate.datasets:AccuracyDatasets",
    "ood": "vmoe_ext.evaluate.datasets:OodDatasets",
})
NAMED_SUBSETS = {"imagenet_a": IMAGENET_A_CLASSES,
                 "imagenet_r": IMAGENET_R_CLASSES}
BASELINES = ("auto", "alexnet", None)
_TFDS_FIELDS = {"tfds_name", "split", "data_dir", "image_key", "label_key",
                "max_examples"}
_FOLDER_FIELDS = {"path", "max_examples"}


def _as_dict(value: Any) -> Any:
  return value.to_dict() if hasattr(value, "to_dict") else value


def _check_max_examples(source: Mapping[str, Any], field: str) -> None:
  n = source.get("max_examples")
  require(n is None or (isinstance(n, (int, np.integer)) and n > 0),
          f"{field}.max_examples",
          f"must be None or a positive integer, got {n!r}")


def check_source(source: Any, field: str, *, corrupted: bool = False) -> Any:
  """Validates a source spec ("test", TFDS dict or folder dict)."""
  source = _as_dict(source)
  if source == "test" and not corrupted:
    return source
  require(isinstance(source, Mapping), field,
          'must be "test", a TFDS source {tfds_name, split, ...} or a folder '
          "source {path, ...}" if not corrupted else
          "must be a TFDS source {tfds_name, split, ...} or a folder source "
          "{path, ...}")
  source = dict(source)
  if "path" in source:
    unknown = sorted(set(source) - _FOLDER_FIELDS)
    if unknown:
      raise ConfigError(f"{field}.{unknown[0]}",
                        f"unknown field of a folder source; known: "
                        f"{sorted(_FOLDER_FIELDS)}")
    require(isinstance(source["path"], str) and source["path"],
            f"{field}.path", f"must be a directory, got {source['path']!r}")
  else:
    unknown = sorted(set(source) - _TFDS_FIELDS)
    if unknown:
      raise ConfigError(f"{field}.{unknown[0]}",
                        "unknown field of a TFDS source (a folder source "
                        f"needs path); known: {sorted(_TFDS_FIELDS)}")
    name = source.get("tfds_name")
    require(isinstance(name, str) and name, f"{field}.tfds_name",
            f"required, got {name!r}")
    require(not corrupted or "/" not in name, f"{field}.tfds_name",
            f"give the base name (e.g. 'imagenet2012_corrupted'); the "
            f"corruption/severity configs are added, got {name!r}")
    split = source.get("split")
    require(isinstance(split, str) and split, f"{field}.split",
            f"required (e.g. 'validation' or 'test'), got {split!r}")
  _check_max_examples(source, field)
  return source


def _class_subset(value: Any, field: str) -> Optional[tuple[int, ...]]:
  if value is None:
    return None
  if isinstance(value, str):
    require(value in NAMED_SUBSETS, field,
            f"unknown class subset {value!r}; known: {sorted(NAMED_SUBSETS)} "
            "or a list of class indices")
    return NAMED_SUBSETS[value]
  subset = tuple(value)
  require(subset and all(isinstance(i, (int, np.integer)) and i >= 0
                         for i in subset), field,
          "must be a non-empty list of non-negative class indices")
  require(len(set(subset)) == len(subset), field, "indices must be distinct")
  return tuple(int(i) for i in subset)


def check_datasets(datasets: Any, field: str = "robustness.datasets"
                   ) -> dict[str, dict[str, Any]]:
  """Validates `robustness.datasets`; returns entries with defaults filled."""
  datasets = _as_dict(datasets)
  if not datasets:
    return {}
  require(isinstance(datasets, Mapping), field,
          "must be a mapping {name: {kind: ..., source: ...}}")
  out = {}
  for name, entry in datasets.items():
    f = f"{field}.{name}"
    require(isinstance(name, str) and name.replace("_", "").replace(
        "-", "").isalnum(), f, "names must be letters, digits, _ or -")
    entry = _as_dict(entry)
    require(isinstance(entry, Mapping), f, "must be a dict with a kind")
    entry = dict(entry)
    kind = entry.get("kind")
    kinds = tuple(DATASET_KINDS)
    require(kind in kinds, f"{f}.kind", f"must be one of {kinds}, got "
            f"{kind!r}")
    evaluation = DATASET_KINDS.get(kind)()
    known = {"kind", "source", *evaluation.fields}
    unknown = sorted(set(entry) - known)
    if unknown:
      raise ConfigError(f"{f}.{unknown[0]}", f"unknown field for kind "
                        f"{kind!r}; known: {sorted(known)}")
    require("source" in entry, f"{f}.source", "required")
    entry["source"] = check_source(entry["source"], f"{f}.source",
                                   corrupted=evaluation.corrupted_source)
    entry = evaluation.check(entry, f)
    out[name] = entry
  return out


def _tfds_home(data_dir: Optional[str]) -> str:
  """Where TFDS looks for prepared data when `data_dir` is None."""
  if data_dir is not None:
    return os.path.expanduser(data_dir)
  return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser(
      os.path.join("~", "tensorflow_datasets"))


def check_prepared(datasets: Any, data_config: Mapping[str, Any],
                   field: str = "robustness.datasets") -> None:
  """Raises ConfigError for a source of `datasets` that is not on disk (a
  folder that is not there, a TFDS dataset without a prepared copy under
  its `data_dir`, which defaults to `data.data_dir`).

  A look at directories only, no TFDS import: run before training, so a
  missing evaluation set is reported before hours of training, not after
  them. Opening the data at evaluation time checks the rest (splits,
  features, channels).
  """
  for name, entry in check_datasets(datasets, field).items():
    for key in ("source", "in_source"):
      source = entry.get(key, "test")
      f = f"{field}.{name}.{key}"
      if source == "test":
        continue
      if "path" in source:
        require(os.path.isdir(source["path"]), f"{f}.path",
                f"no directory {source['path']!r}")
        continue
      data_dir = source.get("data_dir") or data_config.get("data_dir")
      base = source["tfds_name"].split("/")[0].split(":")[0]
      home = _tfds_home(data_dir)
      require(os.path.isdir(os.path.join(home, base)), f"{f}.data_dir",
              f"no prepared copy of {base} under {home!r} (from "
              f"{f}.data_dir or data.data_dir); nothing is downloaded: "
              f"prepare it (tfds build) or leave {field}.{name} out")


class DatasetContext:
  """What every dataset evaluation shares: the model, the run's test split,
  the input geometry, the batch size and the default TFDS data_dir."""

  def __init__(self, evaluator: Evaluator, test: ArrayDataset,
               data_config: Mapping[str, Any], batch_size: int):
    self.evaluator = evaluator
    self.test = test
    self.batch_size = batch_size
    self.image_size = data_config.get("image_size", None) or int(
        test.images.shape[1])
    self.channels = int(test.images.shape[-1])
    self.data_dir = data_config.get("data_dir", None)
    # Full-size images (ImageNet-A/R/O) get the eval preprocessing of a
    # streaming config (resize_small + central_crop), not a square resize.
    self.fit = self.image_size
    if streams_evaluation(data_config):
      self.fit = EvalFit(data_config["pp_eval"])

  def open(self, source: Any, field: str, tfds_name: Optional[str] = None
           ) -> ExampleReader:
    """A reader of `source` (`tfds_name` overrides the source's)."""
    if source == "test":
      return ArrayReader(self.test)
    if "path" in source:
      from vmoe_ext.data.image_folder import ImageFolderReader
      return ImageFolderReader(source["path"], channels=self.channels,
                               field=f"{field}.path")
    from vmoe_ext.data.tfds_adapter import TfdsReader
    config = {k: v for k, v in source.items() if k != "max_examples"}
    if config.get("data_dir") is None:
      config["data_dir"] = self.data_dir
    if tfds_name is not None:
      config["tfds_name"] = tfds_name
    return TfdsReader(config, source["split"], prefix=field)

  def predict(self, reader: ExampleReader, source: Any, field: str,
              desc: str, fit: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels of the (evenly spaced, `max_examples`) examples;
    `fit`: through `self.fit` (the run's own test images never: they are
    preprocessed already)."""
    max_examples = None if source == "test" else source.get("max_examples")
    size = self.fit if fit and source != "test" else self.image_size
    logits, labels = self.evaluator.predict(
        reader, self.batch_size,
        indices=evenly_spaced(len(reader), max_examples),
        image_size=size, desc=desc)
    require(len(labels) > 0, field, f"{reader.name} has no examples")
    return logits, labels

  def check_channels(self, reader: ExampleReader, field: str) -> None:
    images, _ = reader.read(np.arange(min(1, len(reader))), self.image_size)
    require(len(images) == 0 or images.shape[-1] == self.channels, field,
            f"{reader.name} has {images.shape[-1]}-channel images; the model "
            f"takes {self.channels} channels")


def _subset_positions(labels: np.ndarray, subset: Sequence[int],
                      field: str, name: str) -> np.ndarray:
  """Positions in `subset` of full-space `labels`; an error if one is not in
  the subset."""
  lookup = {c: j for j, c in enumerate(subset)}
  outside = sorted({int(l) for l in labels} - set(lookup))
  require(not outside, field,
          f"{len(outside)} label(s) of {name} are not in the class subset "
          f"(e.g. {outside[:5]}); wrong subset or label_space?")
  return np.asarray([lookup[int(l)] for l in labels], np.int32)


def evaluate_accuracy(ctx: DatasetContext, name: str,
                      entry: Mapping[str, Any],
                      field: str) -> dict[str, Any]:
  """Top-1/top-5 accuracy on a source, optionally on a class subset."""
  reader = ctx.open(entry["source"], f"{field}.source")
  ctx.check_channels(reader, f"{field}.source")
  subset = entry["class_subset"]
  logits, labels = ctx.predict(reader, entry["source"], f"{field}.source",
                               desc=name, fit=True)
  num_classes = logits.shape[1]
  if subset is not None:
    require(max(subset) < num_classes, f"{field}.class_subset",
            f"indices must lie in [0, {num_classes}) (the model's classes)")
  if entry["label_space"] == "subset":
    require(reader.num_classes == len(subset), f"{field}.label_space",
            f"'subset' labels index the {len(subset)} subset classes, but "
            f"{reader.name} has {reader.num_classes} classes")
    positions = labels
  else:
    require(reader.num_classes == num_classes, f"{field}.source",
            f"{reader.name} has {reader.num_classes} classes, the model "
            f"{num_classes}; for a dataset labelled by subset position use "
            "label_space='subset'")
    positions = (labels if subset is None else
                 _subset_positions(labels, subset, f"{field}.class_subset",
                                   reader.name))
  scores = logits if subset is None else mask_logits(logits, subset)
  k5 = min(5, scores.shape[1])
  return {"accuracy": topk_accuracy(scores, positions, 1),
          "top5_accuracy": topk_accuracy(scores, positions, k5),
          "num_examples": len(labels),
          "class_subset_size": (num_classes if subset is None
                                else len(subset))}


def evaluate_ood(ctx: DatasetContext, name: str,
                 entry: Mapping[str, Any],
                 field: str) -> dict[str, Any]:
  """OOD-detection AUPR (OOD positive, score `-max softmax`)."""
  out_reader = ctx.open(entry["source"], f"{field}.source")
  in_reader = ctx.open(entry["in_source"], f"{field}.in_source")
  ctx.check_channels(out_reader, f"{field}.source")
  ctx.check_channels(in_reader, f"{field}.in_source")
  logits_out, _ = ctx.predict(out_reader, entry["source"], f"{field}.source",
                              desc=f"{name} (out)", fit=True)
  logits_in, labels_in = ctx.predict(in_reader, entry["in_source"],
                                     f"{field}.in_source",
                                     desc=f"{name} (in)", fit=True)
  subset = entry["class_subset"]
  if subset is not None:
    require(max(subset) < logits_in.shape[1], f"{field}.class_subset",
            f"indices must lie in [0, {logits_in.shape[1]}) (the model's "
            "classes)")
    keep = np.isin(labels_in, subset)
    require(keep.any(), f"{field}.in_source",
            "no in-distribution example has a label in the class subset")
    logits_in = mask_logits(logits_in[keep], subset)
    logits_out = mask_logits(logits_out, subset)
  n_in, n_out = len(logits_in), len(logits_out)
  return {"aupr": ood_aupr(logits_in, logits_out),
          "chance_aupr": n_out / (n_in + n_out),
          "num_in": n_in, "num_out": n_out}


def _corruption_reader(ctx: DatasetContext, source: Mapping[str, Any],
                       corruption: str, severity: int, field: str
                       ) -> ExampleReader:
  if "path" in source:
    path = os.path.join(source["path"], corruption, str(severity))
    require(os.path.isdir(path), f"{field}.path",
            f"no folder {path!r} (expected path/CORRUPTION/SEVERITY/CLASS/"
            "FILE)")
    return ctx.open({**source, "path": path}, field)
  return ctx.open(source, field,
                  tfds_name=f"{source['tfds_name']}/{corruption}_{severity}")


def evaluate_corrupted(ctx: DatasetContext, name: str,
                       entry: Mapping[str, Any],
                       field: str) -> dict[str, Any]:
  """Accuracy per (corruption, severity), corruption errors and mCE."""
  source = entry["source"]
  names, severities = entry["corruptions"], entry["severities"]
  table: dict[str, dict[int, float]] = {}
  num_examples = None
  with progress_bar(total=len(names) * len(severities), desc=name) as bar:
    for corruption in names:
      table[corruption] = {}
      for severity in severities:
        reader = _corruption_reader(ctx, source, corruption, severity,
                                    f"{field}.source")
        if num_examples is None:
          ctx.check_channels(reader, f"{field}.source")
        logits, labels = ctx.predict(reader, source, f"{field}.source",
                                     desc=None)
        require(logits.shape[1] == reader.num_classes, f"{field}.source",
                f"{reader.name} has {reader.num_classes} classes, the model "
                f"{logits.shape[1]}")
        table[corruption][severity] = float(np.mean(
            topk_correct(logits, labels, 1)))
        num_examples = len(labels)
        bar.update(1)
  errors = corruption_errors(table)
  baseline = entry["baseline"]
  all_imagenet_c = (set(ALEXNET_ERRORS) <= set(names)
                    and tuple(sorted(severities)) == (1, 2, 3, 4, 5))
  imagenet_source = source.get("tfds_name") == "imagenet2012_corrupted"
  normalise = baseline == "alexnet" or (baseline == "auto" and all_imagenet_c
                                        and imagenet_source)
  out: dict[str, Any] = {"table": table, "errors": errors["errors"],
                         "mean_corruption_error":
                             errors["mean_corruption_error"],
                         "num_examples": num_examples,
                         "normalised": normalise}
  if normalise:
    out["ce"] = normalized_corruption_errors(errors["errors"])
    out["mce"] = mce(errors["errors"])
  return out


def _report_corrupted(r: Mapping[str, Any], name: str,
                      severities: Sequence[int], writer: MetricWriter,
                      step: int, workdir: str) -> str:
  """Writes `corrupted/NAME` metrics and the PNG; returns the report section."""
  table, ce = r["table"], r.get("ce", {})
  metrics = {"mean_corruption_error": r["mean_corruption_error"],
             "num_examples": r["num_examples"]}
  for c in table:
    metrics[f"{c}/error"] = r["errors"][c]
    for s in severities:
      metrics[f"{c}/s{s}/accuracy"] = table[c][s]
  if r["normalised"]:
    metrics["mce"] = r["mce"]
    metrics.update({f"{c}/ce": v for c, v in ce.items()})
  writer.write(step, f"corrupted/{name}", metrics)
  png = f"corrupted_{name}.png"
  bar_chart(ce if r["normalised"] else r["errors"],
            os.path.join(workdir, png), title=name,
            ylabel="CE (error / AlexNet error)" if r["normalised"]
            else "error (mean over severities)")
  summary = (f"ImageNet-C mCE (errors normalised by AlexNet's): "
             f"**{r['mce']:.4f}**; unnormalised mean corruption error "
             f"{r['mean_corruption_error']:.4f}." if r["normalised"] else
             f"Mean corruption error (unnormalised, no AlexNet baseline "
             f"for this set): **{r['mean_corruption_error']:.4f}**.")
  header = (["corruption"] + [f"s{s} acc" for s in severities] + ["error"]
            + (["CE"] if r["normalised"] else []))
  body = [[c] + [table[c][s] for s in severities] + [r["errors"][c]]
          + ([ce.get(c, "-")] if r["normalised"] else []) for c in table]
  return (f"## Corrupted dataset `{name}`\n\n{r['num_examples']} images per "
          f"(corruption, severity). {summary}\n\n"
          + markdown_table(header, body) + f"\n\n![{name}]({png})")


class DatasetKind:
  """One kind of evaluation dataset (`robustness.datasets.NAME.kind`): the
  contract a new kind follows (docs/robustness.md, "Add an evaluation").
  Subclass it in a module of its own and add one line to `DATASET_KINDS`.

  Attributes:
    fields: the entry's fields besides `kind` and `source` (any other field
      is a config error naming it).
    corrupted_source: `source` names a corrupted set (a TFDS base name or a
      corruption/severity folder tree; "test" is not allowed).
  """
  fields: tuple[str, ...] = ()
  corrupted_source: bool = False

  def check(self, entry: dict[str, Any], field: str) -> dict[str, Any]:
    """The entry (its `source` checked already) with its defaults filled
    in; errors are `ConfigError`s naming `f"{field}.<its field>"`. Runs
    with the config check, before anything is read or compiled."""
    del field
    return entry

  def evaluate(self, ctx: DatasetContext, name: str,
               entry: Mapping[str, Any], field: str) -> Any:
    """Evaluates the entry `name` (checked) and returns its results; read
    examples with `ctx.open` and predict them with `ctx.predict` (the
    evaluator's jitted forward pass) or `ctx.evaluator`."""
    raise NotImplementedError

  def write(self, result: Any, name: str, entry: Mapping[str, Any], *,
            writer: MetricWriter, step: int, workdir: str) -> Optional[str]:
    """Writes the `metrics.jsonl` line(s) of `result` (and its figures into
    `workdir`); returns a report section of its own, or None."""
    raise NotImplementedError

  def row(self, name: str, result: Any) -> Optional[list[Any]]:
    """The entry's row in the summary table of its kind, or None."""
    del name, result
    return None

  def table(self, rows: Sequence[list[Any]]) -> str:
    """The report section summarising every entry of this kind (`rows`:
    their `row`s, in config order)."""
    raise NotImplementedError


class CorruptedDatasets(DatasetKind):
  """`kind="corrupted"`: accuracy per (corruption, severity), corruption
  errors and, normalised by AlexNet's, the ImageNet-C mCE."""
  fields = ("corruptions", "severities", "baseline")
  corrupted_source = True

  def check(self, entry: dict[str, Any], field: str) -> dict[str, Any]:
    f = field
    names = entry.get("corruptions")
    names = tuple(CORRUPTIONS if names is None else names)
    require(names and all(isinstance(c, str) and c for c in names),
            f"{f}.corruptions", "must be None or a non-empty list of names")
    severities = tuple(entry.get("severities") or (1, 2, 3, 4, 5))
    for s in severities:
      require(s in (1, 2, 3, 4, 5), f"{f}.severities",
              f"severities are 1..5, got {s!r}")
    baseline = entry.get("baseline", "auto")
    require(baseline in BASELINES, f"{f}.baseline",
            f"must be one of {BASELINES}, got {baseline!r}")
    if baseline == "alexnet":
      missing = sorted(set(ALEXNET_ERRORS) - set(names))
      require(not missing, f"{f}.corruptions",
              f"baseline='alexnet' needs all 15 ImageNet-C corruptions; "
              f"missing {missing}")
    entry.update(corruptions=names, severities=severities,
                 baseline=baseline)
    return entry

  def evaluate(self, ctx, name, entry, field):
    return evaluate_corrupted(ctx, name, entry, field)

  def write(self, result, name, entry, *, writer, step, workdir):
    return _report_corrupted(result, name, entry["severities"], writer, step,
                             workdir)


class AccuracyDatasets(DatasetKind):
  """`kind="accuracy"`: top-1 / top-5 accuracy, optionally on a class
  subset (ImageNet-A/R)."""
  fields = ("class_subset", "label_space")

  def check(self, entry: dict[str, Any], field: str) -> dict[str, Any]:
    f = field
    entry["class_subset"] = _class_subset(entry.get("class_subset"),
                                          f"{f}.class_subset")
    space = entry.get("label_space", "full")
    require(space in ("full", "subset"), f"{f}.label_space",
            f"must be 'full' or 'subset', got {space!r}")
    require(space == "full" or entry["class_subset"] is not None,
            f"{f}.label_space", "'subset' needs a class_subset")
    entry["label_space"] = space
    return entry

  def evaluate(self, ctx, name, entry, field):
    return evaluate_accuracy(ctx, name, entry, field)

  def write(self, result, name, entry, *, writer, step, workdir):
    writer.write(step, f"dataset/{name}", result)
    return None

  def row(self, name, result):
    return [name, result["num_examples"], result["class_subset_size"],
            result["accuracy"], result["top5_accuracy"]]

  def table(self, rows):
    return ("## Accuracy on evaluation datasets\n\nLogits restricted to the "
            "class subset before the argmax where one is given.\n\n"
            + markdown_table(["dataset", "examples", "classes", "top-1",
                              "top-5"], rows))


class OodDatasets(DatasetKind):
  """`kind="ood"`: out-of-distribution detection AUPR (ImageNet-O)."""
  fields = ("in_source", "class_subset")

  def check(self, entry: dict[str, Any], field: str) -> dict[str, Any]:
    f = field
    entry["in_source"] = check_source(entry.get("in_source", "test"),
                                      f"{f}.in_source")
    entry["class_subset"] = _class_subset(entry.get("class_subset"),
                                          f"{f}.class_subset")
    return entry

  def evaluate(self, ctx, name, entry, field):
    return evaluate_ood(ctx, name, entry, field)

  def write(self, result, name, entry, *, writer, step, workdir):
    writer.write(step, f"ood/{name}", result)
    return None

  def row(self, name, result):
    return [name, result["num_in"], result["num_out"], result["aupr"],
            result["chance_aupr"]]

  def table(self, rows):
    return ("## Out-of-distribution detection\n\nAUPR with OOD as the "
            "positive class, anomaly score -max softmax; chance = OOD "
            "fraction.\n\n"
            + markdown_table(["dataset", "in-dist examples", "OOD examples",
                              "AUPR", "chance"], rows))


def evaluate_datasets(evaluator: Evaluator, test: ArrayDataset,
                      data_config: Mapping[str, Any],
                      datasets: Mapping[str, Any], *, batch_size: int,
                      writer: MetricWriter, step: int, workdir: str,
                      field: str = "robustness.datasets") -> list[str]:
  """Evaluates every `robustness.datasets` entry; returns report sections."""
  entries = check_datasets(datasets, field)
  ctx = DatasetContext(evaluator, test, data_config, batch_size)
  sections = []
  rows: dict[str, list[list[Any]]] = {}
  for name, entry in entries.items():
    kind = DATASET_KINDS.get(entry["kind"])()
    result = kind.evaluate(ctx, name, entry, f"{field}.{name}")
    section = kind.write(result, name, entry, writer=writer, step=step,
                         workdir=workdir)
    if section is not None:
      sections.append(section)
    row = kind.row(name, result)
    if row is not None:
      rows.setdefault(entry["kind"], []).append(row)
  for name in DATASET_KINDS:  # One summary table per kind, in their order.
    if rows.get(name):
      sections.append(DATASET_KINDS.get(name)().table(rows[name]))
  return sections


_Context = DatasetContext  # The name before `DatasetKind` made it public.
