"""Activation profiling of a dense MLP (CMoE step 1; docs/carving.md,
"The algorithm").

For calibration tokens `X` `[N, D]` (the MLP's inputs: the block's
pre-LayerNorm output) the hidden state is `H = act(X W_0 + b_0)` `[N, H]`
(gated: `silu(X W_0 + b_0) * (X W_up + b_up)`). With `normalize=True` (the
paper's practice for SwiGLU, "to eliminate the influence of their
magnitudes") every pre-activation is divided by the norms of its token and of
its neuron's input weights, `(x . w_i + b_i) / (|x| |w_i|)`, which is the
paper's `X̂ Ŵ` for bias-free weights (LLaMA's) and keeps the bias in
proportion otherwise.

A token marks its `K_a` hidden units of largest `|h|` (ATopK, Eq. 5; ties go
to the lower unit index); a unit's activation rate is the fraction of tokens
that mark it (Eq. 7). Everything here is NumPy on the host: carving runs once.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from vmoe_ext.moe.experts import GATED, check_activation

ArrayTree = Mapping[str, Mapping[str, np.ndarray]]


def _gelu(v: np.ndarray) -> np.ndarray:
  """flax's `nn.gelu` (tanh approximation), the ViT MLP's activation."""
  return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi)
                                  * (v + 0.044715 * v ** 3)))


def _gelu_exact(v: np.ndarray) -> np.ndarray:
  """The erf form `v Phi(v)` (torch's default `nn.GELU()`)."""
  import scipy.special  # Here: ~0.1 s to import, for this activation only.
  return 0.5 * v * (1.0 + scipy.special.erf(v / np.sqrt(2.0)))


def _silu(v: np.ndarray) -> np.ndarray:
  return v / (1.0 + np.exp(-v))


ACTIVATION_FNS = {"gelu": _gelu, "gelu_exact": _gelu_exact,
                  "relu": lambda v: np.maximum(v, 0.0), "swiglu": _silu}


def activate(activation: str, pre: np.ndarray,
             up: np.ndarray | None = None) -> np.ndarray:
  """NumPy twin of `vmoe_ext.moe.experts.hidden_activation`."""
  out = ACTIVATION_FNS[activation](pre)
  return out * up if activation in GATED else out


def _pre_activation(layer: Mapping[str, np.ndarray], x: np.ndarray,
                    normalize: bool) -> np.ndarray:
  kernel = np.asarray(layer["kernel"], np.float64)
  pre = x @ kernel + np.asarray(layer.get("bias", 0.0), np.float64)
  if normalize:
    token_norm = np.linalg.norm(x, axis=-1, keepdims=True)
    weight_norm = np.linalg.norm(kernel, axis=0, keepdims=True)
    pre = pre / np.maximum(token_norm * weight_norm, 1e-12)
  return pre


def hidden_states(mlp: ArrayTree, x: np.ndarray, activation: str, *,
                  normalize: bool = False) -> np.ndarray:
  """`H` `[N, H]` of the dense MLP params `mlp` on tokens `x` `[N, D]`.

  Args:
    mlp: `{"Dense_0": {"kernel": [D, H], "bias": [H]}, ("Dense_up": ...)}`.
    x: calibration tokens, the MLP's inputs.
    activation: one of `vmoe_ext.moe.experts.ACTIVATIONS`.
    normalize: divide each pre-activation by `|x| |w_i|` (module doc).
  """
  check_activation(activation, "model.mlp_activation")
  x = np.asarray(x, np.float64)
  pre = _pre_activation(mlp["Dense_0"], x, normalize)
  up = (_pre_activation(mlp["Dense_up"], x, normalize)
        if activation in GATED else None)
  return activate(activation, pre, up)


def activation_markers(h: np.ndarray, k_a: int) -> np.ndarray:
  """`A` `[N, H]` bool: `A[t, i]` iff `|h[t, i]|` is among token t's K_a
  largest (ties: the lower unit index first)."""
  order = np.argsort(-np.abs(h), axis=-1, kind="stable")[:, :k_a]
  markers = np.zeros(h.shape, bool)
  np.put_along_axis(markers, order, True, axis=-1)
  return markers


def activation_rates(markers: np.ndarray) -> np.ndarray:
  """`mu` `[H]`: the fraction of tokens that mark each unit."""
  return markers.mean(axis=0)
