"""The routing analysis of a run's final evaluation: one `routing` line in
`metrics.jsonl`, `expert_maps.png`, `tsne_experts.png` (at most
`MAX_TSNE_LAYERS` MoE layers: a t-SNE takes seconds a layer),
`symphony_adjacency.png` and the report's "## Routing analysis" section."""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Sequence

import flax.linen as nn
import ml_collections
import numpy as np

from vmoe_ext.data import ArrayDataset, default_normalization, eval_batches
from vmoe_ext.evaluate.routing_analysis import (MAP_IMAGES, RoutingAnalysis,
                                                analyze_routing, tsne_embedding)
from vmoe_ext.evaluate.routing_plots import (plot_expert_maps,
                                             plot_router_state_heatmaps,
                                             plot_tsne)
from vmoe_ext.naming import block_index
from vmoe_ext.reporting.report_parts import markdown_table
from vmoe_ext.reporting.progress import (BatchProgress, progress_bar,
                                         progress_line)
from vmoe_ext.reporting.writers import MetricWriter
from vmoe_ext.sharding.multihost import is_main_process

SPLIT = "routing"
EXPERT_MAPS = "expert_maps.png"
TSNE = "tsne_experts.png"
ADJACENCY = "symphony_adjacency.png"
MIN_TSNE_TOKENS = 10
MAX_TSNE_LAYERS = 4  # Panels of the t-SNE figure (`tsne_layers`).


