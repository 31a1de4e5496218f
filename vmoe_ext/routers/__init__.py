"""Routers: one module per family, looked up by config name in `registry`."""

from vmoe_ext.routers.base import Router, RoutingContext
from vmoe_ext.routers.registry import (ROUTERS, build_router, get_router_class,
                                       register_router)

__all__ = ["Router", "RoutingContext", "ROUTERS", "build_router",
           "get_router_class", "register_router"]
