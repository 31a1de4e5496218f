"""Training loop: NaN guard on the device (new) vs a host read per step (old).

    python benchmarks/train_step.py [--quick] [--repeats N]

Issue "Seams", item 7. The default config's model and optimizer
(`configs/default.py`: 4-block V-MoE, E=4, top-2, AdamW with clipping), batch
128 of random 28x28x1 images (numpy, sent to the device every step as the
real loop does), N steps from the same initial state:

* old  `jax.jit` without donation; the step returns `finite` and the loop
       reads it on the host (`bool(finite)`) after every step, then keeps or
       discards the new state;
* new  `vmoe_ext.train.steps.make_train_step` jitted with the state donated;
       a step whose loss, gradient or updated weights are non-finite is
       skipped on the device and counted in the state, which the loop reads
       back every `log_every=50` steps only;
* loss_only  the same with `guard_weights=False` (loss and gradient norm
       checked, not the updated weights): `weight_guard_vs_loss_guard_step_
       time` is the cost of the weight check (issue "Reliability", item 3).

Both loops keep the step metrics and fetch their mean at log steps, like
`train_and_evaluate`. Median of interleaved repetitions after a warm-up; each
repetition starts from a fresh copy of the initial state (not timed). The
last line printed is one JSON object with `new_vs_old_step_time` (target
<= 1.0) and the ms per step of each.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, parse_args, print_json_last  # noqa: E402

from vmoe_ext.models import build_model  # noqa: E402
from vmoe_ext.train.config_files import load_config  # noqa: E402
from vmoe_ext.train.optimizer import (make_learning_rate,  # noqa: E402
                                      make_optimizer)
from vmoe_ext.train.state import TrainState  # noqa: E402
from vmoe_ext.train.steps import (cross_entropy,  # noqa: E402
                                  make_train_step, routing_summary)

LOG_EVERY = 50
BATCH = 128


def old_train_step(model, learning_rate_fn):
  """The step before item 7: no guard on the device, `finite` returned."""
  kwargs = {"update_state": True}

  def train_step(state: TrainState, batch):
    gating, dropout = jax.random.split(state.step_key())
    mutable = list(state.collections)

    def loss_fn(params):
      out = model.apply({"params": params, **state.collections},
                        batch["image"], deterministic=False,
                        rngs={"gating": gating, "dropout": dropout},
                        mutable=mutable or False, **kwargs)
      (logits, metrics), new_collections = out if mutable else (out, {})
      ce = jnp.mean(cross_entropy(logits, batch["label"]))
      return ce + metrics["auxiliary_loss"], (ce, logits, metrics,
                                               new_collections)

    (loss, (ce, logits, metrics, collections)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    grad_norm = optax.global_norm(grads)
    new_state = state.replace(
        step=state.step + 1, params=optax.apply_updates(state.params, updates),
        opt_state=opt_state, collections=dict(collections))
    return new_state, {
        "loss": loss, "cross_entropy": ce,
        "auxiliary_loss": metrics["auxiliary_loss"],
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
        "grad_norm": grad_norm,
        "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
        "learning_rate": learning_rate_fn(state.step),
        **routing_summary(metrics)}

  return jax.jit(train_step)


def _log(history: list) -> None:
  host = jax.device_get(history)
  _ = {k: np.mean([h[k] for h in host], axis=0) for k in host[0]}


def run_old(step_fn, state, batches, num_steps: int):
  history = []
  for i in range(num_steps):
    new_state, metrics = step_fn(state, batches[i % len(batches)])
    if not bool(metrics["finite"]):  # Host sync every step.
      raise FloatingPointError(f"step {i + 1}")
    state = new_state
    history.append(metrics)
    if (i + 1) % LOG_EVERY == 0 or i + 1 == num_steps:
      _log(history)
      history = []
  return state


def run_new(step_fn, state, batches, num_steps: int):
  history = []
  for i in range(num_steps):
    state, metrics = step_fn(state, batches[i % len(batches)])
    history.append(metrics)
    if (i + 1) % LOG_EVERY == 0 or i + 1 == num_steps:
      if int(jax.device_get(state.nonfinite_count)):  # Only at log steps.
        raise FloatingPointError(f"step {int(state.first_nonfinite_step)}")
      _log(history)
      history = []
  return state


def main(argv=None) -> dict:
  args = parse_args(__doc__.splitlines()[0], argv)
  num_steps = 50 if args.quick else 200
  repeats = max(3, args.repeats if not args.quick else 3)
  config = load_config("default")
  model = build_model(config.model)
  rng = np.random.default_rng(0)
  batches = [{"image": rng.random((BATCH, 28, 28, 1), np.float32),
              "label": rng.integers(0, 10, BATCH).astype(np.int32)}
             for _ in range(4)]
  init_key, state_key = jax.random.split(jax.random.key(0))
  variables = jax.jit(model.init)(init_key, batches[0]["image"])
  state0 = TrainState.create(variables, make_optimizer(config.optimizer),
                             state_key)
  lr = make_learning_rate(config.optimizer)
  candidates = {
      "old": (run_old, old_train_step(model, lr)),
      "new": (run_new, jax.jit(make_train_step(model, learning_rate_fn=lr),
                               donate_argnums=0)),
      "loss_only": (run_new, jax.jit(make_train_step(
          model, learning_rate_fn=lr, guard_weights=False),
                                     donate_argnums=0)),
  }
  copy = lambda: jax.block_until_ready(jax.tree.map(jnp.copy, state0))
  finals = {}
  for name, (loop, fn) in candidates.items():  # Warm-up (compiles).
    finals[name] = jax.device_get(loop(fn, copy(), batches, LOG_EVERY).params)
  same = all(np.array_equal(a, b) for other in ("new", "loss_only")
             for a, b in zip(jax.tree.leaves(finals["old"]),
                             jax.tree.leaves(finals[other])))
  samples: dict[str, list[float]] = {name: [] for name in candidates}
  for _ in range(repeats):
    for name, (loop, fn) in candidates.items():
      state = copy()
      start = time.perf_counter()
      jax.block_until_ready(loop(fn, state, batches, num_steps))
      samples[name].append(time.perf_counter() - start)
  ms = {name: statistics.median(s) / num_steps * 1e3
        for name, s in samples.items()}
  print(f"machine: {machine()}")
  print(f"default model, batch {BATCH}, {num_steps} steps, log every "
        f"{LOG_EVERY}, median of {repeats}; same params after "
        f"{LOG_EVERY} steps: {same}")
  for name in candidates:
    print(f"{name:<5}{ms[name]:>10.2f} ms/step")
  figures = {
      "quick": bool(args.quick),
      "new_vs_old_step_time": ms["new"] / ms["old"],
      "new_ms_per_step": ms["new"],
      "weight_guard_vs_loss_guard_step_time": ms["new"] / ms["loss_only"],
      "loss_only_ms_per_step": ms["loss_only"],
      "old_ms_per_step": ms["old"],
      "num_steps": num_steps,
      "same_params": bool(same),
      "device": jax.devices()[0].device_kind,
  }
  print_json_last(figures)
  return figures


if __name__ == "__main__":
  main()
