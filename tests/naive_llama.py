"""Independent reference: Hugging Face's `LlamaForCausalLM` forward as a
naive NumPy loop (float64), read from its modeling code, on the raw
checkpoint tensors (torch `Linear` weights `[out, in]`, names as in the
safetensors file).

Token by token and head by head: RMSNorm `w * x / sqrt(mean(x^2) + eps)`;
rotary embedding with `inv_freq = theta^(-arange(0, d, 2) / d)`, `cos/sin`
of `position * cat(inv_freq, inv_freq)` and `rotate_half(x) = cat(-x2,
x1)`; query head j attends with key/value head `j // (Q / K)` to positions
<= its own, scores scaled by `d^-0.5`; MLP `down(silu(gate(x)) * up(x))`.
`mlp` replaces a layer's MLP (a carved layer) when given.
"""

from __future__ import annotations

import math

import numpy as np


def silu(x):
  return x / (1 + np.exp(-x))


def rms_norm(x, w, eps):
  return w * x / math.sqrt(float(np.mean(x * x)) + eps)


def rotate(x, position, theta):
  """RoPE of one head's vector `x[d]` at `position`."""
  d = len(x)
  out = np.empty(d)
  for j in range(d // 2):
    angle = position * theta ** (-2.0 * j / d)
    c, s = math.cos(angle), math.sin(angle)
    out[j] = x[j] * c - x[j + d // 2] * s
    out[j + d // 2] = x[j + d // 2] * c + x[j] * s
  return out


def dense_mlp(t, prefix, x):
  """`down(silu(gate(x)) * up(x))`, each with its bias when it has one
  (`mlp_bias`)."""
  def linear(name, v):
    y = t[prefix + name + ".weight"] @ v
    return y + t[prefix + name + ".bias"] if prefix + name + ".bias" in t \
        else y
  return linear("down_proj", silu(linear("gate_proj", x))
                * linear("up_proj", x))


def forward(tensors, config, tokens, mlp=None):
  """Logits `[T, V]` of one sequence `tokens[T]`.

  Args:
    tensors: name -> array, as the safetensors file.
    config: the `config.json` dict.
    tokens: token ids.
    mlp: optional `mlp(layer, x[D]) -> [D]` replacing layer `layer`'s MLP.
  """
  t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
  heads = config["num_attention_heads"]
  kv = config.get("num_key_value_heads") or heads
  d = config.get("head_dim") or config["hidden_size"] // heads
  eps = config.get("rms_norm_eps", 1e-6)
  theta = config.get("rope_theta", 10000.0)
  bias = config.get("attention_bias", False)
  h = [t["model.embed_tokens.weight"][i].copy() for i in tokens]
  n = len(tokens)
  for layer in range(config["num_hidden_layers"]):
    p = f"model.layers.{layer}."

    def proj(name, x):
      y = t[p + f"self_attn.{name}.weight"] @ x
      return y + t[p + f"self_attn.{name}.bias"] if bias else y

    normed = [rms_norm(x, t[p + "input_layernorm.weight"], eps) for x in h]
    q = [proj("q_proj", x).reshape(heads, d) for x in normed]
    k = [proj("k_proj", x).reshape(kv, d) for x in normed]
    v = [proj("v_proj", x).reshape(kv, d) for x in normed]
    q = [[rotate(q[i][j], i, theta) for j in range(heads)] for i in range(n)]
    k = [[rotate(k[i][j], i, theta) for j in range(kv)] for i in range(n)]
    new = []
    for i in range(n):
      out = []
      for j in range(heads):
        g = j // (heads // kv)
        scores = np.array([q[i][j] @ k[s][g] / math.sqrt(d)
                           for s in range(i + 1)])
        w = np.exp(scores - scores.max())
        w /= w.sum()
        out.append(sum(w[s] * v[s][g] for s in range(i + 1)))
      new.append(h[i] + proj("o_proj", np.concatenate(out)))
    h = new
    for i in range(n):
      x = rms_norm(h[i], t[p + "post_attention_layernorm.weight"], eps)
      h[i] = h[i] + (mlp(layer, x) if mlp is not None
                     else dense_mlp(t, p + "mlp.", x))
  head = (t["model.embed_tokens.weight"] if config.get("tie_word_embeddings")
          else t["lm_head.weight"])
  return np.stack([head @ rms_norm(x, t["model.norm.weight"], eps)
                   for x in h])
