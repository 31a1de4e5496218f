"""Datasets that ship with installed packages (nothing downloads)."""

from vmoe_ext.data.builtin import load_mnist5k

__all__ = ["load_mnist5k"]
