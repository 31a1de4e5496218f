"""Language-model evaluation: perplexity of whole splits, clean and word-
swapped, and the routing analysis of a split, as the papers report them.

Shape letters: B evaluation rows, M tokens per block, L attention span,
D model width, E experts.

Perplexity (`evaluate_text`): every split the data holds (`valid`, `test`,
and with the word swap on `valid_attacked`, `test_attacked`: the same text
with a random fraction of its words replaced by "AAA") is scored by
`vmoe_ext.data.text_eval.evaluate_stream`, the authors' `full_eval`: B
contiguous rows, consecutive blocks from zero caches, the caches carried,
the loss the mean over blocks of the block's mean token NLL, PPL its `exp`
(bits per character `loss / ln 2` on byte-level corpora). The model runs
deterministically (no router noise, no dropout, no state update). Metric
names: `SPLIT_PREFIX` + `loss` / `ppl` / `bpc` (`ppl` is the clean test
split's, `attacked_ppl` the word-swapped test split's, `valid_ppl`, ...).

Routing analysis (`analyze_text_routing`): over the blocks of a split, per
MoE layer, the share of token->expert assignments each expert got (ACMoE
Table 6's load balance: the std of those percentages) and the router
instability between consecutive MoE layers (ACMoE C.9: the fraction of
token pairs whose "same top-1 expert" relation differs between the two
layers, over all pairs of the split's tokens, from a contingency table of
top-1 experts: `vmoe_ext.evaluate.routing_analysis.RoutingCounts`). A
token's top-1 expert is its first selected one (the largest gate).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np

from vmoe_ext.data.text_config import TextData
from vmoe_ext.data.text_eval import StreamEval, evaluate_stream
from vmoe_ext.data.text_stream import batchify, num_eval_blocks
from vmoe_ext.evaluate.routing_analysis import RoutingCounts, top1_experts
from vmoe_ext.evaluate.routing_plots import plot_router_state_heatmaps
from vmoe_ext.evaluate.routing_report import (ADJACENCY, SPLIT,
                                              routing_table)
from vmoe_ext.naming import metric_key_of
from vmoe_ext.reporting.progress import (BatchProgress, progress_bar,
                                         progress_line)
from vmoe_ext.reporting.writers import MetricWriter
from vmoe_ext.sharding.multihost import is_main_process
from vmoe_ext.sharding.partitioning import Partitioning
from vmoe_ext.train.lm_steps import make_lm_eval_step

# Metric-name prefix of each evaluation split.
SPLIT_PREFIX = {"test": "", "valid": "valid_", "test_attacked": "attacked_",
                "valid_attacked": "valid_attacked_"}
CLEAN_SPLITS = ("valid", "test")
ATTACKED_SPLITS = ("valid_attacked", "test_attacked")


def routing_outputs(moe: Mapping[str, Mapping[str, Any]]
                    ) -> dict[str, dict[str, Any]]:
  """Per MoE layer (`layer_i`) of one block's sown intermediates:
  `assignments` `[E]` token->expert counts and `top1` `[B, M]`."""
  return {metric_key_of(block): {
      "assignments": values["expert_mask"].sum(axis=(0, 1),
                                               dtype=np.int32),
      "top1": top1_experts(values["expert_mask"],
                           values["selected_experts"])}
          for block, values in moe.items()}


class StreamStep:
  """The jitted deterministic block of `make_lm_eval_step` as an
  `evaluate_stream` step: `bind(variables)`, then `step(cache, inputs,
  targets) -> (cache, nll_sum, count)`, keeping each block's `extra`
  (routing metrics, and with `routing` the per-layer assignments and top-1
  experts) in `extras`. One jit per `StreamStep`: keep it for every split
  and evaluation of a run.

  With a `partitioning` the rows are split over the mesh (the caches with
  them), the variables stay where they are, and the per-block values come
  back replicated; host arrays become global arrays, so every process of a
  multi-process job passes the same full rows.
  """

  def __init__(self, model: nn.Module, *, routing: bool = False,
               partitioning: Optional[Partitioning] = None):
    self.model = model
    self.partitioning = partitioning
    step = make_lm_eval_step(model, routing_outputs if routing else None)
    if partitioning is None:
      self._step = jax.jit(step)
    else:
      batch, rep = partitioning.batch, partitioning.replicated
      # The variables keep the shardings they have (the state's).
      self._step = jax.jit(step, out_shardings=(batch, rep, rep, rep))
    self.variables: Mapping[str, Any] = {}
    self.extras: list[dict[str, Any]] = []

  def bind(self, variables: Mapping[str, Any]) -> "StreamStep":
    """Evaluates `variables` from now on (and forgets the extras)."""
    self.variables = {k: v for k, v in variables.items()
                      if k != "intermediates"}
    self.extras = []
    return self

  def place(self, x: Any) -> Any:
    """A host array as the step takes it (split over the mesh)."""
    if self.partitioning is None:
      return x
    return self.partitioning.global_from_full(np.asarray(x))

  def zero_cache(self, rows: int) -> tuple[Any, ...]:
    """The caches a stream starts from, `[B, L, D]` zeros per layer."""
    return tuple(self.place(np.asarray(c))
                 for c in self.model.zero_cache(rows))

  def __call__(self, cache, inputs, targets):
    cache, nll, count, extra = self._step(self.variables, cache,
                                          self.place(inputs),
                                          self.place(targets))
    self.extras.append(extra)
    return cache, nll, count


def run_split(step: StreamStep, ids: np.ndarray, *, block_size: int,
              batch_size: int, label: str) -> StreamEval:
  """`evaluate_stream` of one split's ids with `step`, from zero caches,
  with a progress bar and lines (`label`)."""
  rows = batchify(ids, batch_size, field="data.eval_batch_size")
  total = num_eval_blocks(rows.shape[1], block_size)
  with progress_bar(total=total, desc=label) as bar:
    progress = BatchProgress(bar, total, f"evaluate: {label}",
                             unit="blocks")
    return evaluate_stream(step, rows, step.zero_cache(batch_size),
                           block_size=block_size,
                           progress=lambda done, all_: progress.update())


def split_metrics(name: str, result: StreamEval, byte_level: bool
                  ) -> dict[str, Any]:
  """`{prefix}loss`, `{prefix}ppl` (or `{prefix}bpc` on byte-level
  corpora) and `{prefix}num_tokens` of one split (`SPLIT_PREFIX`)."""
  prefix = SPLIT_PREFIX[name]
  out = {f"{prefix}loss": result.loss, f"{prefix}num_tokens":
         result.num_tokens}
  if byte_level:
    out[f"{prefix}bpc"] = result.bpc
  else:
    out[f"{prefix}ppl"] = result.ppl
  return out


def evaluate_text(step: StreamStep, variables: Mapping[str, Any],
                  data: TextData, splits: Sequence[str], *,
                  byte_level: bool = False,
                  per_block: Optional[dict[str, tuple[float, ...]]] = None
                  ) -> dict[str, Any]:
  """Loss and PPL (or BPC) of `variables` on each of `splits` (names of
  `data.eval_splits`) by `step`, in one dict (module docstring), and the
  mean over the test split's blocks (else the first split's) of each MoE
  layer's routing metrics (`layer_i/expert_load`, `layer_i/drop_rate`,
  ...). With `per_block`, also each split's per-block losses into it
  (`StreamEval.block_losses`, `vmoe_ext.evaluate.per_block`)."""
  step.bind(variables)
  out: dict[str, Any] = {}
  routing_from = "test" if "test" in splits else splits[0]
  for name in splits:
    step.extras = []
    result = run_split(step, data.eval_splits[name],
                       block_size=data.block_size,
                       batch_size=data.eval_batch_size, label=name)
    out.update(split_metrics(name, result, byte_level))
    if per_block is not None:
      per_block[name] = result.block_losses
    if name == routing_from and step.extras:
      host = jax.device_get(step.extras)
      out.update({k: np.mean([np.asarray(e[k]) for e in host], axis=0)
                  for k in host[0]})
  return out


def analyze_text_routing(model: nn.Module, variables: Mapping[str, Any],
                         ids: np.ndarray, *, block_size: int,
                         batch_size: int,
                         partitioning: Optional[Partitioning] = None,
                         label: str = "routing"
                         ) -> Optional[tuple[dict[str, Any], dict[str, int]]]:
  """The routing analysis of a split's stream (module docstring): the
  `routing` metrics line (`RoutingCounts.metrics` plus `num_tokens`) and
  `{layer: E}`; None for a model without MoE layers."""
  if not getattr(model, "moe_layers", ()):
    return None
  step = StreamStep(model, routing=True, partitioning=partitioning)
  result = run_split(step.bind(variables), ids, block_size=block_size,
                     batch_size=batch_size, label=label)
  counts = RoutingCounts()
  for extra in jax.device_get(step.extras):
    top1 = {layer: np.asarray(v["top1"]) for layer, v in
            extra["sown"].items()}
    valid = np.ones(next(iter(top1.values())).shape[0], bool)
    counts.add({layer: v["assignments"] for layer, v in
                extra["sown"].items()}, top1, valid)
  metrics = {**counts.metrics(), "num_tokens": result.num_tokens}
  return metrics, {layer: len(c) for layer, c in counts.assignments.items()}


def text_routing_section(metrics: Mapping[str, Any],
                         num_experts: Mapping[str, int], split: str,
                         figures: Sequence[tuple[str, str]] = ()) -> str:
  """The report's "## Routing analysis" of a language model."""
  text = (
      "## Routing analysis\n\n"
      f"The {split} split, {metrics['num_tokens']} tokens scored in whole "
      "blocks from zero caches, the caches carried (as its perplexity); "
      "deterministic routing. Load balance (ACMoE Table 6): the share of "
      "token->expert assignments each expert received, in %; the score is "
      "the population std of those percentages (0 = perfectly balanced). "
      "Router instability (ACMoE C.9): the fraction of token pairs whose "
      "'same top-1 expert' relation differs between this MoE layer and the "
      "previous one (0 = the same clustering of tokens); a token's top-1 "
      "expert is its first selected one.\n\n"
      + routing_table(metrics, num_experts))
  if figures:
    text += "\n\n" + "\n".join(f"![{c}]({f})" for c, f in figures)
  return text


