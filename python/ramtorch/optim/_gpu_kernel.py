"""The Rust AdamW kernel (``ramtorch-core/src/optim``: ``adamw.rs``, ``kernel.rs``, ``quant.rs``,
``precision.rs``) as one Triton kernel that computes the same bits, for every storage format the
host optimizer uses: an fp32 parameter, a bf16 one with stochastic rounding, a bf16 one with an
fp32 master, a bf16 one with a bf16 compensation (``precision="compact"``), and moments in fp32,
bf16 (stochastic rounding) or 8 bits a value with a scale per block of 256.

Same bits means the same operations in the same order on the same ``f32`` values: the rule's
constants come from the Rust code (``_core.optim_constants``), products are not fused into FMAs
(the kernel is compiled with ``enable_fp_fusion=False``), division and square root are the
correctly rounded ones, bf16 rounding and the random words of stochastic rounding are the Rust
bit manipulations (``hash32`` of each element's index under keys from ``_core``), and an 8-bit
state is coded by ``quant.rs``'s integer operations on the bits of each value over its block's
scale (the first moment rounded to nearest, the second stochastically). NaNs are the one
exception: a NaN the arithmetic makes is positive with CUDA and negative on x86 (it is NaN in the
same places). A block's scale is the largest magnitude of its new values (NaN, and codes 0, if one
is not finite; 0 and codes 0 if it is below the smallest normal float).

Imported only where a step runs on a GPU (``_gpu_step``); ``TRITON_INTERPRET=1`` runs the kernel
on CPU tensors, which is how the CPU tests compare it with the Rust kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Elements per quantization block (``quant::BLOCK``).
BLOCK = 256
#: Blocks per Triton program.
ROWS = 4

#: Ways of storing the parameter (``kernel::ParamMode``; fp16 with a master is not here).
P_F32, P_BF16_SR, P_MASTER_BF16, P_COMP = 0, 1, 2, 3
#: Ways of storing a state (``kernel::StateMode``).
S_F32, S_BF16, S_Q8 = 0, 1, 2


@triton.jit
def _f32(u):  # noqa: ANN001, ANN202 - Triton values
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _u32(x):  # noqa: ANN001, ANN202 - Triton values
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def _load_bf16(ptr, offs, mask):  # noqa: ANN001, ANN202 - Triton values
    """bf16 values stored as int16 bits, widened exactly to f32."""
    h = tl.load(ptr + offs, mask=mask, other=0)
    return _f32(h.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@triton.jit
def _store_bits16(ptr, offs, bits, mask):  # noqa: ANN001, ANN202 - Triton values
    tl.store(ptr + offs, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def _bf16_rne(x):  # noqa: ANN001, ANN202 - Triton values
    """``precision::bf16_rne``'s bits: round to nearest even, NaN kept quiet."""
    u = _u32(x)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    return tl.where(nan, (u >> 16) | 0x0040, rounded)


@triton.jit
def _bf16_sr(x, r):  # noqa: ANN001, ANN202 - Triton values
    """``precision::bf16_sr``'s bits: the low 16 bits of ``r`` as the random fraction."""
    u = _u32(x)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (r & 0xFFFF)) >> 16
    return tl.where(nan, (u >> 16) | 0x0040, rounded)


@triton.jit
def _hash32(x, k1, k2):  # noqa: ANN001, ANN202 - Triton values
    """``precision::hash32`` (wrapping 32-bit multiplies)."""
    x = x ^ k1
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x ^ k2
    x = x * 0x735A2D97
    return x ^ (x >> 15)


#: ``quant::off`` of the signed and the unsigned format: what a code's magnitude adds to make the
#: top bits of its f32 (1.0's bits above the 20 a code drops, minus the top magnitude).
Q8_OFF_SIGNED: tl.constexpr = tl.constexpr((127 << 3) - 0x7F)
Q8_OFF_UNSIGNED: tl.constexpr = tl.constexpr((127 << 3) - 0xFF)


