"""Residual streams across blocks, looked up by config name."""

from typing import Any, Mapping

from vmoe_ext.registry import Registry
from vmoe_ext.streams.base import ResidualStream

STREAMS = Registry("stream", {
    "plain": "vmoe_ext.streams.plain:PlainResidual",
})


def build_stream(config: Mapping[str, Any]) -> ResidualStream:
  """Instantiates the stream `config = {"name": ..., **fields}`."""
  return STREAMS.build(config)


__all__ = ["ResidualStream", "STREAMS", "build_stream"]
