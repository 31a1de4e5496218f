"""big_vision-style preprocessing strings: the op registry and the parser.

A config gives the per-example preprocessing as one string of ops joined by
`|`, each a name or a call with literal arguments, as big_vision and vmoe
write them:

    decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2, 10)|
        value_range(-1, 1)     (one string; wrapped here)
    decode|resize_small(256)|central_crop(224)|value_range(-1, 1)

`parse(spec, field)` checks the whole string before any data is read: the
syntax (Python's, via `ast`; arguments must be literals, nothing is
evaluated), every op name, the arguments against the op's signature and
their values. Any problem is a `ConfigError` on `field` naming the op.
The result is a `Pipeline`: `pipeline(image, rng)` applies the ops in order
to one example (encoded bytes for a leading `decode`, else a uint8
`[H, W, C]` array) and returns a numpy array; everything is numpy/PIL, for
data-loader worker processes.

Ops (semantics in `geometry` and `randaugment`):

  decode(channels=3)
  decode_jpeg_and_inception_crop(size=None, area_min=5, area_max=100,
      ratio_min=0.75, ratio_max=1.33, method="bilinear", antialias=False) *
  inception_crop(same arguments) *
  flip_lr() *
  randaug(num_layers=2, magnitude=10) *
  resize(size, method="bilinear", antialias=False)
  resize_small(size, method="area", antialias=False)
  central_crop(crop_size=None)
  value_range(vmin, vmax, in_min=0, in_max=255, clip_values=False)

Ops marked * are random: they draw from the `np.random.Generator` passed to
the pipeline, in pipeline order, so one seed gives one output. Label ops of
big_vision strings (`onehot`, `keep`) are not image ops: labels are one-hot
encoded by the trainer, with `train.label_smoothing`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from vmoe_ext.errors import ConfigError, require
from vmoe_ext.registry import Registry

OPS = Registry("preprocessing op", {
    "central_crop": "vmoe_ext.data.pp.geometry:central_crop",
    "decode": "vmoe_ext.data.pp.geometry:decode",
    "decode_jpeg_and_inception_crop":
        "vmoe_ext.data.pp.geometry:decode_jpeg_and_inception_crop",
    "flip_lr": "vmoe_ext.data.pp.geometry:flip_lr",
    "inception_crop": "vmoe_ext.data.pp.geometry:inception_crop",
    "randaug": "vmoe_ext.data.pp.randaugment:randaug",
    "resize": "vmoe_ext.data.pp.geometry:resize",
    "resize_small": "vmoe_ext.data.pp.geometry:resize_small",
    "value_range": "vmoe_ext.data.pp.geometry:value_range",
}, field="data.pp")
RANDOM_OPS = frozenset({"decode_jpeg_and_inception_crop", "flip_lr",
                        "inception_crop", "randaug"})
_LABEL_OPS = frozenset({"onehot", "keep", "copy", "flatten"})


@dataclasses.dataclass(frozen=True)
class OpCall:
  """One parsed op: its name, literal arguments and the built function."""
  name: str
  args: tuple[Any, ...]
  kwargs: tuple[tuple[str, Any], ...]
  fn: Callable[[Any, np.random.Generator], np.ndarray] = dataclasses.field(
      compare=False, repr=False)

  @property
  def spec(self) -> str:
    """Canonical text: `name` or `name(arg, ..., key=value)`."""
    parts = [repr(a) for a in self.args]
    parts += [f"{k}={v!r}" for k, v in self.kwargs]
    return f"{self.name}({', '.join(parts)})" if parts else self.name

  @property
  def random(self) -> bool:
    return self.name in RANDOM_OPS


class Pipeline:
  """Ops applied in order: `pipeline(image, rng) -> np.ndarray`."""

  def __init__(self, ops: list[OpCall]):
    self.ops = tuple(ops)

  @property
  def spec(self) -> str:
    """The canonical preprocessing string; `parse(p.spec)` gives `p` back."""
    return "|".join(op.spec for op in self.ops)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(op.name for op in self.ops)

  @property
  def random_ops(self) -> tuple[str, ...]:
    """Names of the ops that draw from the generator, in order."""
    return tuple(op.name for op in self.ops if op.random)

  def __call__(self, image: Any, rng: np.random.Generator | None = None
               ) -> np.ndarray:
    if rng is None and self.random_ops:
      raise ValueError(f"preprocessing {self.spec!r} has random ops "
                       f"{list(self.random_ops)}: pass a np.random.Generator")
    for op in self.ops:
      image = op.fn(image, rng)
    return image

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Pipeline) and self.ops == other.ops

  def __repr__(self) -> str:
    return f"Pipeline({self.spec!r})"


def _flatten(node: ast.AST) -> list[ast.AST]:
  """`a | b | c` (left-nested BitOr) -> [a, b, c]."""
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
    return _flatten(node.left) + _flatten(node.right)
  return [node]


def _literal(node: ast.AST, text: str, what: str, field: str) -> Any:
  try:
    return ast.literal_eval(node)
  except (ValueError, TypeError, SyntaxError, MemoryError,
          RecursionError):
    raise ConfigError(field, f"{text}: {what} must be a Python literal "
                      f"(number, string, True/False/None, list, tuple), got "
                      f"{ast.unparse(node)!r}") from None


def _unknown(name: str, text: str, field: str) -> ConfigError:
  hint = ""
  if name in _LABEL_OPS:
    hint = (f" ({name!r} is a big_vision label op: labels are one-hot "
            "encoded by the trainer, with train.label_smoothing)")
  return ConfigError(field, f"{text}: unknown preprocessing op {name!r}"
                     f"{hint}; known ops: {OPS.names()}")


def _build(node: ast.AST, spec: str, field: str) -> OpCall:
  text = ast.get_source_segment(spec, node) or ast.unparse(node)
  if isinstance(node, ast.Name):
    name, arg_nodes, kw_nodes = node.id, [], []
  elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
    name, arg_nodes, kw_nodes = node.func.id, node.args, node.keywords
  else:
    raise ConfigError(field, f"{text!r} is not an op: expected a name or "
                      f"name(literal, ..., key=literal); known ops: "
                      f"{OPS.names()}")
  if name not in OPS:
    raise _unknown(name, text, field)
  for kw in kw_nodes:
    if kw.arg is None:
      raise ConfigError(field, f"{text}: **kwargs are not allowed")
  args = tuple(_literal(a, text, "every argument", field) for a in arg_nodes)
  kwargs = tuple((kw.arg, _literal(kw.value, text, f"argument {kw.arg}",
                                   field)) for kw in kw_nodes)
  factory = OPS.get(name)
  signature = inspect.signature(factory)
  try:
    signature.bind(*args, **dict(kwargs))
  except TypeError as e:
    params = ", ".join(
        p.name if p.default is p.empty else f"{p.name}={p.default!r}"
        for p in signature.parameters.values())
    raise ConfigError(field, f"{text}: {e}; the op is {name}({params})"
                      ) from None
  try:
    fn = factory(*args, **dict(kwargs))
  except ConfigError as e:
    raise ConfigError(field, f"{text}: argument {e.field} {e.reason}"
                      ) from None
  except (ValueError, TypeError) as e:
    raise ConfigError(field, f"{text}: invalid arguments ({e})") from None
  return OpCall(name, args, kwargs, fn)


def parse(spec: str, field: str = "data.pp") -> Pipeline:
  """Parses and checks a preprocessing string (see the module docstring).

  Raises:
    ConfigError: on `field`, for a syntax error, an unknown op (the message
      lists the known ones), arguments that are not literals, do not fit the
      op's signature or have invalid values.
  """
  require(isinstance(spec, str) and spec.strip(), field,
          f"must be a non-empty preprocessing string such as "
          f"'decode|resize(224)|value_range(-1, 1)', got {spec!r}")
  source = f"({spec.strip()}\n)"  # Parenthesised: may span lines.
  try:
    tree = ast.parse(source, mode="eval")
  except SyntaxError as e:
    column = (e.offset or 2) - 1  # Of `spec.strip()`, 1-based.
    raise ConfigError(field, f"cannot parse {spec!r} ({e.msg}, column "
                      f"{column}): expected ops such as decode or "
                      f"resize(224) joined by '|'") from None
  return Pipeline([_build(node, source, field)
                   for node in _flatten(tree.body)])


__all__ = ["OPS", "OpCall", "Pipeline", "RANDOM_OPS", "parse"]
