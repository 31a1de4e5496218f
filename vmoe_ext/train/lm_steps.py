"""The language model's train state, train step and evaluation step.

Shape letters: B batch rows (contiguous text streams), M tokens per block,
L attention span (cache length), D model width, V vocabulary, E experts.

A language-model run carries the attention caches from step to step: row b
of step t+1 continues row b of step t, and each layer attends to the last L
hidden states of the row before the block (`vmoe_ext.models.language`). The
caches live in the train state (`LMTrainState.cache`, one `[B, L, D]` array
per layer), so a checkpoint holds them and a resumed run carries on from the
caches the interrupted one had. A training batch is

    {"inputs": [B, M] int32, "targets": [B, M] int32, "reset": [B] bool}

(`vmoe_ext.data.text_stream.BlockIterator`'s block, `reset` one flag per
row): rows whose `reset` is set start from zero caches (the first block, and
the first after the stream restarts at a random offset), as the authors'
trainer zeroes its caches there.

The loss is the mean token negative log-likelihood over the `B * M` tokens
(the authors' `nll_loss` over the flattened block) plus the model's summed
auxiliary loss (the routers' balance losses at the weights the config gives
them; the authors' gate adds none).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from vmoe_ext.train.forward import INTERMEDIATES, moe_intermediates
from vmoe_ext.train.state import TrainState
from vmoe_ext.train.steps import guarded_update, routing_summary

Array = jax.Array
Batch = dict[str, Array]
Cache = tuple[Array, ...]


@flax.struct.dataclass
class LMTrainState(TrainState):
  """`TrainState` plus the attention caches of the training rows.

  Attributes:
    cache: one `[B, L, D]` array per layer: the hidden states the next
      training block attends to (zeros at the start of a stream).
  """
  cache: Cache = ()

  @classmethod
  def create_lm(cls, variables: dict, tx: optax.GradientTransformation,
                rng: Array, cache: Sequence[Array]) -> "LMTrainState":
    """The state at step 0 (`TrainState.create`) with `cache` (zeros)."""
    base = TrainState.create(variables, tx, rng)
    return cls(step=base.step, params=base.params, opt_state=base.opt_state,
               collections=base.collections, rng=base.rng,
               nonfinite_count=base.nonfinite_count,
               first_nonfinite_step=base.first_nonfinite_step, tx=base.tx,
               cache=tuple(cache))


def token_nll(log_probs: Array, targets: Array) -> Array:
  """`[B, M, V]` log-probabilities, `[B, M]` targets -> `[B, M]` NLL."""
  return -jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32),
                              axis=-1)[..., 0]


def reset_rows(cache: Sequence[Array], reset: Array) -> Cache:
  """Zeros the `[B, L, D]` caches of the rows whose `reset` `[B]` is set."""
  keep = jnp.logical_not(reset)[:, None, None]
  return tuple(jnp.where(keep, c, jnp.zeros_like(c)) for c in cache)


def make_lm_train_step(model: nn.Module, *,
                       learning_rate_fn: Optional[Callable[[Array], Array]]
                       = None, guard_weights: bool = True
                       ) -> Callable[[LMTrainState, Batch],
                                     tuple[LMTrainState, dict]]:
  """Returns `train_step(state, batch) -> (state, metrics)` (not jitted).

  One optimizer step on one block (module docstring): the caches of the
  rows flagged `reset` are zeroed, the model runs in training mode (router
  noise from the step key's "gating" half, dropout from its "dropout" half,
  router state updated), and the new caches replace the old ones. The NaN
  guard is `make_train_step`'s: a step whose loss, gradient norm or updated
  weights are not finite keeps the old params, optimizer state and router
  state (`TrainState.commit`); the caches of such a step are zeroed (its
  hidden states cannot be trusted). Safe to jit with `donate_argnums=0`.

  Metrics: `loss` (NLL + auxiliary), `cross_entropy` (the mean token NLL,
  nats), `auxiliary_loss`, `accuracy` (next-token top-1), `grad_norm`,
  `learning_rate`, and every MoE layer's routing metrics (`layer_i/...`).
  """

  def train_step(state: LMTrainState, batch: Batch):
    gating, dropout = jax.random.split(state.step_key())
    mutable = list(state.collections)
    cache = reset_rows(state.cache, batch["reset"])
    targets = batch["targets"]

    def loss_fn(params):
      out = model.apply({"params": params, **state.collections},
                        batch["inputs"], cache, deterministic=False,
                        rngs={"gating": gating, "dropout": dropout},
                        mutable=mutable or False, update_state=True)
      (log_probs, new_cache, metrics), collections = (
          out if mutable else (out, {}))
      ce = jnp.mean(token_nll(log_probs, targets))
      loss = ce + metrics["auxiliary_loss"]
      return loss, (ce, log_probs, new_cache, metrics, collections)

    (loss, (ce, log_probs, new_cache, metrics, collections)), grads = (
        jax.value_and_grad(loss_fn, has_aux=True)(state.params))
    new_state, grad_norm, finite = guarded_update(
        state, loss, grads, collections, guard_weights)
    new_state = new_state.replace(cache=tuple(
        jnp.where(finite, c, jnp.zeros_like(c)) for c in new_cache))
    correct = jnp.argmax(log_probs, axis=-1) == targets
    out = {
        "loss": loss,
        "cross_entropy": ce,
        "auxiliary_loss": metrics["auxiliary_loss"],
        "accuracy": jnp.mean(correct.astype(jnp.float32)),
        "grad_norm": grad_norm,
        **routing_summary(metrics),
    }
    if learning_rate_fn is not None:
      out["learning_rate"] = learning_rate_fn(state.step)
    return new_state, out

  return train_step


def make_lm_eval_step(model: nn.Module,
                      sown: Optional[Callable[[Mapping[str, Any]], Any]] = None
                      ) -> Callable[..., tuple[Cache, Array, Array, dict]]:
  """Returns `eval_step(variables, cache, inputs, targets) -> (cache,
  nll_sum, count, extra)` (not jitted): one deterministic block (no router
  noise, no dropout, no state update) from `cache`.

  `nll_sum` is the summed token NLL of the `[B, M]` block and `count` its
  B*M tokens (`vmoe_ext.data.text_eval.evaluate_stream`'s step); `extra`
  holds the MoE layers' routing metrics (`layer_i/...`, `routing_summary`)
  and, with `sown`, `extra["sown"] = sown(moe)` of what the MoE layers sowed
  (`moe_intermediates`: `{block: {"expert_mask": [B, M, E],
  "selected_experts": [B, M, K], ...}}`), for the routing analysis.
  """

  def eval_step(variables, cache, inputs, targets):
    variables = {k: v for k, v in variables.items() if k != INTERMEDIATES}
    if sown is not None:
      (log_probs, new_cache, metrics), state = model.apply(
          variables, inputs, cache, deterministic=True,
          mutable=[INTERMEDIATES])
    else:
      log_probs, new_cache, metrics = model.apply(variables, inputs, cache,
                                                  deterministic=True)
    nll = token_nll(log_probs, targets)
    extra = routing_summary(metrics, exclude=("load_loss",))
    if sown is not None:
      extra["sown"] = sown(moe_intermediates(state.get(INTERMEDIATES, {})))
    return (new_cache, jnp.sum(nll), jnp.asarray(nll.size, jnp.float32),
            extra)

  return eval_step


__all__ = ["Cache", "LMTrainState", "make_lm_eval_step",
           "make_lm_train_step", "reset_rows", "token_nll"]
