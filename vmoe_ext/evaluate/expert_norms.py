"""Expert output norms of a trained model: MomentumSMoE's gradient-descent
picture of an SMoE (its Figs. 3 and 5, left).

MomentumSMoE reads an SMoE layer `x_{t+1} = x_t - gamma f(x_t)` as a
gradient step whose "gradient" is the layer's output `f(x_t)` and whose
per-objective gradients are the experts' outputs `f_i(x_t)`. Two
measurements follow, per MoE layer, over one deterministic pass of an
evaluation set (padding excluded):

  * `output_norm`: the mean over tokens of `||f(x)||`, the MoE layer's
    combined output (Fig. 3: it falls from layer to layer as a gradient's
    norm falls along a descent);
  * `rank_share [E]`: the share (%) of the token->expert selections that
    went to the expert whose output norm `||f_i(x)||` ranks r-th among the
    E experts on that token (r = 0: the largest norm); `rank_imbalance`:
    the population std of those shares (0: selection independent of the
    norm). Fig. 5 (left): an SMoE picks its smallest-norm experts most, and
    momentum balances the choice.

Every expert is evaluated on every token at the layer's input (the tokens
the router saw): exact for routers that pass the layer input to the
experts, which all MomentumSMoE settings do; a router that rescales the
experts' inputs (ACMoE's `swin` preset) is measured at the unscaled input.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vmoe_ext.errors import require
from vmoe_ext.moe.experts import mlp_experts
from vmoe_ext.naming import block_index
from vmoe_ext.train.forward import forward_pass

Array = jax.Array


def layer_statistics(x: Array, y: Array, mask: Array, valid: Array,
                     expert_params: Mapping[str, Any],
                     activation: str = "gelu") -> dict[str, Array]:
  """Additive statistics of one MoE layer on one batch.

  Args:
    x: `[B, T, D]` the layer's input (sown `moe_input`).
    y: `[B, T, D]` its output (sown `moe_output`).
    mask: `[B, T, E]` bool, the experts each token went to.
    valid: `[B]` bool, real (not padding) examples.
    expert_params: the layer's `MlpExperts` params (`[E, ...]` kernels).
    activation: the experts' activation.

  Returns:
    `norm_sum` (sum of `||y||` over real tokens), `tokens` (their number)
    and `rank_counts [E]` (selections of the expert of each norm rank,
    rank 0 the largest).
  """
  b, t, d = x.shape
  e = mask.shape[-1]
  tokens = x.reshape(1, b * t, d).astype(jnp.float32)
  outputs = mlp_experts(expert_params, jnp.broadcast_to(tokens, (e,) +
                                                        tokens.shape[1:]),
                        activation=activation)  # [E, N, D]
  norms = jnp.linalg.norm(outputs, axis=-1).T  # [N, E]
  order = jnp.argsort(-norms, axis=-1, stable=True)  # [N, E]: by rank
  rank = jnp.argsort(order, axis=-1, stable=True)  # [N, E]: expert's rank
  real = jnp.repeat(valid, t)  # [N]
  chosen = mask.reshape(b * t, e) & real[:, None]
  rank_counts = jnp.sum(jax.nn.one_hot(rank, e) * chosen[..., None],
                        axis=(0, 1))
  out_norm = jnp.linalg.norm(y.reshape(b * t, d).astype(jnp.float32),
                             axis=-1)
  return dict(norm_sum=jnp.sum(jnp.where(real, out_norm, 0.0)),
              tokens=jnp.sum(real).astype(jnp.float32),
              rank_counts=rank_counts)


def expert_params_of(params: Mapping[str, Any], block: str
                     ) -> Mapping[str, Any]:
  """The experts' params of MoE block `block` (`params[block]["Moe"]
  ["Mlp"]`, the layout of the ViT, V-MoE and stream models)."""
  node = params.get(block, {}).get("Moe", {}).get("Mlp")
  require(node is not None, "model",
          f"no expert params at params[{block!r}]['Moe']['Mlp']: the expert "
          "norm analysis reads the ViT / V-MoE parameter layout")
  return node


def expert_norms(model: Any, variables: Mapping[str, Any],
                 batches: Iterable[tuple[Any, Any]],
                 activation: str = "gelu") -> dict[str, dict[str, Any]]:
  """Per MoE block, in depth order: `output_norm`, `rank_share [E]` (%) and
  `rank_imbalance` (see the module docstring) over `batches` of
  `(images [B, H, W, C] (normalised as the model takes them),
  example_mask [B])`."""

  @jax.jit
  def step(variables, images, valid):
    moe = forward_pass(model, variables, images, intermediates=True).moe
    out = {}
    for block, sown in moe.items():
      require("moe_output" in sown, "model",
              f"MoE block {block} sows no `moe_output`")
      out[block] = layer_statistics(
          sown["moe_input"], sown["moe_output"], sown["expert_mask"], valid,
          expert_params_of(variables["params"], block), activation)
    return out

  totals: dict[str, dict[str, np.ndarray]] = {}
  for images, valid in batches:
    stats = jax.device_get(step(variables, images, jnp.asarray(valid, bool)))
    for block, values in stats.items():
      acc = totals.setdefault(block, {k: 0.0 for k in values})
      for k, v in values.items():
        acc[k] = acc[k] + np.asarray(v, np.float64)
  out = {}  # In depth order (`encoderblock_3` before `encoderblock_11`).
  for block, acc in sorted(totals.items(), key=lambda kv: block_index(kv[0])):
    share = 100.0 * acc["rank_counts"] / max(acc["rank_counts"].sum(), 1.0)
    out[block] = dict(output_norm=float(acc["norm_sum"]
                                        / max(acc["tokens"], 1.0)),
                      rank_share=share.tolist(),
                      rank_imbalance=float(np.std(share)))
  return out


__all__ = ["expert_norms", "expert_params_of", "layer_statistics"]
