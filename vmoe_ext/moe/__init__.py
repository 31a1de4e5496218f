"""MoE core: capacity, routing forms, dispatchers, auxiliary losses, the layer."""

from vmoe_ext.moe.capacity import compute_capacity
from vmoe_ext.moe.dispatch import make_dispatch_plan, token_choice_positions
from vmoe_ext.moe.experts import MlpExperts
from vmoe_ext.moe.layer import MoeLayer, group_tokens
from vmoe_ext.moe.routing import (ExpertChoiceRouting, SoftRouting,
                                  TokenChoiceRouting)

__all__ = ["compute_capacity", "make_dispatch_plan", "token_choice_positions",
           "MlpExperts", "MoeLayer", "group_tokens", "ExpertChoiceRouting",
           "SoftRouting", "TokenChoiceRouting"]
