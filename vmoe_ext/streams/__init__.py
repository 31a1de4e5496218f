"""Residual streams across blocks, looked up by config name."""

from typing import Any, Mapping

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
})


def build_stream(config: Mapping[str, Any]) -> ResidualStream:
  """Instantiates the stream `config = {"name": ..., **fields}`."""
  return STREAMS.build(config)


__all__ = ["ResidualStream", "STREAMS", "build_stream"]