def evaluate_routing(model: nn.Module, variables: Mapping[str, Any],
                     test: ArrayDataset,
                     data_config: ml_collections.ConfigDict, *,
                     batch_size: int, writer: MetricWriter, step: int,
                     workdir: str,
                     records: Sequence[Mapping[str, Any]] = (),
                     seed: int = 0, partitioning: Any = None) -> list[str]:
  """Analyses the routing of `test` and writes line, PNGs and section.

  Args:
    model, variables: the trained model.
    test: the raw test split (every example once, padded batches).
    data_config: its preprocessing (`image_size`, normalisation) and
      `analysis_tsne_tokens`.
    batch_size: evaluation batch size.
    writer, step: where the `routing` line goes.
    workdir: where the PNGs go.
    records: the training record (`metrics.jsonl`), for the router-state
      heatmaps over training.
    seed: the token subsample of the t-SNE.
    partitioning: the run's mesh, for global variables of a multi-process
      job (`analyze_routing`).

  Returns:
    `["## Routing analysis ..."]`, or `[]` for a model without MoE layers.
  """
  start = time.time()
  mean, std = default_normalization(data_config)
  batches = eval_batches(test, batch_size,
                         image_size=data_config.get("image_size"), mean=mean,
                         std=std)
  num_batches = -(-len(test) // batch_size)
  with progress_bar(total=num_batches, desc="routing") as bar:
    progress = BatchProgress(bar, num_batches, "evaluate: routing analysis")
    analysis = analyze_routing(model, variables, batches, mean=mean, std=std,
                               map_examples=map_examples(len(test)),
                               num_tokens=data_config.analysis_tsne_tokens,
                               seed=seed, on_batch=progress.update,
                               partitioning=partitioning)
    if analysis is None:
      return []
    # Not marked final: like the robustness lines, only the clean `test`
    # line is (tools read `accuracy` from the final line).
    writer.write(step, SPLIT, analysis.metrics)
    # One process writes the PNGs (and pays for the t-SNE).
    figures = (_figures(analysis, records, workdir, seed)
               if is_main_process() else [])
    m = analysis.metrics
    progress_line(bar, f"routing: load balance {m['load_balance_mean']:.3f}"
                  + (f", instability {m['instability_mean']:.3f}"
                     if "instability_mean" in m else "")
                  + f" ({time.time() - start:.1f} s)")
  return [routing_section(analysis, figures)]


def map_examples(num_examples: int, count: int = MAP_IMAGES) -> list[int]:
  """`count` test images evenly spaced over the split, the first included
  (the built-in test splits are stored class by class: the first few
  images would all show one class)."""
  return sorted(set(np.linspace(0, max(num_examples - 1, 0), count)
                    .round().astype(int).tolist())) if num_examples else []


def tsne_layers(layers: Sequence[str],
                max_layers: int = MAX_TSNE_LAYERS) -> list[str]:
  """The MoE layers of the t-SNE figure: all of them up to `max_layers`,
  else `max_layers` evenly spaced by block, the first and last included (a
  t-SNE costs seconds a layer: a Swin-MoE-S has ten MoE layers)."""
  layers = sorted(layers, key=block_index)
  if len(layers) <= max_layers:
    return layers
  picks = np.linspace(0, len(layers) - 1, max_layers).round().astype(int)
  return [layers[i] for i in sorted(set(picks.tolist()))]


def _figures(analysis: RoutingAnalysis, records, workdir: str,
             seed: int) -> list[tuple[str, str]]:
  """Writes the PNGs; `[(caption, file name)]` of those written."""
  out = []
  if plot_expert_maps(analysis.images, analysis.maps, analysis.num_experts,
                      os.path.join(workdir, EXPERT_MAPS)):
    out.append(("expert maps", EXPERT_MAPS))
  sample = analysis.sample
  enough = [l for l, x in sample.tokens.items() if len(x) >= MIN_TSNE_TOKENS]
  layers = tsne_layers(enough)
  embeddings = {l: tsne_embedding(sample.tokens[l], seed) for l in layers}
  some = (f" ({', '.join(layers)} of {len(enough)} MoE layers)"
          if len(layers) < len(enough) else "")
  if plot_tsne(embeddings, sample.experts, analysis.num_experts,
               os.path.join(workdir, TSNE)):
    out.append((f"t-SNE of MoE inputs{some}", TSNE))
  if plot_router_state_heatmaps(records, os.path.join(workdir, ADJACENCY)):
    out.append(("Symphony adjacency over training", ADJACENCY))
  return out


def routing_table(metrics: Mapping[str, Any],
                  num_experts: Mapping[str, int]) -> str:
  """The markdown table of a `routing` metrics line: per MoE layer its
  experts, load-balance score, expert loads and instability, then the mean
  over layers (`{layer: E}` lists the layers)."""
  m = metrics
  layers = sorted(num_experts, key=block_index)
  rows, previous = [], None
  for layer in layers:
    percent = ", ".join(f"{p:.1f}" for p in np.asarray(
        m[f"{layer}/load_percent"]))
    r = m.get(f"{layer}/instability")
    rows.append([layer, num_experts[layer],
                 m[f"{layer}/load_balance"], percent,
                 "-" if r is None else f"{r:.4f} (vs {previous})"])
    previous = layer
  rows.append(["mean ± std over layers", "",
               f"{m['load_balance_mean']:.4f} ± {m['load_balance_std']:.4f}",
               "", (f"{m['instability_mean']:.4f} (mean)"
                    if "instability_mean" in m else "-")])
  return markdown_table(["MoE layer", "experts",
                         "load-balance score (std of %)", "expert load (%)",
                         "instability vs previous MoE layer"], rows)


def routing_section(analysis: RoutingAnalysis,
                    figures: Sequence[tuple[str, str]]) -> str:
  """The report's "## Routing analysis" markdown."""
  m = analysis.metrics
  text = (
      "## Routing analysis\n\n"
      f"Test split, {m['num_examples']} images, deterministic routing "
      "(padding excluded). Load balance (ACMoE Table 6): the share of "
      "token->expert assignments each expert received, in %; the score is "
      "the population std of those percentages (0 = perfectly balanced). "
      "Router instability (ACMoE C.9): the fraction of token pairs whose "
      "'same top-1 expert' relation differs between this MoE layer and the "
      "previous one (0 = the same clustering of tokens).\n\n"
      + routing_table(m, analysis.num_experts))
  if figures:
    text += "\n\n" + "\n".join(f"![{c}]({f})" for c, f in figures)
  return text
