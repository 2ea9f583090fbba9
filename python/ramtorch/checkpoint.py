"""Checkpoints of a model, its optimizer and the RNG states: see :mod:`ramtorch.io.checkpoint` (this
module keeps the names importable from here)."""

from __future__ import annotations

from .io.checkpoint import FORMAT_VERSION, CheckpointError, load_checkpoint, save_checkpoint

__all__ = ["FORMAT_VERSION", "CheckpointError", "load_checkpoint", "save_checkpoint"]
