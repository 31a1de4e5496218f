"""Deprecated alias, kept for one release; use `vmoe_ext.moe.select`
(`partitionable_top_k`; `top_k` here is the same function)."""

from vmoe_ext.moe.select import partitionable_top_k, top_k

__all__ = ["partitionable_top_k", "top_k"]
