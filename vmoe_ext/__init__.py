"""vmoe_ext: sparse Mixture-of-Experts vision models in JAX/Flax."""

__version__ = "0.1.0"
