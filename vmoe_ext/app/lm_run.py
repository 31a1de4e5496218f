"""`LanguageRun`: the run of a language model (`model.name="language_model"`,
`data.name="text"`), the same binary, training loop, checkpoints and report
as an image run, with the task's own parts (docs/language_model.md,
"Training and evaluation").

    run = RunContext.assemble(config)   # a LanguageRun: corpus read,
                                        # vocabulary size known, model built
    run.open_training(workdir)          # LMTrainState: params, optimizer,
                                        # router state, the attention caches
    run.next_batch()                    # {"inputs", "targets", "reset"}
    run.evaluate(final=True)            # PPL of valid / test, clean and
                                        # word-swapped

Shape letters: B training rows, M tokens per block, L attention span,
D model width.

* Data (`TextSource`): the corpus of the `data` section
  (`vmoe_ext.data.text_config.load_text_data`), cut into B contiguous rows;
  each step reads the next `[B, M]` block of every row
  (`text_stream.BlockIterator`); its position is the data state a
  checkpoint stores.
* State: `LMTrainState`, the train state plus one `[B, L, D]` cache per
  layer, split over the mesh by rows like the batch; a checkpoint holds the
  caches, so a resumed run is bit-identical to an uninterrupted one.
* Train step (`make_lm_train_step`): the caches of rows the iterator flags
  `reset` are zeroed, the token NLL plus the auxiliary losses is minimised,
  the new caches are kept.
* Evaluation: during training (`train.eval_every`) the validation PPL; at
  the end the validation and test PPL, and on the word-swapped copies of
  both the attacked PPL (`vmoe_ext.evaluate.lm_eval`); byte-level corpora
  report bits per character instead. After it, each split's per-block
  losses (`per_block.npz`, for paired comparisons of two models on the same
  text) and the routing analysis of the test split (load balance, router
  instability, Symphony's graph).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np

from vmoe_ext.app.context import RunContext, resolved
from vmoe_ext.data.text_config import (TextData, is_word_level,
                                       load_text_data)
from vmoe_ext.data.text_stream import BlockIterator
from vmoe_ext.errors import require
from vmoe_ext.evaluate import per_block
from vmoe_ext.evaluate.lm_eval import (ATTACKED_SPLITS, CLEAN_SPLITS,
                                       StreamStep, evaluate_text,
                                       text_final_evaluations)
from vmoe_ext.models import build_model
from vmoe_ext.reporting.writers import MetricWriter
from vmoe_ext.sharding.partitioning import Partitioning
from vmoe_ext.train.lm_steps import LMTrainState, make_lm_train_step
from vmoe_ext.train.optimizer import make_learning_rate
from vmoe_ext.train.state import TrainState


class TextSource:
  """A language-model run's data, read on first use.

  Args:
    data: the resolved `data` section (`name="text"`).
    seed: the run's seed (the restart offsets of the training blocks).
  """
  # The rows every process reads in full (each takes its share).
  local_train = False
  local_eval = False

  def __init__(self, data: Mapping[str, Any], seed: int):
    self.config = data
    self.seed = seed
    self._text: Optional[TextData] = None
    self._train: Optional[BlockIterator] = None

  @property
  def text(self) -> TextData:
    """The corpus, its evaluation splits and the batch sizes."""
    if self._text is None:
      self._text = load_text_data(self.config)
    return self._text

  def train_iterator(self) -> BlockIterator:
    """The training blocks (one per source; its state is the data position
    a checkpoint stores)."""
    if self._train is None:
      self._train = self.text.train_blocks(self.seed)
    return self._train

  def close(self) -> None:
    """Nothing to stop (in memory)."""


def _bpc_or_ppl(metrics: Mapping[str, Any], prefix: str) -> str:
  if f"{prefix}bpc" in metrics:
    return f"bpc {metrics[f'{prefix}bpc']:.4f}"
  return f"ppl {metrics[f'{prefix}ppl']:.2f}"


@dataclasses.dataclass
class LanguageRun(RunContext):
  """The run of a language model (module docstring); `data` is a
  `TextSource`; `final_blocks`: each split's per-block losses of the last
  final evaluation (`vmoe_ext.evaluate.per_block`)."""
  final_blocks: dict[str, tuple[float, ...]] = dataclasses.field(
      default_factory=dict)

  @classmethod
  def assemble(cls, config: Any, *, data: Optional[TextSource] = None,
               partitioning: Optional[Partitioning] = None
               ) -> "LanguageRun":
    """Resolves `config`, checks the model, reads the corpus (a
    `model.vocab_size` of None becomes its vocabulary size; another value
    must equal it), checks the batch sizes against the mesh and builds the
    model. Errors name the field; nothing is compiled."""
    config = resolved(config)
    if partitioning is None:
      partitioning = Partitioning.from_config(config.sharding)
    vocab = config.model.vocab_size
    # The model's own checks first (a stand-in vocabulary), then the data.
    build_model({**config.model.to_dict(), "vocab_size": vocab or 1})
    if data is None:
      data = TextSource(config.data, config.seed)
    text = data.text
    require(vocab in (None, text.vocab_size), "model.vocab_size",
            f"{vocab} differs from the {text.vocab_size} tokens of the "
            f"corpus ({text.corpus.name}); set it to None to take the "
            "corpus's vocabulary")
    config.model.vocab_size = text.vocab_size
    partitioning.check_batch_size(text.batch_size, "data.batch_size")
    partitioning.check_batch_size(text.eval_batch_size,
                                  "data.eval_batch_size"
                                  if config.data.eval_batch_size
                                  else "data.batch_size")
    model = build_model(config.model, partitioning.expert_parallel)
    return cls(config, partitioning, model, data)

  @property
  def text(self) -> TextData:
    return self.data.text

  # -------------------------------------------------------------- training

  def training_inputs(self) -> tuple[Any, ...]:
    """Opens the training blocks; `model.init`'s inputs are a block of
    this process's rows and their zero caches."""
    self.data.train_iterator()
    rows = self.text.batch_size // jax.process_count()
    return (np.zeros((rows, self.text.block_size), np.int32),
            tuple(np.asarray(c) for c in self.model.zero_cache(rows)))

  def state_shardings(self, state: LMTrainState) -> Any:
    """The partition rules' shardings, the caches split by rows."""
    return self.partitioning.shardings(state).replace(
        cache=tuple(self.partitioning.batch for _ in state.cache))

  def initial_state(self, variables: Any, tx: Any, key: jax.Array
                    ) -> LMTrainState:
    """`LMTrainState` at step 0 with zero caches of the B training rows."""
    cache = jax.jit(lambda: self.model.zero_cache(self.text.batch_size),
                    out_shardings=self.partitioning.batch)()
    state = LMTrainState.create_lm(variables, tx, key, cache)
    return jax.device_put(state, self.state_shardings(state))

  def make_train_step(self) -> Callable:
    """The jitted LM train step (`make_lm_train_step`): state in and out
    with its shardings (donated), the block split by rows."""
    step = make_lm_train_step(
        self.model, learning_rate_fn=make_learning_rate(self.config.optimizer))
    shardings = self.state_shardings(self.state)
    return jax.jit(step, in_shardings=(shardings, self.partitioning.batch),
                   out_shardings=(shardings, self.partitioning.replicated),
                   donate_argnums=0)

  def next_batch(self) -> dict:
    """The next block of every row: `inputs`, `targets` `[B, M]` and
    `reset` `[B]` (the iterator's flag for every row), split over the
    mesh."""
    block = next(self.data.train_iterator())
    rows = block["inputs"].shape[0]
    return self.global_batch({
        "inputs": block["inputs"], "targets": block["targets"],
        "reset": np.full((rows,), bool(block["reset"]))}, local=False)

  def progress_metrics(self, step: int, rate: float) -> dict[str, Any]:
    """Tokens seen, passes over the training rows (`epoch`; the papers'
    "epochs" are 1,000-step iterations), and tokens/s (a timing)."""
    text = self.text
    per_step = text.batch_size * text.block_size
    seen = step * per_step
    return {"tokens_seen": seen,
            "epoch": seen / self.data.train_iterator().rows.size,
            "tokens_per_second": rate * per_step if rate > 0 else None}

  def summary(self, metrics: dict[str, Any], training: bool = False) -> str:
    if training:
      ce = float(metrics["cross_entropy"])
      return (f"loss {float(metrics['loss']):.4f}, ppl "
              f"{math.exp(min(ce, 700.0)):.2f}, accuracy "
              f"{float(metrics['accuracy']):.4f}")
    parts = [f"{name} {_bpc_or_ppl(metrics, prefix)}"
             for name, prefix in (("valid", "valid_"), ("test", ""),
                                  ("attacked valid", "valid_attacked_"),
                                  ("attacked test", "attacked_"))
             if f"{prefix}loss" in metrics]
    return ", ".join(parts)

  # ------------------------------------------------------------ evaluation

  def open_evaluation(self, source: Optional[str] = None, *,
                      field: str = "robustness.checkpoint_dir",
                      step: Optional[int] = None) -> str:
    """The params and collections of the training workdir `source`'s
    newest checkpoint (or of `step`), no optimizer and no caches: the
    evaluation starts every split from zero caches, as the training run's
    final evaluation does. Returns a line saying what was loaded."""
    require(source is not None, field,
            "required: a language model evaluates a training run's "
            "checkpoint")
    tokens = jax.ShapeDtypeStruct((1, self.text.block_size), np.int32)
    cache = jax.eval_shape(lambda: self.model.zero_cache(1))
    entries, step = self.checkpoint_variables(source, tokens, cache,
                                              field=field, step=step)
    self.state = TrainState.for_evaluation(entries["params"],
                                           entries["collections"], step)
    return (f"Evaluated checkpoint: step {step} of "
            f"`{os.path.abspath(source)}`.")

  def evaluate(self, model: Any = None, state: Any = None, *,
               final: bool = False) -> dict[str, Any]:
    """The validation split's loss and PPL (BPC on byte-level corpora);
    `final`: the test split's too, and both word-swapped splits' (the
    attacked PPL), with the test split's routing metrics (`evaluate_text`),
    each split's per-block losses kept in `final_blocks`.
    """
    model = self.model if model is None else model
    state = self.state if state is None else state
    splits = CLEAN_SPLITS if final else ("valid",)
    if final:
      splits += tuple(s for s in ATTACKED_SPLITS
                      if s in self.text.eval_splits)
    if id(model) not in self._eval_steps:  # Jitted once per model.
      self._eval_steps[id(model)] = StreamStep(
          model, partitioning=self.partitioning)
    blocks: dict[str, tuple[float, ...]] = {}
    metrics = evaluate_text(self._eval_steps[id(model)], state.variables(),
                            self.text, splits,
                            byte_level=not is_word_level(self.config.data),
                            per_block=blocks if final else None)
    if final:
      self.final_blocks = blocks
    return metrics

  def final_evaluations(self, *, writer: MetricWriter, workdir: str,
                        records: Sequence[Mapping[str, Any]] = ()
                        ) -> list[str]:
    """`per_block.npz` (each split's per-block losses of the final
    evaluation), the routing analysis of the test split and Symphony's graph
    over training (`text_final_evaluations`)."""
    if self.final_blocks:
      per_block.write(workdir, self.final_blocks)
    return text_final_evaluations(
        self.model, self.state.variables(), self.text, writer=writer,
        step=int(self.state.step), workdir=workdir, records=records,
        partitioning=self.partitioning)


__all__ = ["LanguageRun", "TextSource"]