@triton.jit
def _load_state(src, scales, offs, rows, mask, row_ok, MODE: tl.constexpr, SIGNED: tl.constexpr):  # noqa: ANN001, ANN202, E501
    if MODE == 0:
        return tl.load(src + offs, mask=mask, other=0.0)
    elif MODE == 1:
        return _load_bf16(src, offs, mask)
    else:
        # quant::decode_block
        c = tl.load(src + offs, mask=mask, other=0).to(tl.uint32)
        if SIGNED:
            mag = c & 0x7F
            bits = tl.where(mag == 0, 0, (mag + Q8_OFF_SIGNED) << 20) | ((c & 0x80) << 24)
        else:
            bits = tl.where(c == 0, 0, (c + Q8_OFF_UNSIGNED) << 20)
        scale = tl.load(scales + rows, mask=row_ok, other=0.0)
        return _f32(bits) * scale[:, None]


@triton.jit
def _store_state(dst, scales, x, r, offs, rows, mask, row_ok, MODE: tl.constexpr, SR: tl.constexpr):  # noqa: ANN001, ANN202, E501
    if MODE == 0:
        tl.store(dst + offs, x, mask=mask)
    elif MODE == 1:
        _store_bits16(dst, offs, _bf16_sr(x, r), mask)
    else:
        # quant::encode_block: a second moment (SR) is unsigned, a first moment signed.
        if SR:
            top = 0xFF
            off = Q8_OFF_UNSIGNED
        else:
            top = 0x7F
            off = Q8_OFF_SIGNED
        xb = _u32(x)
        bits = tl.where(mask, xb & 0x7FFFFFFF, 0)
        amax_bits = tl.max(bits, axis=1)
        bad = amax_bits >= 0x7F800000
        small = amax_bits < 0x00800000
        amax = _f32(amax_bits)
        inv = tl.div_rn(1.0, tl.where(bad | small, 1.0, amax))
        y = _u32(_f32(bits) * inv[:, None])
        if SR:
            q = (y + ((r & 0xFFFF) << 4)) >> 20
        else:
            q = (y + (1 << 19)) >> 20
        mag = tl.minimum(tl.maximum(q, off), off + top) - off
        if SR:
            # A positive value never takes the code of 0.
            mag = tl.maximum(mag, tl.where(bits != 0, 1, 0).to(tl.uint32))
            code = mag
        else:
            half_first = ((off + 1) << 20) - 0x00800000
            mag = tl.maximum(mag, tl.where(y >= half_first, 1, 0).to(tl.uint32))
            code = mag | tl.where(mag == 0, 0, (xb >> 24) & 0x80)
        code = tl.where((bad | small)[:, None], 0, code)
        tl.store(dst + offs, code.to(tl.uint8), mask=mask)
        scale = tl.where(bad, float("nan"), tl.where(small, 0.0, amax))
        tl.store(scales + rows, scale, mask=row_ok)


