"""Gradients against finite differences: a reference outside autodiff.

`assert_grads_match_differences` compares a gradient (typically a jitted
float32 `jax.grad`) with central differences of the same loss evaluated in
float64, one random unit direction per parameter leaf, Richardson-extrapolated
(`(4 D(h/2) - D(h)) / 3`, truncation error O(h^4)). The loss must compute in
float64 when given float64 params (build it from the model cloned with
`dtype=jnp.float64`); the routers still compute their logits and gates in
float32 (`.astype(jnp.float32)` in the routers), which leaves ~1e-4 of
rounding noise in the differences at h = 1e-3: the default tolerance
(1e-3 absolute + 1e-3 relative) sits above that and far below the size of
the directional derivatives (~0.1), so a missing, scaled or misrouted
gradient fails. Random routing and dropout draw the same values in both
precisions as long as their random draws do not depend on the float width.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import numpy as np


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def assert_grads_match_differences(
    loss64: Callable[[Any], Any], params: Any, grads: Any, *,
    h: float = 1e-3, rtol: float = 1e-3, atol: float = 1e-3, seed: int = 0,
    only: Optional[Callable[[str], bool]] = None) -> tuple[int, float]:
  """Asserts `<grads_leaf, v> ~ d/dt loss64(params + t v)` for every leaf.

  Args:
    loss64: the loss as a function of the params, traced with 64-bit types
      enabled (jitted once here).
    params: the point (any float dtype; evaluated in float64).
    grads: the gradient under test, same tree as `params`.
    h: the outer step of the extrapolated central difference.
    rtol, atol: `|difference - <g, v>| <= atol + rtol |difference|`.
    seed: the directions' seed.
    only: checks only the leaves whose "a/b/c" path it accepts.

  Returns:
    The number of leaves checked and `loss64(params)`.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [_path_name(p) for p, _ in flat]
  gleaves = jax.tree.leaves(grads)
  assert len(gleaves) == len(flat)
  rng = np.random.default_rng(seed)
  checked = 0
  with jax.enable_x64(True):
    point = [np.asarray(leaf, np.float64) for _, leaf in flat]
    f = jax.jit(lambda leaves: loss64(jax.tree.unflatten(treedef, leaves)))
    value = float(f(point))
    for i, (path, g) in enumerate(zip(paths, gleaves)):
      v = rng.standard_normal(point[i].shape)
      v /= np.linalg.norm(v)
      if only is not None and not only(path):
        continue

      def central(step, i=i, v=v):
        plus, minus = list(point), list(point)
        plus[i] = point[i] + step * v
        minus[i] = point[i] - step * v
        return (float(f(plus)) - float(f(minus))) / (2 * step)

      difference = (4 * central(h / 2) - central(h)) / 3
      got = float(np.sum(np.asarray(g, np.float64) * v))
      assert abs(got - difference) <= atol + rtol * abs(difference), (
          f"{path}: grad . v = {got:.6g}, finite difference {difference:.6g}")
      checked += 1
  return checked, value
