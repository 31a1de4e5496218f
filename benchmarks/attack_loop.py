"""Cost of the attack loops against one forward+backward pass of the model.

    python benchmarks/attack_loop.py [--quick] [--repeats N]

Model: the default MNIST V-MoE (`configs/default.py`: 4 blocks, D=64, MoE in
blocks 1 and 3 with E=4, top-2, groups of 8 images), random parameters,
images `[B, 28, 28, 1]`, run deterministically. Candidates, each one jitted
function of `(variables, x, labels)` measured side by side in one process
(median of interleaved repetitions after warm-up):

* fwd_bwd  one forward+backward: the gradient of the mean CE w.r.t. `x`;
* fgsm     FGSM (one gradient step);
* pgd      Linf PGD with k steps (random start, one restart);
* apgd     APGD-CE with n iterations (Linf, one restart), the images labelled
           with the model's own predictions and attacked at eps = 0, so that
           no example is ever misclassified and all n iterations run (no
           early stop).

Figures: `pgd_overhead_ratio = t(pgd) / (k * t(fwd_bwd))` (target <= 1.15),
`apgd_overhead_ratio = t(apgd) / (n * t(fwd_bwd))` (target <= 1.15),
`fgsm_ratio = t(fgsm) / t(fwd_bwd)`, and, measured separately (they are much
longer), `spsa_seconds_per_image`: SPSA with early stop off (the full budget of
`steps * 2 * samples` forward passes) divided by B, and
`square_seconds_per_image`: Square (Linf) with its full query budget (eps = 0:
no example is ever broken) divided by B. The last line printed is one JSON
object with the figures.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    machine, parse_args, print_json_last, time_side_by_side)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                ".."))
from configs import default as default_config  # noqa: E402

from vmoe_ext import attacks  # noqa: E402
from vmoe_ext.attacks.apgd import apgd as apgd_attack  # noqa: E402
from vmoe_ext.attacks.square import square as square_attack  # noqa: E402
from vmoe_ext.models import build_model  # noqa: E402

FULL = dict(batch=64, pgd_steps=10, apgd_steps=100, spsa_steps=20,
            spsa_samples=64, spsa_repeats=3, square_queries=1000)
QUICK = dict(batch=16, pgd_steps=5, apgd_steps=10, spsa_steps=4,
             spsa_samples=16, spsa_repeats=2, square_queries=50)
EPS = 0.1


def make_model(batch: int):
  """Default MNIST V-MoE, random parameters (incl. a non-zero head), data."""
  model = build_model(default_config.get_config().model)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.uniform(size=(batch, 28, 28, 1)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, batch), jnp.int32)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  # The head is zero-initialised (zero input gradients): randomise it.
  variables = jax.tree_util.tree_map_with_path(
      lambda path, p: (0.1 * jax.random.normal(jax.random.key(1), p.shape)
                       if "head" in jax.tree_util.keystr(path) else p),
      variables)
  return model, variables, x, labels


def main(argv=None) -> dict:
  args = parse_args(__doc__.splitlines()[0], argv)
  s = QUICK if args.quick else FULL
  k, b = s["pgd_steps"], s["batch"]
  model, variables, x, labels = make_model(b)

  def logits_of(v):
    return lambda z: model.apply(v, z, deterministic=True)[0]

  def loss(v, z, y):
    return jnp.mean(attacks.cross_entropy(logits_of(v)(z), y))

  fwd_bwd = jax.jit(jax.grad(loss, argnums=1))
  fgsm = jax.jit(lambda v, z, y: attacks.fgsm(logits_of(v), z, y, eps=EPS))
  pgd = jax.jit(lambda v, z, y, key: attacks.pgd(
      logits_of(v), z, y, eps=EPS, steps=k, key=key))
  n = s["apgd_steps"]
  # eps = 0 and the model's own predictions as labels: no example is ever
  # misclassified, so every iteration runs (the worst case for the loop).
  own = jnp.argmax(logits_of(variables)(x), -1).astype(jnp.int32)
  apgd = jax.jit(lambda v, z, y, key: apgd_attack(
      logits_of(v), z, y, eps=0.0, steps=n, key=key))
  square = jax.jit(lambda v, z, y, key: square_attack(
      logits_of(v), z, y, eps=0.0, queries=s["square_queries"], key=key))
  spsa = jax.jit(lambda v, z, y, key: attacks.spsa(
      logits_of(v), z, y, eps=EPS, steps=s["spsa_steps"],
      samples=s["spsa_samples"], key=key, early_stop=False))
  key = jax.random.key(2)

  times = time_side_by_side({
      "fwd_bwd": lambda: fwd_bwd(variables, x, labels),
      "fgsm": lambda: fgsm(variables, x, labels),
      "pgd": lambda: pgd(variables, x, labels, key),
      "apgd": lambda: apgd(variables, x, own, key),
  }, repeats=max(5, args.repeats))
  spsa_time = time_side_by_side(
      {"spsa": lambda: spsa(variables, x, labels, key)},
      repeats=s["spsa_repeats"], warmup=1)["spsa"]
  square_time = time_side_by_side(
      {"square": lambda: square(variables, x, own, key)},
      repeats=s["spsa_repeats"], warmup=1)["square"]

  x_adv = pgd(variables, x, labels, key)
  clean_acc = float(jnp.mean(jnp.argmax(logits_of(variables)(x), -1)
                             == labels))
  adv_acc = float(jnp.mean(jnp.argmax(logits_of(variables)(x_adv), -1)
                           == labels))
  spsa_forwards = s["spsa_steps"] * 2 * s["spsa_samples"]
  print(f"machine: {machine()}")
  print(f"model: default MNIST V-MoE, B={b}, images 28x28x1; eps={EPS}")
  print(f"{'candidate':<22}{'median ms':>12}{'per fwd+bwd':>14}")
  print(f"{'fwd_bwd':<22}{times['fwd_bwd'] * 1e3:>12.2f}{1.0:>14.3f}")
  print(f"{'fgsm':<22}{times['fgsm'] * 1e3:>12.2f}"
        f"{times['fgsm'] / times['fwd_bwd']:>14.3f}")
  print(f"{f'pgd k={k}':<22}{times['pgd'] * 1e3:>12.2f}"
        f"{times['pgd'] / times['fwd_bwd']:>14.3f}")
  print(f"{f'apgd-ce n={n}':<22}{times['apgd'] * 1e3:>12.2f}"
        f"{times['apgd'] / times['fwd_bwd']:>14.3f}")
  print(f"{'square (full budget)':<22}{square_time * 1e3:>12.1f}"
        f"{square_time / times['fwd_bwd']:>14.1f}  "
        f"({s['square_queries']} queries)")
  print(f"{'spsa (no early stop)':<22}{spsa_time * 1e3:>12.1f}"
        f"{spsa_time / times['fwd_bwd']:>14.1f}  "
        f"({s['spsa_steps']} steps x {s['spsa_samples']} mirrored samples = "
        f"{spsa_forwards} forwards)")
  print(f"(random-parameter model: accuracy clean {clean_acc:.2f}, "
        f"after PGD {adv_acc:.2f})")
  figures = {
      "quick": bool(args.quick),
      "batch": b,
      "pgd_steps": k,
      "pgd_overhead_ratio": times["pgd"] / (k * times["fwd_bwd"]),
      "apgd_steps": n,
      "apgd_overhead_ratio": times["apgd"] / (n * times["fwd_bwd"]),
      "square_queries": s["square_queries"],
      "square_seconds_per_image": square_time / b,
      "fgsm_ratio": times["fgsm"] / times["fwd_bwd"],
      "spsa_seconds_per_image": spsa_time / b,
      "spsa_steps": s["spsa_steps"],
      "spsa_samples": s["spsa_samples"],
      "fwd_bwd_ms": times["fwd_bwd"] * 1e3,
      "pgd_ms": times["pgd"] * 1e3,
      "apgd_ms": times["apgd"] * 1e3,
      "square_ms": square_time * 1e3,
      "fgsm_ms": times["fgsm"] * 1e3,
      "spsa_ms": spsa_time * 1e3,
  }
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
