"""Quickstart demo: build a small V-MoE, route MNIST-5k, train briefly, report.

    python -m vmoe_ext.demo [--steps N]

It builds a 4-block ViT with sparse MoE blocks at blocks 1 and 3 (E=4 experts,
noisy top-2 routing, capacity factor 1.25, indices dispatcher), routes one
batch of MNIST-5k training images through the untrained model and prints the
per-expert load and drop rate of each MoE layer, trains it for a few hundred
Adam steps (cross-entropy + V-MoE auxiliary losses), then prints test accuracy
and the routing of the trained model. Everything runs on the CPU in about a
minute. (The full config-driven training binary is `vmoe_ext.main`, arriving
with the "runnable product" issue.)
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vmoe_ext.data import load_mnist5k
from vmoe_ext.models import build_model

MODEL = {
    "name": "vit_moe",
    "num_classes": 10,
    "patch_size": (7, 7),         # 16 patches + class token = 17 tokens
    "hidden_size": 64,
    "num_layers": 4,
    "num_heads": 4,
    "mlp_dim": 128,
    "moe": {
        "every": 2,               # MoE in blocks 1 and 3
        "num_experts": 4,
        "capacity_factor": 1.25,
        "group_size": 17 * 8,     # 8 images per routing group
        "dispatcher": "indices",
        "router": {"name": "noisy_topk", "num_selected": 2,
                   "noise_std": 1.0},
    },
}


def print_routing(metrics: dict, title: str) -> None:
  print(title)
  for name in sorted(k for k in metrics if k.startswith("layer_")):
    m = metrics[name]
    load = " ".join(f"{100 * v:5.1f}%" for v in np.asarray(m["expert_load"]))
    print(f"  {name}: expert load [{load}]  drop rate "
          f"{100 * float(m['drop_rate']):4.1f}%  importance loss "
          f"{float(m['importance_loss']):.4f}")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description="vmoe_ext quickstart demo")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch_size", type=int, default=128)
  args = parser.parse_args(argv)
  start = time.time()
  x_train, y_train = load_mnist5k("train")
  x_test, y_test = load_mnist5k("test")
  print(f"MNIST-5k: {len(x_train)} train / {len(x_test)} test images; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}")

  model = build_model(MODEL)
  bs = args.batch_size
  params = model.init(jax.random.key(0), x_train[:bs])["params"]
  n_params = sum(p.size for p in jax.tree.leaves(params))
  print(f"V-MoE: {model.num_layers} blocks, MoE at blocks {model.moe_layers}, "
        f"E={model.moe['num_experts']}, K=2, {n_params:,} parameters")

  _, metrics = jax.jit(lambda p, x: model.apply({"params": p}, x))(
      params, x_train[:bs])
  print_routing(metrics, "Routing of one batch before training:")

  optimizer = optax.adam(optax.warmup_cosine_decay_schedule(
      0.0, 3e-3, 30, args.steps))
  opt_state = optimizer.init(params)

  @jax.jit
  def train_step(params, opt_state, x, y, key):
    def loss_fn(p):
      logits, m = model.apply({"params": p}, x, deterministic=False,
                              rngs={"gating": key})
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return ce + m["auxiliary_loss"], (ce, m)

    grads, (ce, m) = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ce, m

  rng = np.random.default_rng(0)
  order = rng.permutation(len(x_train))
  key = jax.random.key(1)
  pos = 0
  for step in range(1, args.steps + 1):
    if pos + bs > len(order):
      order, pos = rng.permutation(len(x_train)), 0
    idx = order[pos:pos + bs]
    pos += bs
    key, sub = jax.random.split(key)
    params, opt_state, ce, _ = train_step(params, opt_state, x_train[idx],
                                          y_train[idx], sub)
    if step % 50 == 0 or step == 1:
      print(f"  step {step:4d}  train cross-entropy {float(ce):.4f}")

  @jax.jit
  def eval_step(params, x):
    return model.apply({"params": params}, x)

  correct, last_metrics = 0, None
  eval_bs = 200  # Divides the 1,000 test images: every example is counted.
  for i in range(0, len(x_test), eval_bs):
    logits, last_metrics = eval_step(params, x_test[i:i + eval_bs])
    correct += int(np.sum(np.argmax(logits, -1) == y_test[i:i + eval_bs]))
  accuracy = correct / len(x_test)
  print_routing(last_metrics, "Routing of the last test batch after training:")
  print(f"Test accuracy {100 * accuracy:.1f}% on {len(x_test)} images after "
        f"{args.steps} steps; wall time {time.time() - start:.0f}s")
  return {"accuracy": accuracy}


if __name__ == "__main__":
  main()
