"""Routing analysis of a trained model: the figures and tables router papers
show (ACMoE Table 6, appendix C.9, Fig. 1 and Fig. 4), for every run.

Over one deterministic pass of an evaluation set (padding excluded):

  * load balance per MoE layer (ACMoE Table 6): percentage of the
    token->expert assignments each expert received, score = population std
    of those percentages (`metrics.load_balance_from_counts`);
  * router instability between adjacent MoE layers (ACMoE C.9):
    `r_l = mean(|S_{l-1} - S_l|)` over all `n x n` token pairs of the whole
    set, from a `[E_prev, E_cur]` contingency table of top-1 experts
    (`metrics.router_instability_from_counts`);
  * expert-assignment maps of the first few images (ACMoE Fig. 1) and a
    t-SNE of a uniform token subsample of each MoE layer's input, coloured
    by top-1 expert (ACMoE Fig. 4) — see `routing_plots`.

Everything streams: per batch the device returns per-expert counts `[E]`,
top-1 experts `[B, T]` and a fixed number of sampled tokens; the host adds
counts (they are additive) and keeps a bottom-k random sample of tokens, so
memory does not grow with the evaluation set.

A token's top-1 expert is its only expert when its expert mask holds exactly
one (SoftMoE: the expert with the most combine weight), else the first of its
`selected_experts` (the highest gate; expert choice: the expert that picked
it with the largest weight); -1 when it has none (an expert-choice token no
expert picked), such tokens are left out of instability pairs and maps.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.evaluate.metrics import (layer_mean_std,
                                       load_balance_from_counts,
                                       router_instability_from_counts)
from vmoe_ext.naming import block_index, metric_key_of
from vmoe_ext.sharding.partitioning import Partitioning
from vmoe_ext.train.forward import Forward

Array = jax.Array
MAP_IMAGES = 8        # images in expert_maps.png
TSNE_TOKENS = 1000    # tokens per MoE layer in tsne_experts.png (default)
TSNE_ITERATIONS = 500


def top1_experts(expert_mask: Array, selected: Array) -> Array:
  """Top-1 expert of each token (see the module docstring).

  Args:
    expert_mask: `[B, T, E]` bool, the experts each token went to.
    selected: `[B, T, K]` int, the token's assignment (-1 invalid), by
      decreasing weight.

  Returns:
    `[B, T]` int32, -1 for a token without any expert.
  """
  count = jnp.sum(expert_mask, axis=-1)
  only = jnp.argmax(expert_mask, axis=-1)
  return jnp.where(count == 0, -1,
                   jnp.where(count == 1, only, selected[..., 0])
                   ).astype(jnp.int32)


def make_routing_forward(model: nn.Module,
                         partitioning: Optional[Partitioning] = None
                         ) -> Callable:
  """Jitted `forward(variables, images [B,H,W,C], example_mask [B],
  sample_index) -> {"layer_i": {...}}`, per MoE block i:
  `assignments` `[E]` int32 (token->expert assignments of real examples),
  `top1` `[B, T]` int32, `samples` `[k, D]` float32 (the MoE inputs of the
  flat token positions `sample_index` of `[B * T]`). `sample_index` is one
  `[k]` index for every layer, or `{"layer_i": [k_i]}` (layers of different
  T, e.g. a Swin's stages).

  One `vmoe_ext.train.forward.Forward` pass (images as the pipeline
  normalised them) and its jit: with a `partitioning` (a multi-process job:
  every process passes the same host arrays) images and mask become global
  arrays split over the batch, the sample index is replicated, and the
  outputs come back replicated."""
  fwd = Forward(model, partitioning=partitioning)

  def forward(variables, images, example_mask, sample_index):
    out = {}
    for block, moe in fwd.apply(variables, images,
                                intermediates=True).moe.items():
      mask = moe["expert_mask"]
      x = moe["moe_input"]
      b, t, d = x.shape
      out[metric_key_of(block)] = {
          "assignments": jnp.sum(mask & example_mask[:, None, None],
                                 axis=(0, 1), dtype=jnp.int32),
          "top1": top1_experts(mask, moe["selected_experts"]),
          "samples": x.reshape(b * t, d)[
              sample_index[metric_key_of(block)]
              if isinstance(sample_index, dict) else sample_index
          ].astype(jnp.float32),
      }
    return out

  return fwd.jit(forward, replicated=(2,))  # sample_index


class RoutingCounts:
  """Additive per-layer counts over evaluation batches.

  `assignments[layer]` `[E]` token->expert assignments (load balance);
  `joint[layer]` `[E_prev, E_cur]` contingency table of top-1 experts between
  the previous MoE layer and this one, over the tokens of real examples that
  have a top-1 at both layers (instability); only between layers over the
  same tokens (not across a Swin's patch merging, which changes them).
  """

  def __init__(self):
    self.assignments: dict[str, np.ndarray] = {}
    self.joint: dict[str, np.ndarray] = {}

  @property
  def layers(self) -> list[str]:
    return sorted(self.assignments, key=block_index)

  def add(self, assignments: Mapping[str, Any], top1: Mapping[str, Any],
          example_mask: Any) -> None:
    """Adds one batch.

    Args:
      assignments: `{layer: [E]}` assignment counts of the batch's real
        examples (e.g. `metrics.assignment_counts(mask, token_mask)`).
      top1: `{layer: [B, T]}` int top-1 expert (-1: none).
      example_mask: `[B]` bool, False on padding.
    """
    for layer, counts in assignments.items():
      counts = np.asarray(counts, np.int64)
      self.assignments[layer] = self.assignments.get(layer, 0) + counts
    layers = sorted(assignments, key=block_index)
    valid = np.asarray(example_mask, bool)[:, None]
    for prev, cur in zip(layers, layers[1:]):
      a, b = np.asarray(top1[prev]), np.asarray(top1[cur])
      if a.shape != b.shape:  # Other tokens (a Swin's next stage): no pair.
        continue
      e_prev, e_cur = len(self.assignments[prev]), len(self.assignments[cur])
      keep = valid & (a >= 0) & (b >= 0)
      joint = np.bincount(a[keep].astype(np.int64) * e_cur + b[keep],
                          minlength=e_prev * e_cur).reshape(e_prev, e_cur)
      self.joint[cur] = self.joint.get(cur, 0) + joint

  def metrics(self) -> dict[str, Any]:
    """The `routing` metrics line: `layer_i/load_balance`,
    `layer_i/load_percent` `[E]`, `layer_i/instability` (vs the previous MoE
    layer), `load_balance_mean` / `_std` and `instability_mean` over
    layers."""
    out: dict[str, Any] = {}
    scores, instability = [], []
    for layer in self.layers:
      balance = load_balance_from_counts(self.assignments[layer])
      out[f"{layer}/load_balance"] = balance["std"]
      out[f"{layer}/load_percent"] = balance["percent"]
      scores.append(balance["std"])
      if layer in self.joint:
        r = router_instability_from_counts(self.joint[layer])
        out[f"{layer}/instability"] = r
        instability.append(r)
    if scores:
      summary = layer_mean_std(scores)
      out["load_balance_mean"] = summary["mean"]
      out["load_balance_std"] = summary["std"]
    if instability:
      out["instability_mean"] = layer_mean_std(instability)["mean"]
    return out


class TokenSample:
  """A uniform random sample (without replacement) of at most `size` tokens
  per layer of a stream: each token gets a random key, the `size` smallest
  are kept (with the token's MoE input and top-1 expert). Layers over the
  same tokens share the keys, so they keep the same tokens."""

  def __init__(self, size: int):
    self.size = size
    self.keys: dict[str, np.ndarray] = {}
    self.tokens: dict[str, np.ndarray] = {}
    self.experts: dict[str, np.ndarray] = {}

  def add(self, keys: Any, tokens: Mapping[str, np.ndarray],
          experts: Mapping[str, np.ndarray]) -> None:
    """keys `[k]` for every layer, or `{layer: [k_l]}` (inf: padding, never
    kept), `{layer: [k_l, D]}`, `{layer: [k_l]}`."""
    for layer in tokens:
      new = np.asarray(keys[layer] if isinstance(keys, Mapping) else keys)
      finite = np.isfinite(new)
      join = lambda old, add: (np.concatenate([old[layer], add[finite]])
                               if layer in old else add[finite])
      all_keys = join(self.keys, new)
      all_tokens = join(self.tokens, np.asarray(tokens[layer]))
      all_experts = join(self.experts, np.asarray(experts[layer]))
      keep = np.argsort(all_keys, kind="stable")[:self.size]
      self.keys[layer] = all_keys[keep]
      self.tokens[layer] = all_tokens[keep]
      self.experts[layer] = all_experts[keep]


@dataclasses.dataclass
class RoutingAnalysis:
  """What `analyze_routing` found.

  Attributes:
    metrics: the `routing` metrics line (`RoutingCounts.metrics`) plus
      `num_examples`.
    num_experts: `{layer: E}`.
    images: `[n, H, W, C]` the `map_examples` images as the model saw them
      (resized), in [0, 1].
    maps: `{layer: [n, h, w]}` int top-1 expert per token of the layer's
      grid (a ViT's `H/ph x W/pw`; a Swin stage's), -1: none; a layer is
      left out when its grid is unknown.
    sample: the MoE-input token sample (`TokenSample`).
  """
  metrics: dict[str, Any]
  num_experts: dict[str, int]
  images: np.ndarray
  maps: dict[str, np.ndarray]
  sample: TokenSample


def analyze_routing(model: nn.Module, variables: Mapping[str, Any],
                    batches: Iterable[Mapping[str, Any]], *,
                    mean: Any = 0.0, std: Any = 1.0,
                    map_examples: Sequence[int] = tuple(range(MAP_IMAGES)),
                    num_tokens: int = TSNE_TOKENS, seed: int = 0,
                    on_batch: Optional[Callable[[], None]] = None,
                    partitioning: Optional[Partitioning] = None
                    ) -> Optional[RoutingAnalysis]:
  """One pass over `batches` (`eval_batches`: normalised `image`, `mask`);
  None for a model without MoE layers.

  Args:
    model, variables: the trained model.
    batches: every evaluation example once, in order, padded.
    mean, std: undo the normalisation for the images of the maps.
    map_examples: positions (among the real examples, in order) of the
      images of the expert maps. `model.token_grid(block, (H, W))` gives
      each layer's patch grid and the leading non-patch tokens (a class
      token), left out of the maps: a ViT's patch grid, a Swin stage's
      grid (each token a `2^s x 2^s` block of patches after s merges).
    num_tokens: size of the uniform token sample for the t-SNE.
    seed: of that sample.
    on_batch: called after each batch (progress).
    partitioning: the run's mesh, for a model whose variables are global
      arrays of a multi-process job (see `make_routing_forward`).
  """
  if not getattr(model, "moe_layers", ()):
    return None
  forward = make_routing_forward(model, partitioning)
  variables = {k: v for k, v in variables.items() if k != "intermediates"}
  rng = np.random.default_rng(seed)
  counts, sample = RoutingCounts(), TokenSample(num_tokens)
  images: list[np.ndarray] = []
  maps: dict[str, list[np.ndarray]] = {}
  wanted = np.asarray(sorted(set(map_examples)), np.int64)
  num_examples, tokens = 0, None
  for batch in batches:
    x = np.asarray(batch["image"], np.float32)
    valid = np.asarray(batch["mask"], bool)
    b, h, w = x.shape[:3]
    if tokens is None:  # Tokens per image T of each layer, as they see them.
      shapes = jax.eval_shape(forward, variables, x, valid,
                              np.zeros(1, np.int32))
      tokens = {l: o["top1"].shape[1] for l, o in shapes.items()}
      grids = {l: _map_grid(model, l, (h, w), t) for l, t in tokens.items()}
    # One key per token of each distinct T (layers over the same tokens
    # share theirs), drawn in layer order.
    keys: dict[int, np.ndarray] = {}
    for t in tokens.values():
      if t not in keys:
        keys[t] = rng.random((b, t))
        keys[t][~valid] = np.inf
    index = {t: np.argsort(v.reshape(-1), kind="stable")[:min(num_tokens,
                                                             b * t)]
             for t, v in keys.items()}
    out = jax.device_get(forward(variables, x, valid,
                                 {l: index[t] for l, t in tokens.items()}))
    top1 = {l: np.asarray(o["top1"]) for l, o in out.items()}
    counts.add({l: o["assignments"] for l, o in out.items()}, top1, valid)
    sample.add({l: keys[t].reshape(-1)[index[t]] for l, t in tokens.items()},
               {l: np.asarray(o["samples"]) for l, o in out.items()},
               {l: v.reshape(-1)[index[tokens[l]]] for l, v in top1.items()})
    positions = np.flatnonzero(valid)
    real = positions[np.isin(num_examples + np.arange(len(positions)),
                             wanted)]
    num_examples += len(positions)
    if len(real):
      images.append(np.clip(x[real] * np.asarray(std) + np.asarray(mean),
                            0.0, 1.0))
      for layer, v in top1.items():
        if grids[layer] is not None:  # Else an unknown layout: no map.
          gh, gw, skip = grids[layer]
          maps.setdefault(layer, []).append(v[real, skip:].reshape(
              len(real), gh, gw))
    if on_batch is not None:
      on_batch()
  metrics = {**counts.metrics(), "num_examples": num_examples}
  return RoutingAnalysis(
      metrics=metrics,
      num_experts={l: len(c) for l, c in counts.assignments.items()},
      images=(np.concatenate(images) if images
              else np.zeros((0, 1, 1, 1), np.float32)),
      maps={l: np.concatenate(v) for l, v in maps.items()},
      sample=sample)


def _map_grid(model: nn.Module, layer: str, image_size: tuple[int, int],
              tokens: int) -> Optional[tuple[int, int, int]]:
  """`(h, w, extra)` of the patch grid behind layer `layer`'s T tokens, or
  None when the model does not say (no `token_grid`) or T does not match."""
  if not hasattr(model, "token_grid"):
    return None
  gh, gw, extra = model.token_grid(block_index(layer), image_size)
  return (gh, gw, extra) if gh * gw + extra == tokens else None


def tsne_embedding(tokens: np.ndarray, seed: int = 0,
                   iterations: int = TSNE_ITERATIONS) -> np.ndarray:
  """2-D t-SNE (scikit-learn, PCA init, fixed seed) of tokens `[m, D]`.

  Tokens wider than 50 are first projected on their 50 principal axes (the
  usual t-SNE preprocessing). One OpenMP thread: the run's other threads are
  idle by then and several threads thrash on a busy machine.
  """
  from sklearn.manifold import TSNE
  from threadpoolctl import threadpool_limits

  x = np.asarray(tokens, np.float64)
  x = x - x.mean(axis=0)
  if x.shape[1] > 50:
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    x = x @ vt[:50].T
  steps = ("max_iter" if "max_iter" in inspect.signature(TSNE).parameters
           else "n_iter")  # scikit-learn < 1.5 calls it n_iter.
  tsne = TSNE(n_components=2, perplexity=min(30.0, (len(x) - 1) / 3.0),
              init="pca", random_state=seed, **{steps: iterations})
  with threadpool_limits(limits=1, user_api="openmp"):
    return tsne.fit_transform(x).astype(np.float32)
