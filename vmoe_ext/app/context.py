"""`RunContext`: one assembly of a run for the train, evaluate and carve modes.

    ctx = RunContext.assemble(config)        # resolve once, model once
    ctx.open_training(workdir)                # train: state + checkpoints
    ctx.open_evaluation(source=... | init)    # evaluate-only / carve
    ctx.evaluate()                            # clean test metrics

It holds the resolved config, the partitioning (the `sharding` section's
mesh), the model (built once, with the mesh's expert parallelism), the data
(`vmoe_ext.data.source.DataSource`: in memory or streamed, behind one
interface), the state, and for training the workdir's checkpoint manager.
Every mode asks its parts of it; none builds its own. Tests inject a
`DataSource` or a `Partitioning` through `assemble`'s arguments.

A model family whose runs differ from image classification (the language
model: text data, caches carried between steps, perplexity) has its own
subclass, listed in `RUN_FAMILIES`; `RunContext.assemble` returns it. It
overrides the task's seam: `training_inputs`, `initial_state`,
`make_train_step`, `next_batch`, `progress_metrics`, `summary`, `evaluate`,
`final_evaluations` (the training loop and the train mode call only these).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import flax.linen as nn
import flax.serialization
import jax
import ml_collections
import numpy as np

from vmoe_ext.app.schema import resolve_config
from vmoe_ext.data.source import DataSource
from vmoe_ext.errors import ConfigError, field_scope, require
from vmoe_ext.evaluate.final import final_evaluations
from vmoe_ext.models import LANGUAGE_MODEL, build_model
from vmoe_ext.models.stack import to_layout
from vmoe_ext.registry import resolve
from vmoe_ext.reporting.progress import info_line
from vmoe_ext.reporting.writers import MetricWriter
from vmoe_ext.sharding.multihost import process_rows
from vmoe_ext.sharding.partitioning import Partitioning
from vmoe_ext.train.checkpoints import CheckpointManager, config_fingerprint
from vmoe_ext.train.initialization import check_init, load_init_params
from vmoe_ext.train.optimizer import make_learning_rate, make_optimizer
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import evaluate, make_eval_step, make_train_step
from vmoe_ext.train.validate import validate_shapes



# Model families whose runs differ from image classification: `model.name`
# -> the `RunContext` subclass (lazy "module:Class") that assembles them.
RUN_FAMILIES = {LANGUAGE_MODEL: "vmoe_ext.app.lm_run:LanguageRun"}


class ResolvedConfig(ml_collections.ConfigDict):
  """A config `resolve_config` returned: checked, every default filled."""


def resolved(config: Any) -> ResolvedConfig:
  """`config` resolved (once: a `ResolvedConfig` is returned as it is)."""
  if isinstance(config, ResolvedConfig):
    return config
  return ResolvedConfig(resolve_config(config).to_dict())



def abstract_variables(model: nn.Module, key: jax.Array, *inputs: Any) -> Any:
  """The shapes of `model.init(key, *inputs)`, traced without computing.

  The first trace of the model runs the checks that need the token shapes
  (a SoftMoE router's one image per group, a router that reads the previous
  layer): their `ConfigError`s name fields below `model`, scoped here to
  the full path (`model.moe.group_size`).
  """
  with field_scope("model"):
    return jax.eval_shape(lambda *x: model.init(key, *x), *inputs)

@dataclasses.dataclass
class RunContext:
  """The parts of a run (module docstring).

  Attributes:
    config: the resolved config.
    partitioning: the mesh and shardings: the state lives split by its
      rules, batches are global arrays assembled from every process's rows,
      the steps are jitted with these shardings.
    model: the Flax model, built once.
    data: the run's data.
    state: the train state (`open_training`: initial, or restored by
      `restore`), or params and collections only (`open_evaluation`).
    checkpoints: the workdir's checkpoint manager (training).
    resumed_extra: what the restored checkpoint stored beside the state.
  """
  config: ResolvedConfig
  partitioning: Partitioning
  model: nn.Module
  data: DataSource
  state: Optional[TrainState] = None
  checkpoints: Optional[CheckpointManager] = None
  resumed_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
  _eval_steps: dict[int, Callable] = dataclasses.field(default_factory=dict)

  @classmethod
  def assemble(cls, config: Any, *, data: Optional[DataSource] = None,
               partitioning: Optional[Partitioning] = None) -> "RunContext":
    """Resolves `config` (unless it is resolved), makes the mesh and builds
    the model: every config error is raised here, before any data is read
    or anything compiled. `data` / `partitioning` replace the ones the
    config describes (tests inject them)."""
    config = resolved(config)
    family = RUN_FAMILIES.get(config.model.name)
    if family is not None and resolve(family) is not cls:
      return resolve(family).assemble(config, data=data,
                                      partitioning=partitioning)
    if partitioning is None:
      partitioning = Partitioning.from_config(config.sharding)
    model = build_model(config.model, partitioning.expert_parallel)
    if data is None:
      data = DataSource(config.data, config.seed)
    return cls(config, partitioning, model, data)

  # -------------------------------------------------------------- training

  def open_training(self, workdir: str) -> None:
    """The initial train state (or the `init` section's params over it),
    straight into its shardings, and `workdir`'s checkpoint manager."""
    config = self.config
    inputs = self.training_inputs()
    init_key, state_key = jax.random.split(jax.random.key(config.seed))
    # The parameters do not depend on the layout: initialise the unsplit
    # model (on this process's rows), straight into the state's shardings.
    init_model = self.model if self.model.expert_parallel is None else (
        self.model.clone(expert_parallel=None))
    shapes = abstract_variables(init_model, init_key, *inputs)
    init = config.init
    if init is not None:  # Checked on shapes, before compiling model.init.
      check_init(init, shapes["params"])
    variables = jax.jit(lambda *x: init_model.init(init_key, *x),
                        out_shardings=self.partitioning.shardings(shapes)
                        )(*inputs)
    if init is not None:
      params, report = load_init_params(init, variables["params"])
      info_line(report.summary())
      variables = {**variables, "params": params}
    self.state = self.initial_state(variables,
                                    make_optimizer(config.optimizer),
                                    state_key)
    self.checkpoints = CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        save_every=config.train.checkpoint_every,
        keep=config.train.keep_checkpoints,
        config_fingerprint=config_fingerprint(config, self.state.params))

  # The task's seam: what a model family's run does its own way (the
  # language model's run, `vmoe_ext.app.lm_run`, overrides these).

  def training_inputs(self) -> tuple[Any, ...]:
    """Checks the training data against the model and opens the training
    iterator; returns the inputs of `model.init` after its key (a training
    batch of images, as the train step sees them)."""
    config, data = self.config, self.data
    sample = data.sample_batch()
    if data.local_train:
      data.check_channels(sample)
    validate_shapes(config, self.model, sample.shape,
                    num_classes=data.num_classes,
                    partitioning=self.partitioning)
    data.train_iterator()
    return (sample,)

  def initial_state(self, variables: Any, tx: Any, key: jax.Array
                    ) -> TrainState:
    """The train state at step 0 from `model.init`'s variables, placed by
    the partition rules."""
    return self.partitioning.shard(TrainState.create(variables, tx, key))

  def make_train_step(self) -> Callable:
    """The jitted `train_step(state, batch) -> (state, metrics)`
    (`make_train_step` with the `train` section's loss, label smoothing and
    mixup, over the run's mesh, the state donated)."""
    config = self.config
    return self.partitioning.jit_train_step(make_train_step(
        self.model, label_smoothing=config.train.label_smoothing,
        learning_rate_fn=make_learning_rate(config.optimizer),
        mixup=config.train.mixup, loss_type=config.train.loss,
        input_map=self.data.train_input_map()), self.state)

  def final_evaluations(self, *, writer: MetricWriter, workdir: str,
                        records: Sequence[Mapping[str, Any]] = ()
                        ) -> list[str]:
    """What runs after training and the final evaluation (the binary's
    `after_training_hook`): the routing analysis of the test split, then
    the `robustness` section's evaluation (`final_evaluations`); returns
    their report sections."""
    return final_evaluations(
        self.model, self.state.variables(), self.data.test, self.config,
        writer=writer, step=int(self.state.step), workdir=workdir,
        records=records, partitioning=self.partitioning)

  def progress_metrics(self, step: int, rate: float) -> dict[str, Any]:
    """What a train log line says of progress after `step` steps at `rate`
    steps/s: examples seen, epochs, and the images/s (None when nothing
    was timed yet; a timing, see `TIMING_METRICS`)."""
    batch_size = self.config.data.batch_size  # The global batch.
    seen = step * batch_size
    return {"examples_seen": seen,
            "epoch": seen / self.data.train_iterator().num_examples,
            "images_per_second": rate * batch_size if rate > 0 else None}

  def summary(self, metrics: dict[str, Any], training: bool = False) -> str:
    """The metrics of a progress line: a train log line's (`training`) or
    an evaluation's."""
    if training:
      return (f"loss {float(metrics['loss']):.4f}, accuracy "
              f"{float(metrics['accuracy']):.4f}")
    return (f"accuracy {metrics['accuracy']:.4f}, loss "
            f"{metrics['loss']:.4f}")

  def next_batch(self) -> dict:
    """The next training batch, a global array split over the mesh."""
    return self.global_batch(next(self.data.train_iterator()),
                             local=self.data.local_train)

  def save(self, **extra: Any) -> None:
    """Checkpoints the state and data position (and JSON `extra`)."""
    self.checkpoints.save(int(self.state.step),
                          flax.serialization.to_state_dict(self.state),
                          {"data": self.data.train_iterator().get_state(),
                           **extra}, force=True)

  def restore(self) -> Optional[int]:
    """Restores the newest checkpoint (state and data position), if any."""
    restored = self.checkpoints.restore(
        flax.serialization.to_state_dict(self.state))
    if restored is None:
      return None
    state_dict, extra, step = restored
    self.state = flax.serialization.from_state_dict(self.state, state_dict)
    self.data.train_iterator().set_state(extra["data"])
    self.resumed_extra = dict(extra)
    return step

  # ------------------------------------------------------------ evaluation

  def eval_image_shape(self) -> tuple[int, ...]:
    """`[B, H, W, C]` of an evaluation batch on this process (streamed
    batches hold this process's share of the rows), as the model sees it:
    `data.image_size` resizes an in-memory dataset's images on the way
    (the streamed ones come out of their preprocessing at that size)."""
    rows = self.config.data.eval_batch_size // (
        jax.process_count() if self.data.local_eval else 1)
    shape = tuple(self.data.test.image_shape)
    size = self.config.data.get("image_size")
    if size is not None:
      shape = (size, size) + shape[2:]
    return (rows,) + shape

  def open_evaluation(self, source: Optional[str] = None, *,
                      field: str = "robustness.checkpoint_dir",
                      step: Optional[int] = None) -> str:
    """Params and collections to evaluate, no optimizer: the newest
    checkpoint of the training workdir `source` (or its checkpoint of
    `step`, e.g. one kept along training; errors name `field`), or with
    `source=None` the params the `init` section loads over a fresh
    initialisation. Returns a line saying what was loaded."""
    image_shape = self.eval_image_shape()
    validate_shapes(self.config, self.model, image_shape,
                    num_classes=getattr(self.data.test, "num_classes", None))
    sample = jax.ShapeDtypeStruct(image_shape, np.float32)
    if source is None:
      key = jax.random.key(self.config.seed)
      check_init(self.config.init,
                 abstract_variables(self.model, key, sample)["params"])
      variables = dict(jax.jit(self.model.init)(
          key, np.zeros(image_shape, np.float32)))
      params = variables.pop("params")
      variables.pop("intermediates", None)
      params, report = load_init_params(self.config.init, params)
      self.state = TrainState.for_evaluation(params, variables, 0)
      return f"Evaluated the params {report.summary().splitlines()[0]}."
    entries, step = self.checkpoint_variables(source, sample, field=field,
                                              step=step)
    self.state = TrainState.for_evaluation(entries["params"],
                                           entries["collections"], step)
    return (f"Evaluated checkpoint: step {step} of "
            f"`{os.path.abspath(source)}`.")

  def checkpoint_variables(self, source: str, *inputs: Any, field: str,
                           step: Optional[int] = None
                           ) -> tuple[dict[str, Any], int]:
    """`({"params", "collections"}, step)` of the training workdir
    `source`'s newest checkpoint (or of `step`), no optimizer, for the run's
    model traced on `inputs` (its abstract inputs); errors name `field`.

    A checkpoint of the other block layout (`model.scan` flipped: stacked
    or per-block parameters) is read in its own layout and converted
    (`stack.to_layout`, exact)."""
    like = dict(abstract_variables(self.model, jax.random.key(0), *inputs))
    like.pop("intermediates", None)
    try:
      restored = _read_checkpoint(self.config, like, source, step)
    except ConfigError as error:
      other = self._other_layout()
      if other is None:
        raise
      config, model = other
      try:
        saved = dict(abstract_variables(model, jax.random.key(0), *inputs))
        saved.pop("intermediates", None)
        restored = _read_checkpoint(config, saved, source, step)
      except ConfigError:
        raise error from None
      if restored is not None:
        entries, at = restored
        variables = to_layout({"params": entries["params"],
                               **entries["collections"]}, like)
        params = variables.pop("params")
        restored = {"params": params, "collections": variables}, at
    which = "checkpoint" if step is None else f"checkpoint of step {step}"
    require(restored is not None, field,
            f"no {which} of this config could be restored from "
            f"{os.path.join(source, 'checkpoints')!r}")
    return restored

  def _other_layout(self) -> Optional[tuple[Any, nn.Module]]:
    """The config and model with `model.scan` flipped, or None where the
    model has no such choice."""
    if not isinstance(getattr(self.model, "scan", None), bool):
      return None
    config = ResolvedConfig(self.config.to_dict())
    config.model.scan = not self.model.scan
    try:
      return config, self.model.clone(scan=config.model.scan)
    except ConfigError:  # That model cannot be scanned.
      return None

  def global_batch(self, batch: dict, local: bool) -> dict:
    """The global batch from a process's rows (`local`: the streaming
    loaders' per-process share) or from a batch every process drew whole
    (the in-memory loaders)."""
    return self.partitioning.global_batch(batch if local
                                          else process_rows(batch))

  def eval_batches(self) -> Iterator[dict]:
    """Every test example once, padded + masked, preprocessed."""
    return self.data.eval_batches()

  def evaluate(self, model: Optional[nn.Module] = None,
               state: Optional[TrainState] = None, *,
               final: bool = False) -> dict[str, Any]:
    """Accuracy, top-5, loss and routing metrics of the test split, of the
    run's model and state or of `model` / `state` (each model's step is
    jitted once). `final`: the evaluation after training (the same one
    here; a model family may evaluate more then)."""
    del final
    model = self.model if model is None else model
    state = self.state if state is None else state
    if id(model) not in self._eval_steps:
      self._eval_steps[id(model)] = self.partitioning.jit_eval_step(
          make_eval_step(model, self.config.train.loss,
                         input_map=self.data.eval_input_map()), state)
    return evaluate(self._eval_steps[id(model)], state,
                    (self.global_batch(b, local=self.data.local_eval)
                     for b in self.eval_batches()))


def _read_checkpoint(config: Any, like: dict[str, Any], source: str,
                     step: Optional[int]
                     ) -> Optional[tuple[dict[str, Any], int]]:
  """`CheckpointManager.restore_variables` of `source`'s checkpoints for
  the abstract variables `like` of `config`'s model (fingerprint checked)."""
  params = like["params"]
  collections = {k: v for k, v in like.items() if k != "params"}
  manager = CheckpointManager(
      os.path.join(source, "checkpoints"), save_every=0,
      keep=config.train.keep_checkpoints,
      config_fingerprint=config_fingerprint(config, params),
      purpose="evaluate")
  try:
    return manager.restore_variables({"params": params,
                                      "collections": collections}, step)
  finally:
    manager.close()


__all__ = ["RUN_FAMILIES", "ResolvedConfig", "RunContext", "resolved"]
