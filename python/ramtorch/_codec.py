"""Codecs for streamed units: fewer bytes cross the link, decoded on the device into the unit's
layout (``offload(compress=...)``).

A unit's host region (``_Unit.flat``, its tensors at the offsets of its ``Layout``) is encoded once
into a second arena region; that region is what crosses the link, and the compute stream decodes
it, right after the copy's event, into a device buffer of the region's size, whose views are the
unit's weights in the forward (or backward) that took it. The host region stays as it was: the
optimizer, ``state_dict`` and checkpoints read it as before.

``"lossless"`` codes the region as 16-bit words (``bfloat16`` weights; any bytes decode back
exactly, other dtypes just compress less). A word is its sign and 7 mantissa bits (one raw byte)
and its 8-bit exponent field, coded in 3 bits against the largest exponent of its block of
:data:`BLOCK` words: codes 0..6 are that exponent down to 6 below it, code 7 an escape whose
exponent byte is stored apart, in word order. Trained weights' exponents sit in a few binades
(their entropy is about 2.6 bits), so a ``bfloat16`` region takes about 0.70 of its bytes.
Decoding writes every word back exactly: outputs equal the uncompressed model's, bit for bit.

``"fp8"`` (lossy) stores each floating-point matrix (two or more dimensions) as ``float8_e4m3fn``
with one scale per row (dimension 0: an output channel of ``nn.Linear``): the row's largest
magnitude over 448, rounded to the weight's dtype; other tensors stay raw. About half of a
``bfloat16`` region. Decoding is a conversion and a multiply per matrix, or per block of its rows:
a matrix's scales come before its rows, so a unit computed as its copy lands (``.rows``,
``.parts``) decodes each part once its bytes have crossed (:func:`encoded_upto`).

Region layout of ``"lossless"``, for ``n`` words in ``nb`` blocks with ``m`` escapes (offsets in
bytes): ``start[nb]`` (``int32``: escapes before each block), then the words in segments of
:data:`SEG_BLOCKS` blocks, each ``lo[w]`` (sign << 7 | mantissa), ``codes[3 * ceil(w / 8)]``
(eight 3-bit codes in three bytes, little-endian: word ``i``'s code is bits ``3 * (i % 8)`` of
group ``i // 8``), ``top[b]`` (each block's largest exponent), ``esc[e]`` (its escapes' exponent
bytes, in word order). A whole segment's bytes before its escapes have a fixed size, so segment
``k`` begins at ``4 * nb + k * fixed + start[k * SEG_BLOCKS]``. A prefix of the region holds the
first segments whole: a unit computed as its copy lands decodes each part from the segments its
raw bytes lie in, once they have crossed (:func:`encoded_upto`). :func:`validate` checks a region
against its description; the decoders never read outside the region whatever its bytes (a
corrupt region decodes to wrong words, not a crash).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _arena

#: Codecs that ``offload(compress=...)`` takes.
CODECS = ("lossless", "fp8")
#: Words per block of the lossless code (one exponent base; one program of the device decoder).
BLOCK = 2048
#: Blocks per segment of the lossless code: a segment is the unit a part of a copy decodes from
#: (1 MiB of raw bytes).
SEG_BLOCKS = 256
#: Words encoded at a time on the host (bounds the encoder's temporary memory: about 40 bytes a
#: word).
_CHUNK = BLOCK * 4096
#: A unit whose encoding keeps more than this share of its bytes streams raw: the decode would
#: cost device time for little link time.
MAX_RATIO = 0.9
#: Largest magnitude of ``float8_e4m3fn``.
_FP8_MAX = 448.0
_SHIFTS = torch.arange(0, 24, 3, dtype=torch.int32)


@dataclass(frozen=True)
class Encoded:
    """A unit's encoded region: ``data`` (``uint8``, arena memory) holds ``nbytes`` bytes that
    decode into a region of ``raw`` bytes."""

    codec: str
    data: torch.Tensor
    nbytes: int
    raw: int
    meta: Any

    @property
    def ratio(self) -> float:
        return self.nbytes / self.raw if self.raw else 1.0


@dataclass(frozen=True)
class _Lossless:
    """The layout of a lossless region (see the module's documentation): ``n`` words in ``nb``
    blocks with ``m`` escapes, in segments of ``seg_blocks`` blocks; ``ends``: where each segment
    ends in the region (the last one: the region's size)."""

    n: int  # words
    nb: int  # blocks
    m: int  # escapes
    seg_blocks: int
    ends: tuple[int, ...]

    @property
    def seg_words(self) -> int:
        return self.seg_blocks * BLOCK

    @property
    def ns(self) -> int:
        return len(self.ends)

    @property
    def o_seg(self) -> int:
        """Where the first segment begins: after the table of the blocks' escape starts."""
        return 4 * self.nb

    @property
    def fixed(self) -> int:
        """Bytes of a whole segment besides its escapes."""
        w = self.seg_words
        return w + 3 * (w // 8) + self.seg_blocks

    @functools.cached_property
    def escapes(self) -> int:
        """The escape bytes its segments hold (``ends`` less each segment's other bytes)."""
        return sum(self.ends[k] - self.seg(k)[5] for k in range(self.ns))

    def seg(self, k: int) -> tuple[int, int, int, int, int, int]:
        """Segment ``k``: (first word, words, its start, its codes, its tops, its escapes), the
        last four as offsets in the region (from ``ends``: the encoder's own)."""
        first = k * self.seg_words
        words = min(self.seg_words, self.n - first)
        base = self.o_seg if k == 0 else self.ends[k - 1]
        codes = base + words
        top = codes + 3 * (-(-words // 8))
        return first, words, base, codes, top, top + -(-words // BLOCK)


def _seg_codes(data: torch.Tensor, at: int, words: int) -> torch.Tensor:
    """The 3-bit codes of ``words`` words, packed at ``data[at:]``."""
    ng = -(-words // 8)
    g = data[at : at + 3 * ng].view(ng, 3).to(torch.int32)
    v = g[:, 0] | (g[:, 1] << 8) | (g[:, 2] << 16)
    return ((v.unsqueeze(1) >> _SHIFTS.to(v.device)) & 7).view(-1)[:words]


def _encode_words(w16: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One chunk of words (a multiple of :data:`BLOCK` long, but for the last chunk): its raw
    bytes, packed codes, block tops, escapes per block and escape bytes."""
    n = w16.numel()
    nb = -(-n // BLOCK)
    pad = nb * BLOCK - n
    w = torch.nn.functional.pad(w16, (0, pad)) if pad else w16
    hi = ((w >> 7) & 0xFF).view(nb, BLOCK)  # int16; padding words (0) never raise a block's top
    lo = (((w >> 8) & 0x80) | (w & 0x7F)).to(torch.uint8)[:n]
    top = hi.amax(1, keepdim=True)
    code = top - hi
    esc = code >= 7
    escapes = hi[esc].to(torch.uint8)
    counts = esc.sum(1, dtype=torch.int64)
    if pad:
        counts[-1] -= pad if int(top[-1]) >= 7 else 0  # the padding words' escapes do not exist
        escapes = escapes[: int(counts.sum())]
    c = code.clamp_(max=7).to(torch.uint8).view(-1)
    ng = -(-n // 8)
    c = c[: ng * 8].view(ng, 8).to(torch.int32)
    v = c[:, 0] | (c[:, 1] << 3) | (c[:, 2] << 6) | (c[:, 3] << 9)
    v |= (c[:, 4] << 12) | (c[:, 5] << 15) | (c[:, 6] << 18) | (c[:, 7] << 21)
    packed = torch.empty(ng, 3, dtype=torch.uint8)
    packed[:, 0] = v & 0xFF
    packed[:, 1] = (v >> 8) & 0xFF
    packed[:, 2] = (v >> 16) & 0xFF
    if n % 8:
        # Codes of the padding words in the last group are zero (the decoders never read them).
        last = packed[-1].to(torch.int32)
        word = int(last[0]) | int(last[1]) << 8 | int(last[2]) << 16
        word &= (1 << (3 * (n % 8))) - 1
        packed[-1] = torch.tensor([word & 0xFF, word >> 8 & 0xFF, word >> 16 & 0xFF], dtype=torch.uint8)
    return lo, packed.view(-1), top.view(-1).to(torch.uint8), counts, escapes


def encode_lossless(flat: torch.Tensor, nbytes: int) -> Encoded | None:
    """The lossless encoding of ``flat[:nbytes]`` (a ``uint8`` CPU region), or ``None`` when
    ``nbytes`` is odd or empty."""
    if nbytes <= 0 or nbytes % 2:
        return None
    words = flat[:nbytes].view(torch.int16)
    n = words.numel()
    sb = SEG_BLOCKS
    sw = sb * BLOCK
    chunk = max(1, _CHUNK // sw) * sw  # whole segments a chunk
    parts = [_encode_words(words[i : i + chunk]) for i in range(0, n, chunk)]
    counts = torch.cat([p[3] for p in parts])
    nb = counts.numel()
    m = int(counts.sum())
    ns = -(-n // sw)
    seg_m = torch.nn.functional.pad(counts, (0, ns * sb - nb)).view(ns, sb).sum(1).tolist()
    ends: list[int] = []
    at = 4 * nb
    for k in range(ns):
        words_k = min(sw, n - k * sw)
        at += words_k + 3 * (-(-words_k // 8)) + -(-words_k // BLOCK) + seg_m[k]
        ends.append(at)
    lay = _Lossless(n, nb, m, sb, tuple(ends))
    data = _arena.host_bytes(at)
    start = torch.zeros(nb, dtype=torch.int64)
    start[1:] = counts.cumsum(0)[:-1]
    data[: lay.o_seg].view(torch.int32).copy_(start)
    k = 0
    for lo, packed, top, _, escapes in parts:
        e_at = 0
        for j in range(-(-lo.numel() // sw)):  # the chunk's segments
            first, words_k, base, o_codes, o_top, o_esc = lay.seg(k)
            w0 = j * sw
            data[base : base + words_k].copy_(lo[w0 : w0 + words_k])
            g0 = w0 // 8 * 3
            data[o_codes:o_top].copy_(packed[g0 : g0 + o_top - o_codes])
            b0 = w0 // BLOCK
            data[o_top:o_esc].copy_(top[b0 : b0 + o_esc - o_top])
            data[o_esc : lay.ends[k]].copy_(escapes[e_at : e_at + seg_m[k]])
            e_at += seg_m[k]
            k += 1
    return Encoded("lossless", data, at, nbytes, lay)


def validate(enc: Encoded) -> None:
    """Raises ``ValueError`` naming what is wrong when ``enc``'s region does not hold a region its
    description allows (sizes, escape counts per block, the blocks' starts, codes that would give
    a negative exponent)."""
    if enc.codec == "fp8":
        _validate_fp8(enc)
        return
    if enc.codec != "lossless":
        raise ValueError(f"unknown codec {enc.codec!r}")
    lay = enc.meta
    if not isinstance(lay, _Lossless) or lay.seg_blocks < 1 or lay.n < 1:
        raise ValueError("lossless region: no layout of words in segments")
    if lay.nb != -(-lay.n // BLOCK) or lay.ns != -(-lay.n // lay.seg_words):
        raise ValueError("lossless region: its block and segment counts do not follow from its words")
    if enc.raw != 2 * lay.n or enc.nbytes != lay.ends[-1] or enc.data.numel() < enc.nbytes:
        raise ValueError(
            f"lossless region: {enc.data.numel()} bytes for {lay.n} words and {lay.m} escapes "
            f"(needs {lay.ends[-1]}, decoding to {enc.raw})"
        )
    counts = []
    found = 0
    for k in range(lay.ns):
        first, words, base, o_codes, o_top, o_esc = lay.seg(k)
        if lay.ends[k] < o_esc:
            raise ValueError(f"lossless region: segment {k} ends before its escapes begin")
        code = _seg_codes(enc.data, o_codes, words)
        esc = code == 7
        nbk = o_esc - o_top
        per = torch.nn.functional.pad(esc, (0, nbk * BLOCK - words)).view(nbk, BLOCK).sum(1)
        if int(per.sum()) != lay.ends[k] - o_esc:
            raise ValueError(
                f"lossless region: segment {k} has {int(per.sum())} escape codes for "
                f"{lay.ends[k] - o_esc} escape bytes"
            )
        counts.append(per)
        found += int(per.sum())
        top = enc.data[o_top:o_esc].to(torch.int32).repeat_interleave(BLOCK)[:words]
        if bool(((top - code < 0) & ~esc).any()):
            raise ValueError("lossless region: a code below its block's top exponent by more than the top")
    if found != lay.m:
        raise ValueError(f"lossless region: {found} escape codes for {lay.m} escape bytes")
    per_block = torch.cat(counts)
    start = enc.data[: lay.o_seg].view(torch.int32).to(torch.int64)
    want = torch.zeros_like(start)
    want[1:] = per_block.cumsum(0)[:-1]
    if not torch.equal(start, want):
        raise ValueError("lossless region: the blocks' escape starts do not match their escape codes")


def _decode_lossless_torch(
    src: torch.Tensor, lay: _Lossless, out: torch.Tensor, lo: int = 0, hi: int | None = None
) -> None:
    """The torch decoder: the words that raw bytes ``[lo, hi)`` lie in, segment by segment."""
    if lay.escapes != lay.m:
        raise ValueError(f"lossless region: {lay.escapes} escape bytes in its segments for {lay.m} escapes")
    w_lo = lo // 2
    w_hi = lay.n if hi is None else min(lay.n, -(-hi // 2))
    if w_hi <= w_lo:
        return
    words_out = out[: 2 * lay.n].view(torch.int16)
    for k in range(w_lo // lay.seg_words, (w_hi - 1) // lay.seg_words + 1):
        first, words, base, o_codes, o_top, o_esc = lay.seg(k)
        low = src[base : base + words].to(torch.int32)
        code = _seg_codes(src, o_codes, words)
        hi_b = src[o_top:o_esc].to(torch.int32).repeat_interleave(BLOCK)[:words] - code
        esc = code == 7
        m = lay.ends[k] - o_esc
        found = int(esc.sum())
        if found != m:
            raise ValueError(f"lossless region: {found} escape codes for {m} escape bytes in segment {k}")
        if m:
            hi_b[esc] = src[o_esc : lay.ends[k]].to(torch.int32)
        w = ((low & 0x80) << 8) | ((hi_b & 0xFF) << 7) | (low & 0x7F)
        a, b = max(w_lo, first), min(w_hi, first + words)
        words_out[a:b].copy_(((w[a - first : b - first] ^ 0x8000) - 0x8000).to(torch.int16))


# -- fp8 -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Leaf:
    src: int  # offset in the raw region
    nbytes: int  # raw bytes
    shape: tuple[int, ...]
    dtype: torch.dtype
    q: int  # offset of its bytes in the encoded region (raw bytes when not quantized)
    scale: int  # offset of its scales (-1: stored raw)


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def encode_fp8(flat: torch.Tensor, entries: list[Any], nbytes: int) -> Encoded | None:
    """Floating-point matrices of ``entries`` (a ``Layout``'s ``(offset, shape, dtype)``) as
    ``float8_e4m3fn`` with a scale per row; ``None`` when no tensor qualifies."""
    leaves: list[_Leaf] = []
    at = 0
    plans: list[tuple[Any, torch.Tensor | None, torch.Tensor | None]] = []
    for e in entries:
        if e is None:
            continue
        off, shape, dtype = e
        size = _arena._nbytes(shape, dtype)
        view = flat[off : off + size].view(dtype).view(shape)
        q = s = None
        if dtype in _FLOATS and len(shape) >= 2 and view.numel() > 0:
            rows = view.reshape(shape[0], -1).float()
            if bool(torch.isfinite(rows).all()):
                amax = rows.abs().amax(1)
                s = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax)).to(dtype)
                q = (rows / s.float().unsqueeze(1)).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        at = -(-at // 64) * 64
        if q is None:
            leaves.append(_Leaf(off, size, tuple(shape), dtype, at, -1))
            at += size
        else:
            # The scales first: a block of rows decodes once its rows have landed (.rows).
            assert s is not None
            sat = at
            at += s.numel() * s.element_size()
            at = -(-at // 64) * 64
            leaves.append(_Leaf(off, size, tuple(shape), dtype, at, sat))
            at += q.numel()
        plans.append((leaves[-1], q, s))
    if not any(leaf.scale >= 0 for leaf in leaves):
        return None
    data = _arena.host_bytes(max(at, 1))
    for leaf, q, s in plans:
        if q is None:
            data[leaf.q : leaf.q + leaf.nbytes].copy_(flat[leaf.src : leaf.src + leaf.nbytes])
        else:
            assert s is not None
            data[leaf.q : leaf.q + q.numel()].view(torch.float8_e4m3fn).copy_(q.view(-1))
            data[leaf.scale : leaf.scale + s.numel() * s.element_size()].view(leaf.dtype).copy_(s)
    return Encoded("fp8", data, at, nbytes, tuple(leaves))


def _validate_fp8(enc: Encoded) -> None:
    end = 0
    for leaf in enc.meta:
        rows = leaf.shape[0] if leaf.shape else 1
        need = leaf.q + (leaf.nbytes if leaf.scale < 0 else math.prod(leaf.shape))
        if leaf.scale >= 0:
            need = max(need, leaf.scale + rows * leaf.dtype.itemsize)
        if leaf.src + leaf.nbytes > enc.raw:
            raise ValueError(f"fp8 region: a tensor at {leaf.src} ends past the {enc.raw}-byte region")
        end = max(end, need)
    if end > enc.nbytes or enc.nbytes > enc.data.numel():
        raise ValueError(f"fp8 region: {enc.data.numel()} bytes where its tensors need {end}")


def _decode_fp8(src: torch.Tensor, leaves: tuple[_Leaf, ...], out: torch.Tensor, lo: int, hi: int) -> None:
    """Decodes the raw bytes ``[lo, hi)`` of the region: every tensor that overlaps them, a
    quantized one by whole rows (the rows that hold any of those bytes)."""
    for leaf in leaves:
        a, b = max(lo, leaf.src), min(hi, leaf.src + leaf.nbytes)
        if a >= b:
            continue
        if leaf.scale < 0:
            out[a:b].copy_(src[leaf.q + a - leaf.src : leaf.q + b - leaf.src])
            continue
        rows = leaf.shape[0]
        cols = leaf.nbytes // (rows * leaf.dtype.itemsize)
        row_bytes = cols * leaf.dtype.itemsize
        r0, r1 = (a - leaf.src) // row_bytes, -(-(b - leaf.src) // row_bytes)
        dst = out[leaf.src + r0 * row_bytes : leaf.src + r1 * row_bytes]
        view = dst.view(leaf.dtype).view(r1 - r0, cols)
        q = src[leaf.q + r0 * cols : leaf.q + r1 * cols]
        isz = leaf.dtype.itemsize
        scale = src[leaf.scale + r0 * isz : leaf.scale + r1 * isz].view(leaf.dtype)
        kernel = _triton_fp8() if out.is_cuda else None
        if kernel is not None:
            kernel(q, scale, view)  # one pass: the same bits as the two below
            continue
        view.copy_(q.view(torch.float8_e4m3fn).view(r1 - r0, cols))
        view.mul_(scale.unsqueeze(1))


def by_parts(codec: str) -> bool:
    """Whether a region of ``codec`` decodes by parts (:func:`decode` with ``lo``, ``hi``), each
    part once the encoded bytes of :func:`encoded_upto` have landed (both codecs do)."""
    return codec in CODECS


def encoded_upto(enc: Encoded, raw: int) -> int:
    """How many of ``enc``'s bytes (from its start) hold everything the raw bytes below ``raw``
    decode from: ``enc.nbytes`` where the codec does not decode by parts."""
    if not by_parts(enc.codec):
        return enc.nbytes
    if enc.codec == "lossless":
        lay = enc.meta
        words = min(lay.n, -(-raw // 2))
        return 0 if words <= 0 else lay.ends[(words - 1) // lay.seg_words]
    end = 0
    for leaf in enc.meta:
        if leaf.src >= raw:
            continue
        need = min(leaf.nbytes, raw - leaf.src)
        if leaf.scale < 0:
            end = max(end, leaf.q + need)
            continue
        rows = leaf.shape[0]
        row_bytes = leaf.nbytes // rows
        cols = row_bytes // leaf.dtype.itemsize
        end = max(end, leaf.scale + rows * leaf.dtype.itemsize, leaf.q + -(-need // row_bytes) * cols)
    return min(end, enc.nbytes)


# -- decoding on the device --------------------------------------------------------------------

_TRITON: Callable[..., Any] | None | bool = False  # False: not looked for yet


def _triton_decoder() -> Callable[..., Any] | None:
    """The Triton kernel of the lossless decoder, or ``None`` where Triton is missing."""
    global _TRITON
    if _TRITON is False:
        try:
            from ._codec_triton import decode_lossless

            _TRITON = decode_lossless
        except Exception:  # noqa: BLE001 - no Triton (or no working one): the torch decoder serves
            _TRITON = None
    return _TRITON  # type: ignore[return-value]


_TRITON_FP8: Callable[..., Any] | None | bool = False  # False: not looked for yet


def _triton_fp8() -> Callable[..., Any] | None:
    """The Triton kernel of the fp8 decoder (a conversion and a multiply in one pass over the
    bytes, where torch's ops take three), or ``None`` where Triton is missing."""
    global _TRITON_FP8
    if _TRITON_FP8 is False:
        try:
            from ._codec_triton import decode_fp8_rows

            _TRITON_FP8 = decode_fp8_rows
        except Exception:  # noqa: BLE001 - no Triton (or no working one): torch's ops serve
            _TRITON_FP8 = None
    return _TRITON_FP8  # type: ignore[return-value]


def decode(
    enc_meta: tuple[str, Any], src: torch.Tensor, out: torch.Tensor, lo: int = 0, hi: int | None = None
) -> None:
    """Decodes the encoded region ``src`` (a ``uint8`` tensor on the device, as copied) into
    ``out`` (``uint8``, the raw region's size), on the current stream; with ``lo``/``hi``, only
    what the raw bytes ``[lo, hi)`` need (a codec of :func:`by_parts`; others decode it all)."""
    codec, meta = enc_meta
    if codec == "fp8":
        _decode_fp8(src, meta, out, lo, out.numel() if hi is None else hi)
        return
    if out.is_cuda:
        kernel = _triton_decoder()
        if kernel is not None:
            kernel(src, meta, out, BLOCK, lo, hi)
            return
    _decode_lossless_torch(src, meta, out, lo, hi)


def encode(codec: str, flat: torch.Tensor, entries: list[Any], nbytes: int) -> Encoded | None:
    """``flat[:nbytes]`` (a unit's host region with its layout's ``entries``) encoded with
    ``codec``; ``None`` where the codec does not apply or saves less than ``1 - MAX_RATIO``."""
    with torch.no_grad():
        if codec == "lossless":
            enc = encode_lossless(flat, nbytes)
        elif codec == "fp8":
            enc = encode_fp8(flat, entries, nbytes)
        else:
            raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")
    if enc is None or enc.ratio > MAX_RATIO:
        return None
    return enc
