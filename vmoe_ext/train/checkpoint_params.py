"""Read-only access to the params of a saved train state: re-exported from
`vmoe_ext.interop.checkpoint_params`, where it lives below the training
package so that algorithm packages (carving) can read checkpoints without
importing `vmoe_ext.train`. Kept for the training code and other callers.
"""

from __future__ import annotations

from vmoe_ext.interop.checkpoint_params import (PARAMS, STATE,
                                                checkpoint_steps, flatten,
                                                param_shapes, read_params,
                                                state_directory)

__all__ = ["PARAMS", "STATE", "checkpoint_steps", "flatten", "param_shapes",
           "read_params", "state_directory"]
