"""The Rust CPU optimizer kernels (ramtorch._core.adamw_step / sgd_step / lion_step / grad_stats /
scale_), called directly on CPU tensors and compared with torch.optim (in float64) and a Lion
reference written in torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ramtorch import _arena, _core

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
STEPS = 5


def adamw(p, g, m, v, *, master=None, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=1e-2, **kw):
    _core.adamw_step(
        p,
        NAMES[p.dtype],
        g,
        NAMES[g.dtype],
        m,
        v,
        NAMES[m.dtype],
        master=master,
        numel=p.numel(),
        step=step,
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        eps=eps,
        weight_decay=wd,
        **kw,
    )


def sgd(p, g, buf, *, master=None, step, lr=1e-2, momentum=0.0, dampening=0.0, wd=0.0, **kw):
    _core.sgd_step(
        p,
        NAMES[p.dtype],
        g,
        NAMES[g.dtype],
        buf,
        "float32" if buf is None else NAMES[buf.dtype],
        master=master,
        numel=p.numel(),
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=wd,
        nesterov=kw.pop("nesterov", False),
        maximize=kw.pop("maximize", False),
        first_step=step == 1,
        step=step,
        **kw,
    )


def lion(p, g, m, *, master=None, step, lr=1e-4, betas=(0.9, 0.99), wd=0.0, **kw):
    _core.lion_step(
        p,
        NAMES[p.dtype],
        g,
        NAMES[g.dtype],
        m,
        NAMES[m.dtype],
        master=master,
        numel=p.numel(),
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=wd,
        step=step,
        **kw,
    )


def lion_reference(p, g, m, *, lr=1e-4, betas=(0.9, 0.99), wd=0.0, maximize=False):
    """Lion in torch (float64): p *= 1 - lr*wd; p -= lr*sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g.
    Elements whose update direction float32 rounding could flip are set to NaN (undecided)."""
    g = -g if maximize else g
    p.mul_(1 - lr * wd)
    x, y = betas[0] * m, (1 - betas[0]) * g
    c = x + y
    p.sub_(lr * c.sign())
    p[c.abs() <= 1e-6 * (x.abs() + y.abs())] = float("nan")
    m.mul_(betas[1]).add_(g, alpha=1 - betas[1])


def assert_close(
    got: torch.Tensor, want: torch.Tensor, rtol: float, what: str = "", scale: torch.Tensor | None = None
) -> None:
    """|got - want| <= rtol * max(|want|, 0.1 * max|want|, scale): relative error, against a tenth
    of the tensor's scale where values cancelled to near zero, or against ``scale`` (per element:
    the magnitude of the terms a value was summed from, where float32 rounds). NaN in ``want``
    marks undecided elements."""
    got, want = got.double().flatten(), want.double().flatten()
    keep = ~want.isnan()
    assert int((~keep).sum()) * 1000 <= want.numel(), f"{what}: too many undecided elements"
    got, want = got[keep], want[keep]
    if want.numel() == 0:
        return
    tol = rtol * torch.maximum(want.abs(), 0.1 * want.abs().max())
    if scale is not None:
        tol = torch.maximum(tol, rtol * scale.double().flatten()[keep])
    err = (got - want).abs()
    worst = int((err / tol).argmax())
    assert bool((err <= tol).all()), f"{what}[{worst}]: got {got[worst]}, want {want[worst]}"


def torch_adamw(p0, lr, betas, eps, wd, maximize):
    p = p0.detach().double().clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, maximize=maximize)
    return p, opt


# ------------------------------------------------------------------------------------------------
# float32 mode against torch.optim in float64.

hyper = st.fixed_dictionaries(
    {
        "lr": st.sampled_from([1e-4, 1e-3, 3e-2]),
        "beta1": st.sampled_from([0.0, 0.3, 0.9]),
        "beta2": st.sampled_from([0.9, 0.999]),
        "eps": st.sampled_from([1e-8, 1e-6]),
        "wd": st.sampled_from([0.0, 1e-2, 0.1]),
        "maximize": st.booleans(),
        "grad_scale": st.sampled_from([1.0, 0.5, 0.37, 4.0]),
    }
)


@settings(max_examples=25, deadline=None)
@given(numel=st.integers(1, 70_000), h=hyper, seed=st.integers(0, 2**16))
def test_adamw_float32_matches_torch(numel, h, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(numel, generator=gen)
    # A parameter is its start plus STEPS updates of about lr each: where they cancel, float32's
    # rounding is relative to those terms, not to the small result (numel=1, lr=0.03: 1.8e-6).
    terms = p.abs() + h["lr"] * STEPS
    m, v = torch.zeros(numel), torch.zeros(numel)
    betas = (h["beta1"], h["beta2"])
    ref, opt = torch_adamw(p, h["lr"], betas, h["eps"], h["wd"], h["maximize"])
    g_terms = torch.zeros(numel)  # the moments' terms: gradients, whose signs may cancel in exp_avg
    for t in range(1, STEPS + 1):
        g = torch.randn(numel, generator=gen) * 0.1
        g_terms = torch.maximum(g_terms, g.abs() * h["grad_scale"])
        kw = {"lr": h["lr"], "betas": betas, "eps": h["eps"], "wd": h["wd"], "maximize": h["maximize"]}
        adamw(p, g, m, v, step=t, grad_scale=h["grad_scale"], **kw)
        ref.grad = g.double() * h["grad_scale"]
        opt.step()
    state = opt.state[ref]
    assert_close(p, ref.detach(), 1e-6, "param", scale=terms)
    assert_close(m, state["exp_avg"], 1e-6, "exp_avg", scale=g_terms)
    assert_close(v, state["exp_avg_sq"], 1e-6, "exp_avg_sq")


SGD_CASES = [
    {},
    {"wd": 1e-2, "maximize": True, "grad_scale": 2.0},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.1, "wd": 1e-3},
    {"momentum": 0.8, "nesterov": True, "wd": 1e-2, "maximize": True, "grad_scale": 0.5},
]


@pytest.mark.parametrize("case", SGD_CASES)
@pytest.mark.parametrize("numel", [1, 1000, 100_003])
def test_sgd_float32_matches_torch(case, numel):
    gen = torch.Generator().manual_seed(numel)
    p = torch.randn(numel, generator=gen)
    mom = case.get("momentum", 0.0)
    buf = torch.zeros(numel) if mom else None
    ref = p.double().clone().requires_grad_(True)
    opt = torch.optim.SGD(
        [ref],
        lr=1e-2,
        momentum=mom,
        dampening=case.get("dampening", 0.0),
        weight_decay=case.get("wd", 0.0),
        nesterov=case.get("nesterov", False),
        maximize=case.get("maximize", False),
    )
    for t in range(1, STEPS + 1):
        g = torch.randn(numel, generator=gen) * 0.1
        sgd(p, g, buf, step=t, **case)
        ref.grad = g.double() * case.get("grad_scale", 1.0)
        opt.step()
    assert_close(p, ref.detach(), 1e-6, "param")
    if mom:
        assert_close(buf, opt.state[ref]["momentum_buffer"], 1e-6, "momentum_buffer")


LION_CASES = [{}, {"lr": 1e-3, "betas": (0.95, 0.98), "wd": 0.1, "maximize": True, "grad_scale": 3.0}]


@pytest.mark.parametrize("case", LION_CASES)
@pytest.mark.parametrize("numel", [1, 1000, 100_003])
def test_lion_float32_matches_reference(case, numel):
    gen = torch.Generator().manual_seed(numel)
    p = torch.randn(numel, generator=gen)
    m = torch.zeros(numel)
    rp, rm = p.double(), m.double()
    kw = {k: v for k, v in case.items() if k != "grad_scale"}
    for t in range(1, STEPS + 1):
        g = torch.randn(numel, generator=gen) * 0.1
        lion(p, g, m, step=t, **case)
        lion_reference(rp, g.double() * case.get("grad_scale", 1.0), rm, **kw)
    assert_close(p, rp, 1e-6, "param")
    assert_close(m, rm, 1e-6, "exp_avg")


def test_maximize_and_grad_scale_are_exact():
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(5000, generator=gen), torch.randn(5000, generator=gen)
    runs = []
    for grad, kw in [(g, {}), (-g, {"maximize": True}), (g * 4, {"grad_scale": 0.25})]:
        p, m, v = p0.clone(), torch.zeros(5000), torch.zeros(5000)
        for t in (1, 2):
            adamw(p, grad, m, v, step=t, **kw)
        runs.append(p)
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0], runs[2])


# ------------------------------------------------------------------------------------------------
# fp32 master mode.


@settings(max_examples=15, deadline=None)
@given(
    numel=st.integers(1, 50_000),
    param_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    grad_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_master_mode_tracks_float32_adamw(numel, param_dtype, grad_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen)
    p = master.to(param_dtype)
    m, v = torch.zeros(numel), torch.zeros(numel)
    ref32 = master.clone().requires_grad_(True)
    opt32 = torch.optim.AdamW([ref32], lr=1e-3)
    ref64, opt64 = torch_adamw(master, 1e-3, (0.9, 0.999), 1e-8, 1e-2, False)
    for t in range(1, STEPS + 1):
        g = (torch.randn(numel, generator=gen) * 0.1).to(grad_dtype)
        adamw(p, g, m, v, master=master, step=t)
        ref32.grad, ref64.grad = g.float(), g.double()
        opt32.step()
        opt64.step()
    assert_close(master, ref64.detach(), 1e-6, "master vs float64")
    assert_close(master, ref32.detach(), 2e-6, "master vs torch float32")
    assert torch.equal(p, master.to(param_dtype)), "the param is the master rounded to nearest"


@pytest.mark.parametrize("opt", ["sgd", "lion"])
def test_master_mode_sgd_and_lion(opt):
    n = 40_000
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(n, generator=gen)
    p, s = master.bfloat16(), torch.zeros(n)
    rp, rs = master.double(), torch.zeros(n, dtype=torch.float64)
    ref = rp.clone().requires_grad_(True)
    ref_opt = torch.optim.SGD([ref], lr=1e-2, momentum=0.9)
    for t in range(1, STEPS + 1):
        g = (torch.randn(n, generator=gen) * 0.1).bfloat16()
        if opt == "sgd":
            sgd(p, g, s, master=master, step=t, momentum=0.9)
            ref.grad = g.double()
            ref_opt.step()
        else:
            lion(p, g, s, master=master, step=t)
            lion_reference(rp, g.double(), rs)
    assert_close(master, ref.detach() if opt == "sgd" else rp, 1e-6, "master")
    assert torch.equal(p, master.bfloat16())


# ------------------------------------------------------------------------------------------------
# bfloat16 everywhere, stochastic rounding.


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_bf16_mode_stays_within_bf16_noise_of_torch(grad_dtype):
    n = 60_000
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(n, generator=gen).bfloat16()
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    ref, opt = torch_adamw(p.float(), 1e-2, (0.9, 0.999), 1e-8, 1e-2, False)
    for t in range(1, STEPS + 1):
        g = (torch.randn(n, generator=gen) * 0.1).to(grad_dtype)
        adamw(p, g, m, v, step=t, lr=1e-2, seed=7)
        ref.grad = g.double()
        opt.step()
    assert_close(p, ref.detach(), 0.03, "param")
    # The states carry bf16 rounding noise of a few 2^-8 of their size.
    assert_close(m, opt.state[ref]["exp_avg"], 0.05, "exp_avg")
    assert_close(v, opt.state[ref]["exp_avg_sq"], 0.05, "exp_avg_sq")


def test_bf16_mode_rounds_both_ways_and_is_reproducible():
    n = 100_000
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen).bfloat16()
    g = (torch.randn(n, generator=gen) * 0.1).bfloat16()

    def run(seed):
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        adamw(p, g, m, v, step=1, seed=seed)
        return p

    # What the float32 kernel makes of the same values; bf16 mode must land on a neighbour.
    pf, mf, vf = p0.float(), torch.zeros(n), torch.zeros(n)
    adamw(pf, g, mf, vf, step=1)
    a, b = run(1), run(1)
    assert torch.equal(a, b), "same seed, same bits"
    assert not torch.equal(a, run(2)), "another seed, other roundings"
    down = pf.view(torch.int32) >> 16
    got = a.view(torch.int16).int() & 0xFFFF
    exact = (pf.view(torch.int32) & 0xFFFF) == 0
    assert bool(((got == (down & 0xFFFF)) | ((got == ((down + 1) & 0xFFFF)) & ~exact)).all())
    up = float(((got != (down & 0xFFFF)) & ~exact).sum()) / float((~exact).sum())
    assert 0.3 < up < 0.7, up


@pytest.mark.parametrize("opt", ["sgd_momentum", "lion"])
def test_bf16_mode_is_unbiased_over_many_steps(opt):
    """Updates far below half a bf16 ulp: round to nearest would never move the param, stochastic
    rounding moves it by the right amount on average (statistical: 5 standard errors)."""
    n, steps, lr, g0 = 1 << 16, 60, 1e-4, 0.37
    p = torch.full((n,), 1.5, dtype=torch.bfloat16)
    s = torch.zeros(n, dtype=torch.bfloat16)
    g = torch.full((n,), g0, dtype=torch.bfloat16)
    mean_p, mean_s = 1.5, 0.0  # the expectation follows the (linear) update of the means
    g0 = float(g[0])
    for t in range(1, steps + 1):
        if opt == "sgd_momentum":
            sgd(p, g, s, step=t, lr=lr, momentum=0.9, seed=t)
            mean_s = g0 if t == 1 else 0.9 * mean_s + g0
            mean_p -= lr * mean_s
        else:
            lion(p, g, s, step=t, lr=lr, seed=t)
            mean_p -= lr  # sign(...) is +1 throughout
    pf = p.double()
    se = float(pf.std()) / n**0.5
    assert abs(float(pf.mean()) - mean_p) < 5 * se + 1e-9, (float(pf.mean()), mean_p, se)
    assert abs(1.5 - mean_p) > 20 * se, "the test must be able to see the drift"
    # Round to nearest would not have moved at all.
    assert float(torch.tensor(1.5 - lr * g0, dtype=torch.bfloat16)) == 1.5


# ------------------------------------------------------------------------------------------------
# grad_stats, scale_, threads.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [0, 1, 33, 100_003])
def test_grad_stats(dtype, numel):
    g = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    sq, bad = _core.grad_stats(g, NAMES[dtype], numel)
    want = float(g.double().square().sum())
    assert not bad
    assert sq == pytest.approx(want, rel=1e-12, abs=0.0)
    if numel:
        for x in (float("inf"), float("-inf"), float("nan")):
            h = g.clone()
            h[numel // 2] = x
            assert _core.grad_stats(h, NAMES[dtype], numel)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_matches_torch_mul(dtype):
    x = (torch.randn(70_001, generator=torch.Generator().manual_seed(5)) * 10).to(dtype)
    y = x.clone()
    _core.scale_(y, NAMES[dtype], y.numel(), 0.37)
    assert torch.equal(y, x * 0.37)


def test_optim_threads():
    assert _core.optim_threads() >= 1


# ------------------------------------------------------------------------------------------------
# Bad input.


def test_bad_inputs_raise_value_error():
    # Buffers of one arena region, passed by address: the checks after the region lookup are reached.
    flat = _arena.host_empty((64,), torch.float32, zeroed=True)
    p, g, m, v = flat[0:8], flat[16:24], flat[32:40], flat[48:56]
    master = _arena.host_empty((8,), torch.float32, zeroed=True)
    ph, mh = (_arena.host_empty((8,), torch.float16, zeroed=True) for _ in range(2))
    common = {"numel": 8, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    P, G, M, V = p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr()
    bad = [
        ((P, "float64", G, "float32", M, V, "float32"), {"step": 1}, "unknown dtype"),
        ((P, "float32", G, "int8", M, V, "float32"), {"step": 1}, "unknown dtype"),
        ((P, "float32", G, "float32", M, V, "float32"), {"step": 0}, "step counts from 1"),
        ((P, "float32", 0, "float32", M, V, "float32"), {"step": 1}, "null address"),
        ((P + 2, "float32", G, "float32", M, V, "float32"), {"step": 1}, "not aligned"),
        ((P, "float32", G, "float32", M, M, "float32"), {"step": 1}, "overlap"),
        ((P, "float32", G, "float32", M, P + 4, "float32"), {"step": 1}, "overlap"),
        ((ph.data_ptr(), "float16", G, "float32", M, V, "float32"), {"step": 1}, "master"),
        (
            (P, "float32", G, "float32", M, V, "float32"),
            {"step": 1, "master": master.data_ptr()},
            "its own master",
        ),
        ((P, "float32", G, "float32", mh.data_ptr(), V, "float16"), {"step": 1}, "float16 optimizer states"),
        (
            (P, "float32", G, "float32", M, V, "float32"),
            {"step": 1, "grad_scale": float("nan")},
            "grad_scale",
        ),
    ]
    for args, kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            _core.adamw_step(*args, **{**common, **kw})
    with pytest.raises(ValueError, match="lr"):
        _core.adamw_step(P, "float32", G, "float32", M, V, "float32", step=1, **{**common, "lr": -1.0})
    sgd_kw = {"numel": 8, "lr": 1e-2, "dampening": 0.0, "weight_decay": 0.0, "maximize": False}
    with pytest.raises(ValueError, match="Nesterov"):
        _core.sgd_step(
            P, "float32", G, "float32", M, "float32", momentum=0.0, nesterov=True, first_step=True, **sgd_kw
        )
    with pytest.raises(ValueError, match="momentum_buffer"):
        _core.sgd_step(
            P, "float32", G, "float32", 0, "float32", momentum=0.9, nesterov=False, first_step=True, **sgd_kw
        )
    with pytest.raises(ValueError, match="unknown dtype"):
        _core.sgd_step(
            P, "float32", G, "float32", 0, "bf16", momentum=0.0, nesterov=False, first_step=True, **sgd_kw
        )
    with pytest.raises(ValueError, match="beta2"):
        _core.lion_step(
            P, "float32", G, "float32", M, "float32", numel=8, lr=1e-4, beta1=0.9, beta2=2.0, weight_decay=0.0
        )
    with pytest.raises(ValueError, match="unknown dtype"):
        _core.grad_stats(G, "float64", 8)
    with pytest.raises(ValueError, match="finite"):
        _core.scale_(G, "float32", 8, float("inf"))
    with pytest.raises(TypeError):
        _core.adamw_step(P, "float32", G, "float32", M, V, "float32", numel=8, step=1)  # missing lr...
    assert bool((p == 0).all() and (m == 0).all() and (v == 0).all()), "refused calls write nothing"


def test_zero_elements_is_a_no_op():
    e = torch.empty(0)
    _core.adamw_step(
        0,
        "float32",
        0,
        "float32",
        0,
        0,
        "float32",
        numel=0,
        step=1,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
    )
    adamw(e, e.clone(), e.clone(), e.clone(), step=1)
    assert _core.grad_stats(0, "bfloat16", 0) == (0.0, False)


def test_the_kernels_instruction_set_is_the_best_the_cpu_has() -> None:
    """``_core.optim_isa()`` (recorded by the benchmarks) names the kernels this CPU runs: on a
    Linux x86-64 CPU, the best level whose flags ``/proc/cpuinfo`` lists (at most what
    ``RAMTORCH_CPU_KERNELS`` names, when the run sets it)."""
    import os
    from pathlib import Path

    isa = _core.optim_isa()
    assert isa in ("avx512", "avx2", "base")
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return
    flags: set[str] = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if not flags:
        return  # not x86 (aarch64 lists "Features")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        want = "avx512"
    elif {"avx2", "f16c"} <= flags:
        want = "avx2"
    else:
        want = "base"
    names = ["base", "avx2", "avx512"]
    cap = os.environ.get("RAMTORCH_CPU_KERNELS", "").strip().lower()
    if cap in names:  # capped for this run
        want = names[min(names.index(want), names.index(cap))]
    assert isa == want, (isa, sorted(f for f in flags if f.startswith("avx")))


def test_ramtorch_cpu_kernels_caps_the_instruction_set_with_the_same_bits() -> None:
    """``RAMTORCH_CPU_KERNELS`` (read once per process: run in children) caps the kernels'
    instruction set, for A/B measurements; the compact AdamW step gives the same bits under
    every cap; a name it does not know is a ``ValueError`` naming the variable when an optimizer
    is made."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, ramtorch.optim as ro\n"
        "from ramtorch import _core\n"
        "n = 5000\n"
        "g = torch.Generator().manual_seed(0)\n"
        "p = torch.randn(n, generator=g).to(torch.bfloat16); comp = torch.zeros(n, dtype=torch.bfloat16)\n"
        "codes = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]\n"
        "scales = [torch.zeros(-(-n // 256)), torch.zeros(-(-n // 256))]\n"
        "h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False,\n"
        "         grad_scale=1.0, seed=3)\n"
        "for t in range(1, 4):\n"
        "    grad = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 1, (n,), generator=g)\n"
        "    _core.optim_step('adamw', {**h, 'step': t}, p, grad, codes, comp=comp, scales=scales)\n"
        "ro.AdamW([torch.nn.Parameter(torch.zeros(2))])\n"
        "print(_core.optim_isa(), hash((p.view(torch.int16).tolist().__repr__(), comp.view(torch.int16)"
        ".tolist().__repr__(), codes[0].tolist().__repr__(), codes[1].tolist().__repr__(), "
        "scales[0].tolist().__repr__(), scales[1].tolist().__repr__())))\n"
    )

    def run(cap: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "RAMTORCH_CPU_KERNELS"}
        env["PYTHONHASHSEED"] = "0"
        if cap is not None:
            env["RAMTORCH_CPU_KERNELS"] = cap
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    best = run(None)
    assert best.returncode == 0, best.stderr[-2000:]
    best_isa, digest = best.stdout.split()
    names = ["base", "avx2", "avx512"]
    for cap in names[: names.index(best_isa) + 1]:
        r = run(cap)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split() == [cap, digest], (cap, r.stdout)
    bad = run("sse9")
    assert bad.returncode != 0
    assert "RAMTORCH_CPU_KERNELS" in bad.stderr and "sse9" in bad.stderr, bad.stderr[-2000:]
