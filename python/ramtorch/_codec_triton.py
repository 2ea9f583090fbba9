"""The lossless decoder as one Triton kernel: a program per block of words (see ``_codec``).

Imported only where a CUDA tensor is decoded (``_codec._triton_decoder``); ``TRITON_INTERPRET=1``
runs it on CPU tensors, which is how the CPU tests check it against the torch decoder."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    src,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    start_ptr,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    n,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    o_codes,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    o_top,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    o_esc,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    m,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    WORDS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = b * WORDS + tl.arange(0, WORDS)
    inside = i < n
    lo = tl.load(src + i, mask=inside, other=0).to(tl.int32)
    g = o_codes + (i // 8) * 3
    c0 = tl.load(src + g, mask=inside, other=0).to(tl.int32)
    c1 = tl.load(src + g + 1, mask=inside, other=0).to(tl.int32)
    c2 = tl.load(src + g + 2, mask=inside, other=0).to(tl.int32)
    v = c0 | (c1 << 8) | (c2 << 16)
    code = (v >> ((i % 8) * 3).to(tl.int32)) & 7
    top = tl.load(src + o_top + b).to(tl.int32)
    first = tl.load(start_ptr + b).to(tl.int64)
    esc = (code == 7) & inside
    k = first + tl.cumsum(esc.to(tl.int64), 0) - 1
    ok = esc & (k >= 0) & (k < m)
    e = tl.load(src + o_esc + k, mask=ok, other=0).to(tl.int32)
    hi = tl.where(esc, e, top - code) & 0xFF
    w = ((lo & 0x80) << 8) | (hi << 7) | (lo & 0x7F)
    tl.store(out + i, w.to(tl.int16), mask=inside)


def decode_lossless(src: torch.Tensor, lay: Any, out: torch.Tensor, block: int) -> None:
    """Decodes the lossless region ``src`` (``uint8``) described by ``lay`` (blocks of ``block``
    words) into ``out``."""
    if lay.n == 0:
        return
    start = src[lay.o_start : lay.o_esc].view(torch.int32)
    words = out[: 2 * lay.n].view(torch.int16)
    _decode_kernel[(lay.nb,)](src, start, words, lay.n, lay.o_codes, lay.o_top, lay.o_esc, lay.m, WORDS=block)
