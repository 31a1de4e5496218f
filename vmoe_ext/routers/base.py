"""The router contract, re-exported where router authors look for it.

The definitions live in `vmoe_ext.moe.contract` so that the MoE layer can use
them without importing `vmoe_ext.routers` (one-way layering); see that module
for the contract (v2).
"""

from vmoe_ext.moe.contract import (EXPERT_CHOICE, ROUTER_STATE, SOFT,
                                   TOKEN_CHOICE, Assignment, LayerRecord,
                                   LinearLogits, Metrics, Router, RouterOutput,
                                   RoutingContext)

__all__ = ["EXPERT_CHOICE", "ROUTER_STATE", "SOFT", "TOKEN_CHOICE",
           "Assignment", "LayerRecord", "LinearLogits", "Metrics", "Router",
           "RouterOutput", "RoutingContext"]
