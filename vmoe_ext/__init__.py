"""vmoe_ext: sparse Mixture-of-Experts vision models in JAX/Flax.

Components of your own, from your own module (docs/extending.md):

    vmoe_ext.register_router("greedy", GreedyRouter)     # model.moe.router
    vmoe_ext.register_stream("damped", Damped)           # model.stream
    vmoe_ext.register_attack("sign", sign, check_sign)   # robustness.attacks

or, with no call, a "package.module:Name" config name. These are imported
on first use, so `import vmoe_ext` stays cheap.
"""

from typing import Any

__version__ = "0.1.0"

# Public name -> where it lives ("package.module:attr"), imported on access.
_EXPORTS = {
    "register_router": "vmoe_ext.routers.registry:register_router",
    "register_stream": "vmoe_ext.streams:register_stream",
    "register_attack": "vmoe_ext.attacks.registry:register_attack",
}


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    from vmoe_ext.registry import resolve  # pylint: disable=g-import-not-at-top
    return resolve(_EXPORTS[name])
  raise AttributeError(f"module 'vmoe_ext' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted([*globals(), *_EXPORTS])


__all__ = ["__version__", *_EXPORTS]
