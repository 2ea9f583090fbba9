"""Drop-in layers whose parameters live in host RAM."""

from .layers import Conv2d, Embedding
from .linear import Linear

__all__ = ["Conv2d", "Embedding", "Linear"]
