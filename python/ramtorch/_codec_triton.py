"""The decoders of ``_codec`` as Triton kernels: the lossless one, a program per block of words,
and the fp8 one, a conversion and a per-row multiply in one pass.

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


@triton.jit
def _fp8_rows_kernel(
    q,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    scale,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    n,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    cols,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    BF16: tl.constexpr,
    WORDS: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * WORDS + tl.arange(0, WORDS)
    inside = i < n
    b = tl.load(q + i, mask=inside, other=0).to(tl.int32)
    s = tl.load(scale + i // cols, mask=inside, other=0).to(tl.float32)
    # float8_e4m3fn to float32, exactly: normal numbers rebias their exponent (7 to 127),
    # subnormals are their mantissa times 2^-9, and 0x7F/0xFF are NaN.
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((b & 0x80) << 24) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = tl.where(b >= 0x80, -1.0, 1.0) * m.to(tl.float32) * 0.001953125
    x = tl.where(e == 0, sub, normal)
    x = tl.where((b & 0x7F) == 0x7F, float("nan"), x)
    # The product is rounded once in float32 (exact for a bf16 or fp16 scale: 4 significant bits
    # times 8 or 11), then to the weight's dtype to nearest even: as torch's conversion and
    # multiply in that dtype round it. bfloat16 is rounded here on the bits (the same on every
    # backend; NaN stays NaN), written through an int16 view.
    y = x * s
    if BF16:
        yb = y.to(tl.int32, bitcast=True)
        r = (yb + 0x7FFF + ((yb >> 16) & 1)) >> 16
        r = tl.where(y != y, (yb >> 16) | 0x40, r)
        tl.store(out + i, r.to(tl.int16), mask=inside)
    else:
        tl.store(out + i, y.to(out.dtype.element_ty), mask=inside)


def decode_fp8_rows(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (rows × cols, contiguous, of ``scale``'s dtype) = the ``float8_e4m3fn`` codes ``q``
    (``uint8``, rows × cols) times each row's scale, in one pass."""
    n = out.numel()
    if n == 0:
        return
    words = 1024
    bf16 = out.dtype == torch.bfloat16
    dst = out.view(torch.int16) if bf16 else out
    _fp8_rows_kernel[(triton.cdiv(n, words),)](q, scale, dst, n, out.shape[1], BF16=bf16, WORDS=words)
