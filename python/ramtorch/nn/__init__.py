"""Drop-in layers whose parameters live in host RAM."""

from .linear import Linear

__all__ = ["Linear"]