def text_final_evaluations(model: nn.Module, variables: Mapping[str, Any],
                           data: TextData, *, writer: MetricWriter,
                           step: int, workdir: str,
                           records: Sequence[Mapping[str, Any]] = (),
                           partitioning: Optional[Partitioning] = None,
                           split: str = "test") -> list[str]:
  """After training: the routing analysis of `split` (a `routing` line in
  `metrics.jsonl`, the report section) and Symphony's expert graph over
  training (`symphony_adjacency.png`, from the train lines of `records`);
  `[]` for a model without MoE layers."""
  start = time.time()
  found = analyze_text_routing(
      model, variables, data.eval_splits[split], block_size=data.block_size,
      batch_size=data.eval_batch_size, partitioning=partitioning)
  if found is None:
    return []
  metrics, num_experts = found
  writer.write(step, SPLIT, metrics)
  figures = []
  if is_main_process() and plot_router_state_heatmaps(
      records, os.path.join(workdir, ADJACENCY)):
    figures.append(("Symphony adjacency over training", ADJACENCY))
  progress_line(None, f"routing: load balance "
                f"{metrics['load_balance_mean']:.3f}"
                + (f", instability {metrics['instability_mean']:.3f}"
                   if "instability_mean" in metrics else "")
                + f" ({time.time() - start:.1f} s)")
  return [text_routing_section(metrics, num_experts, split, figures)]


def unigram_ppl(train: np.ndarray, ids: np.ndarray, vocab_size: int) -> float:
  """The perplexity of `ids` under the train split's unigram frequencies
  (add-one smoothed): the bar a language model must clear."""
  counts = np.bincount(np.asarray(train), minlength=vocab_size) + 1.0
  log_p = np.log(counts / counts.sum())
  return math.exp(-float(np.mean(log_p[np.asarray(ids)])))


__all__ = ["ATTACKED_SPLITS", "CLEAN_SPLITS", "SPLIT_PREFIX", "StreamStep",
           "analyze_text_routing", "evaluate_text", "routing_outputs",
           "run_split", "split_metrics", "text_final_evaluations",
           "text_routing_section", "unigram_ppl"]
