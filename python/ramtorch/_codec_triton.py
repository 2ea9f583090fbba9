"""The decoders of ``_codec`` as Triton kernels: the lossless one, a program per block of words,
and the fp8 one, a conversion and a per-row multiply in one pass.

Imported only where a CUDA tensor is decoded (``_codec._triton_decoder``); ``TRITON_INTERPRET=1``
runs it on CPU tensors, which is how the CPU tests check it against the torch decoder."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["total", "n", "nb", "m", "fixed", "b0", "w_lo", "w_hi"])
def _decode_kernel(
    src,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    start,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    total,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    n,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    nb,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    m,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    seg_blocks,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    fixed,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    b0,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    w_lo,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    w_hi,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    WORDS: tl.constexpr,
):
    # Block ``b`` of segment ``k``; the segment's place from the table of escape starts at the
    # region's head. Every load is masked to the region: a corrupt table gives wrong words, never
    # a read outside it.
    b = b0 + tl.program_id(0).to(tl.int64)
    k = b // seg_blocks
    kb = k * seg_blocks
    before = tl.load(start + kb).to(tl.int64)  # escapes before the segment
    nxt = kb + seg_blocks
    after = tl.load(start + nxt, mask=nxt < nb, other=0).to(tl.int64)
    after = tl.where(nxt < nb, after, m)  # escapes up to the segment's end
    base = 4 * nb + k * fixed + before
    sw = seg_blocks * WORDS
    words = tl.minimum(sw, n - k * sw)
    o_codes = base + words
    o_top = o_codes + 3 * ((words + 7) // 8)
    o_esc = o_top + (words + WORDS - 1) // WORDS
    j = (b - kb) * WORDS + tl.arange(0, WORDS)  # the words' places in the segment
    gi = k * sw + j
    inside = j < words
    a = base + j
    lo = tl.load(src + a, mask=inside & (a >= 0) & (a < total), other=0).to(tl.int32)
    g = o_codes + (j // 8) * 3
    ok_g = inside & (g >= 0) & (g + 2 < total)
    c0 = tl.load(src + g, mask=ok_g, other=0).to(tl.int32)
    c1 = tl.load(src + g + 1, mask=ok_g, other=0).to(tl.int32)
    c2 = tl.load(src + g + 2, mask=ok_g, other=0).to(tl.int32)
    v = c0 | (c1 << 8) | (c2 << 16)
    code = (v >> ((j % 8) * 3).to(tl.int32)) & 7
    t = o_top + (b - kb)
    top = tl.load(src + t, mask=(t >= 0) & (t < total), other=0).to(tl.int32)
    first = tl.load(start + b).to(tl.int64) - before
    esc = (code == 7) & inside
    e_k = first + tl.cumsum(esc.to(tl.int64), 0) - 1
    e_at = o_esc + e_k
    ok = esc & (e_k >= 0) & (e_k < after - before) & (e_at >= 0) & (e_at < total)
    e = tl.load(src + e_at, mask=ok, other=0).to(tl.int32)
    hi = tl.where(esc, e, top - code) & 0xFF
    w = ((lo & 0x80) << 8) | (hi << 7) | (lo & 0x7F)
    tl.store(out + gi, w.to(tl.int16), mask=inside & (gi >= w_lo) & (gi < w_hi))


def decode_lossless(
    src: torch.Tensor, lay: Any, out: torch.Tensor, block: int, lo: int = 0, hi: int | None = None
) -> None:
    """Decodes the words that raw bytes ``[lo, hi)`` lie in from the lossless region ``src``
    (``uint8``) described by ``lay`` (blocks of ``block`` words) into ``out``: a program per block
    of the segments they lie in."""
    w_lo = lo // 2
    w_hi = lay.n if hi is None else min(lay.n, -(-hi // 2))
    if w_hi <= w_lo:
        return
    b_lo = w_lo // lay.seg_words * lay.seg_blocks
    b_hi = min(lay.nb, ((w_hi - 1) // lay.seg_words + 1) * lay.seg_blocks)
    words = out[: 2 * lay.n].view(torch.int16)
    total = min(src.numel(), lay.ends[-1])
    start = src[: lay.o_seg].view(torch.int32)
    _decode_kernel[(b_hi - b_lo,)](
        src,
        start,
        words,
        total,
        lay.n,
        lay.nb,
        lay.m,
        lay.seg_blocks,
        lay.fixed,
        b_lo,
        w_lo,
        w_hi,
        WORDS=block,
    )


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
