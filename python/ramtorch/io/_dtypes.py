"""The one table of torch dtypes and their safetensors names (the names safetensors readers use)."""

from __future__ import annotations

import torch

__all__ = ["NATIVE", "ST_TO_TORCH", "TORCH_TO_ST", "torch_dtype"]

TORCH_TO_ST: dict[torch.dtype, str] = {}
for _name, _st in (
    ("float64", "F64"),
    ("float32", "F32"),
    ("float16", "F16"),
    ("bfloat16", "BF16"),
    ("int64", "I64"),
    ("int32", "I32"),
    ("int16", "I16"),
    ("int8", "I8"),
    ("uint8", "U8"),
    ("bool", "BOOL"),
    ("complex64", "C64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if isinstance(getattr(torch, _name, None), torch.dtype):  # older torch lacks some
        TORCH_TO_ST[getattr(torch, _name)] = _st
ST_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_ST.items()}
#: The dtypes ramtorch's reader converts among while copying.
NATIVE = frozenset({"F32", "F16", "BF16"})


def torch_dtype(st: str) -> torch.dtype | None:
    """The torch dtype of safetensors dtype name ``st`` (``None``: torch has none)."""
    return ST_TO_TORCH.get(st)
