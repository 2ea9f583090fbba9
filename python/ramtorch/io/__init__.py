"""Reading and writing model weights and checkpoints as ``.safetensors`` files, in place.

- :func:`load` / :func:`save` (``ramtorch.load`` / ``ramtorch.save_pretrained``): a model's
  weights in the Hugging Face layout (one file, or shards plus an index);
- :func:`load_checkpoint` / :func:`save_checkpoint`: a model, its optimizer, the RNG states and
  your own values in one file written atomically.

Both formats are specified in :mod:`ramtorch.io.format`. Files are opened once, validated before
anything is written, read with positioned reads (never mapped) straight into the memory of the
model's tensors, and written through a temporary file that is ``fsync``-ed and renamed.
"""

from __future__ import annotations

from ._dtypes import NATIVE as _NATIVE  # noqa: F401 - the names of earlier versions, kept
from ._dtypes import ST_TO_TORCH as _ST_TO_TORCH  # noqa: F401
from ._dtypes import TORCH_TO_ST as _TORCH_TO_ST  # noqa: F401
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .format import FORMAT_VERSION
from .pretrained import INDEX_NAME, SINGLE_NAME, load, plain_loading, save

__all__ = [
    "FORMAT_VERSION",
    "INDEX_NAME",
    "SINGLE_NAME",
    "CheckpointError",
    "load",
    "load_checkpoint",
    "plain_loading",
    "save",
    "save_checkpoint",
]
