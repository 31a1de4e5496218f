"""Training: state, optimizer, steps, checkpoints, metric writers, the loop."""
