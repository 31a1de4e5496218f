"""Deprecated alias, kept for one release; use `vmoe_ext.routers.noisy_top_k`
(`NoisyTopKRouter`, `noisy_top_k`)."""

from vmoe_ext.routers.noisy_top_k import (IMPORTANCE_GATES, NoisyTopKRouter,
                                          noisy_top_k)

__all__ = ["IMPORTANCE_GATES", "NoisyTopKRouter", "noisy_top_k"]
