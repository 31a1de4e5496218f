"""Residual streams across blocks, looked up by config name in `STREAMS`.

A new stream is one new module plus one line in `STREAMS`, or, from a
module of your own, a `"package.module:Class"` config name or one
`register_stream` call (docs/extending.md).
"""

from typing import Any, Mapping, Union

from vmoe_ext.registry import Registry
from vmoe_ext.streams.base import ResidualStream

STREAMS = Registry("stream", {
    "plain": "vmoe_ext.streams.plain:PlainResidual",
    "momentum": "vmoe_ext.streams.heavy_ball:HeavyBall",
    "adam": "vmoe_ext.streams.adam:AdamSMoE",
    "robust_momentum": "vmoe_ext.streams.robust:RobustMomentum",
    "nag": "vmoe_ext.streams.nag:NesterovSMoE",
    "time_varying": "vmoe_ext.streams.time_varying:TimeVaryingMomentum",
    "rmsprop": "vmoe_ext.streams.rmsprop:RmsPropSMoE",
    "sam": "vmoe_ext.streams.sam:SharpnessAwareSMoE",
    "complex_momentum": "vmoe_ext.streams.complex_momentum:ComplexMomentum",
}, base=ResidualStream)


def register_stream(name: str, cls: Union[type, str], *,
                    override: bool = False) -> None:
  """Makes `model.stream.name=name` select `cls`.

  Args:
    name: the config name (no ":").
    cls: a `ResidualStream` subclass (checked now), or its
      "package.module:Class" path (imported and checked when first used).
    override: replace a stream registered under `name` (a built-in too);
      without it a taken name raises ValueError.

  Raises:
    TypeError: `cls` is not a `ResidualStream` subclass.
    ValueError: `name` is taken (and not `override`) or contains ":".
  """
  STREAMS.register(name, cls, override=override)


def build_stream(config: Mapping[str, Any]) -> ResidualStream:
  """Instantiates the stream `config = {"name": ..., **fields}`."""
  return STREAMS.build(config)


__all__ = ["ResidualStream", "STREAMS", "build_stream", "register_stream"]
