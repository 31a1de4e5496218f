"""Language-model method overheads at Switch-medium, for `accelerator.py`.

`configs/lm.py:switch_medium` (6 layers of D = 352, 16 experts, top-2,
WikiText-103's 267,735-word vocabulary, 48 rows of 512 tokens) and the same
with each method of `METHODS` (`configs/lm.py:switch_medium,METHOD`: the
config file's own method settings), each trained by the project's LM step
(`vmoe_ext.train.lm_steps.make_lm_train_step`: forward with the
Transformer-XL caches, backward, the config's optimizer, NaN guard; jitted,
state donated) on fixed random token ids; timed side by side with
`common.time_train_steps` (A/A control). The papers' own figures for the
same models are `accelerator_overheads.PAPER_TABLES` (ACMoE Table 7's
Switch row, Symphony Table 11, MomentumSMoE Table 11).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

METHODS = ("acmoe", "symphony", "xmoe", "momentum", "adam")
SETTING = "switch_medium"


def lm_configs(setting: str = SETTING) -> tuple[dict[str, Any], int, int]:
  """({name: model config}, rows, block size) of the baseline and each
  method."""
  from vmoe_ext.train.config_files import load_config
  base = load_config("lm", setting)
  configs = {"baseline": base.model.to_dict()}
  for method in METHODS:
    configs[method] = load_config("lm", f"{setting},{method}").model.to_dict()
  return configs, base.data.batch_size, base.data.block_size


def lm_batch(rows: int, block: int, vocab: int) -> dict[str, jax.Array]:
  """Random token ids (inputs, targets) and no cache reset."""
  rng = np.random.default_rng(0)
  ids = rng.integers(0, vocab, (rows, block + 1)).astype(np.int32)
  return {"inputs": jnp.asarray(ids[:, :-1]),
          "targets": jnp.asarray(ids[:, 1:]),
          "reset": jnp.zeros((rows,), bool)}


def compile_lm_steps(configs: Mapping[str, dict], batch: Mapping[str, Any],
                     optimizer: Mapping[str, Any]
                     ) -> tuple[dict, dict, dict]:
  """(compiled, states, XLA FLOPs) of each config's LM train step, as
  `common.compile_train_steps` for images."""
  from common import compile_donated
  from vmoe_ext.models import build_model
  from vmoe_ext.train.lm_steps import LMTrainState, make_lm_train_step
  from vmoe_ext.train.optimizer import make_learning_rate, make_optimizer

  tx = make_optimizer(dict(optimizer))
  lr = make_learning_rate(dict(optimizer))
  rows = batch["inputs"].shape[0]
  compiled, states, flops = {}, {}, {}
  for name, config in configs.items():
    model = build_model(dict(config))
    init_key, state_key = jax.random.split(jax.random.key(0))
    cache = model.zero_cache(rows)
    variables = jax.jit(model.init)(init_key, batch["inputs"], cache)
    states[name] = LMTrainState.create_lm(variables, tx, state_key, cache)
    compiled[name], flops[name] = compile_donated(
        make_lm_train_step(model, learning_rate_fn=lr), states[name], batch)
  return compiled, states, flops


def lm_overheads(steps: int, repeats: int, setting: str = SETTING) -> dict:
  """{method: {"overhead", "flops_overhead", "ms_per_step"}, "control",
  "baseline"} of the LM at `setting`."""
  from common import time_train_steps
  from vmoe_ext.train.config_files import load_config

  configs, rows, block = lm_configs(setting)
  vocab = configs["baseline"]["vocab_size"]
  optimizer = load_config("lm", setting).optimizer.to_dict()
  batch = lm_batch(rows, block, vocab)
  compiled, states, flops = compile_lm_steps(configs, batch, optimizer)
  ms, load, skipped = time_train_steps(compiled, states, batch, steps,
                                       repeats, control="baseline")
  out: dict[str, Any] = {
      m: {"overhead": ms[m] / ms["baseline"] - 1,
          "flops_overhead": flops[m] / flops["baseline"] - 1,
          "ms_per_step": ms[m], "nonfinite_steps": skipped[m]}
      for m in METHODS}
  out["control"] = {"overhead": ms["control"] / ms["baseline"] - 1}
  out["baseline"] = {"ms_per_step": ms["baseline"], "rows": rows,
                     "block": block, "load_average": load}
  return out
