"""Training: state, optimizer, steps, checkpoints, the loop.

Never imports `vmoe_ext.evaluate` (evaluation may import training);
metric writers and reports live in `vmoe_ext.reporting`.
"""