#: Arguments Triton must not specialize on: the kernel is bound by the link, not by how it loads,
#: and a key or a pointer that happened to be a multiple of 16 would compile another variant (a
#: stall of a second or so in the middle of a training step).
_NO_SPECIALIZE = (
    *("p_in", "c_in", "p_out", "c_out", "w_out", "grad", "a_in", "as_in", "a_out", "as_out"),
    *("b_in", "bs_in", "b_out", "bs_out", "n", "lo", "k0", "k1", "k2", "k3"),
)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _adamw_kernel(
    p_in,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    c_in,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    p_out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    c_out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    w_out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    grad,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    a_in,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    as_in,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    a_out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    as_out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    b_in,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    bs_in,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    b_out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    bs_out,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    n,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    lo,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    k0,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    k1,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    k2,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    k3,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    gs,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    decay,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    w1,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    w1c,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    beta2,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    c2,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    inv_bc2_sqrt,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    eps,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    neg_step_size,  # noqa: ANN001 - a Triton kernel's pointer or scalar
    PMODE: tl.constexpr,
    AMODE: tl.constexpr,
    BMODE: tl.constexpr,
    LERP_LOW: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    row_ok = rows * BLOCK < n
    # The element's index in the whole tensor, modulo 2^32 (the call does not cross a multiple).
    j = lo.to(tl.uint32) + offs.to(tl.uint32)
    r0 = _hash32(j, k0.to(tl.uint32), k1.to(tl.uint32))
    r1 = _hash32(j, k2.to(tl.uint32), k3.to(tl.uint32))

    if PMODE == 0:
        p = tl.load(p_in + offs, mask=mask, other=0.0)
    elif PMODE == 1:
        p = _load_bf16(p_in, offs, mask)
    elif PMODE == 2:
        p = tl.load(p_in + offs, mask=mask, other=0.0)
    else:
        p = _load_bf16(p_in, offs, mask) + _load_bf16(c_in, offs, mask)
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
    m = _load_state(a_in, as_in, offs, rows, mask, row_ok, AMODE, True)
    v = _load_state(b_in, bs_in, offs, rows, mask, row_ok, BMODE, False)

    # AdamRule::elem, operation by operation.
    g = g * gs
    pd = p * decay
    if LERP_LOW:
        m = m + w1 * (g - m)
    else:
        m = g - (g - m) * w1c
    v = v * beta2 + c2 * g * g
    denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
    p = pd + tl.div_rn(neg_step_size * m, denom)

    if PMODE == 0:
        tl.store(p_out + offs, p, mask=mask)
    elif PMODE == 1:
        _store_bits16(p_out, offs, _bf16_sr(p, r0), mask)
    elif PMODE == 2:
        tl.store(p_out + offs, p, mask=mask)
        _store_bits16(w_out, offs, _bf16_rne(p), mask)
    else:
        hi = _bf16_rne(p)
        low = p - _f32(hi << 16)
        low = tl.where((_u32(low) & 0x7FFFFFFF) < 0x7F800000, low, 0.0)
        _store_bits16(p_out, offs, hi, mask)
        _store_bits16(c_out, offs, _bf16_sr(low, r0), mask)
    # An 8-bit second moment is rounded stochastically, an 8-bit first moment to nearest; where
    # the first state rounds to nearest, an 8-bit second one takes word 0's bits 16..32
    # (``StateIo::SR16``), else word 1.
    _store_state(a_out, as_out, m, r0 >> 16, offs, rows, mask, row_ok, AMODE, False)
    rb = r1
    if BMODE == 2:
        if AMODE != 1:
            rb = r0 >> 16
    _store_state(b_out, bs_out, v, rb, offs, rows, mask, row_ok, BMODE, True)


def launch(
    pmode: int,
    amode: int,
    bmode: int,
    n: int,
    tensors: dict[str, torch.Tensor],
    consts: dict[str, object],
) -> None:
    """Runs the kernel over ``n`` elements. ``tensors``: the operands by the kernel's argument
    names (bf16 ones viewed as int16; absent ones may be any tensor of the device, never read);
    ``consts``: ``_core.optim_constants``' dict plus ``"lo"``, the first element's index modulo
    2^32."""
    if n == 0:
        return
    names = ("p_in", "c_in", "p_out", "c_out", "w_out", "grad", "a_in", "as_in", "a_out", "as_out")
    names += ("b_in", "bs_in", "b_out", "bs_out")
    dummy = tensors["grad"]
    args = [tensors.get(k, dummy) for k in names]
    keys = consts["keys"]
    assert isinstance(keys, list)
    # The 32-bit words go in as 64-bit integers from 2^32 up (the kernel keeps their low 32 bits):
    # Triton types an int argument by its value, and each new type would compile the kernel again.
    wide = [int(k) + (1 << 32) for k in (consts["lo"], *keys)]
    grid = (triton.cdiv(n, ROWS * BLOCK),)
    _adamw_kernel[grid](
        *args,
        n,
        *wide,
        *(consts[k] for k in ("gs", "decay", "w1", "w1c", "beta2", "c2", "inv_bc2_sqrt", "eps")),
        consts["neg_step_size"],
        PMODE=pmode,
        AMODE=amode,
        BMODE=bmode,
        LERP_LOW=bool(consts["lerp_low"]),
        ROWS=ROWS,
        BLOCK=BLOCK,
        enable_fp_fusion=False,
    )
