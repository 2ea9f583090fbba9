"""The GPU AdamW kernel (``ramtorch.optim._gpu_kernel``) against the Rust kernel, bit for bit
(a NaN's sign and payload aside):
every parameter and state format, gradients of three dtypes, pieces that do not fill a block,
offsets past 2^32, out of place and in place, non-finite values. On the CPU Triton's interpreter
runs the kernel (in a subprocess: the interpreter is chosen when Triton is imported); the GPU
tests run the compiled kernel and the staged path through host memory."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import ramtorch
import torch
from ramtorch import _core

BF16 = torch.bfloat16


def _hyper(rng: torch.Generator, step: int, offset: int) -> dict:
    r = lambda lo, hi: lo + (hi - lo) * torch.rand((), generator=rng).item()  # noqa: E731
    return {
        "lr": r(1e-4, 3e-2),
        "beta1": 0.9 if step % 2 else r(0.1, 0.6),  # both of torch's lerp forms
        "beta2": r(0.95, 0.9999),
        "eps": 10 ** r(-9, -6),
        "weight_decay": r(0.0, 0.1),
        "maximize": bool(step % 3 == 0),
        "grad_scale": 1.0 if step % 2 else r(0.25, 2.0),
        "step": step,
        "seed": int(torch.randint(0, 1 << 62, (), generator=rng)),
        "index_offset": offset,
    }


def _operands(
    rng: torch.Generator, n: int, pformat: str, sformat: tuple[str, str], gdtype: torch.dtype, special: bool
) -> dict:
    """Random operands of one update (host tensors), as ``_core.optim_step`` takes them."""
    w = torch.randn(n, generator=rng) * 0.05
    g = torch.randn(n, generator=rng) * 1e-2
    if special and n > 300:
        g[256:300] = 0.0
        g[7] = float("nan")  # a NaN gradient: its blocks of quantized states become NaN
    ops: dict = {"grad": g, "master": None, "comp": None, "scales": None}
    if pformat == "f32":
        ops["param"] = w.clone()
    elif pformat == "bf16":
        ops["param"] = w.to(BF16)
    elif pformat == "master":
        ops["param"], ops["master"] = w.to(BF16), w.clone()
    else:
        ops["param"] = w.to(BF16)
        ops["comp"] = ((w - w.to(BF16).float()) * torch.rand(n, generator=rng)).to(BF16)
        if special and n > 3:
            ops["param"][3] = float("inf")
    m = torch.randn(n, generator=rng) * 1e-3
    v = torch.rand(n, generator=rng) * 1e-5
    if special and n > 600:
        m[512:768], v[512:768] = 0.0, 0.0  # an all-zero block of new moments
        g[512:768] = 0.0
    if special and n > 1100:
        # A block whose second moments are all far below its largest: rounded up to the smallest
        # code, never to 0.
        m[768:1024], v[768:1024] = 0.0, 0.0
        g[768:1024] = 1e-6
        g[770] = 1.0
    if special and n > 1400:
        # A block of moments below the smallest normal float (stored as zeros), and one where
        # dividing by its largest magnitude gives subnormal quotients.
        m[1024:1280], v[1024:1280], g[1024:1280] = 1e-39, 1e-40, 0.0
        m[1280:1536], v[1280:1536], g[1280:1536] = 1e-38, 1e-39, 0.0
        m[1290], v[1290] = 30.0, 3e30
    states, scales = [], []
    for x, fmt, signed in ((m, sformat[0], True), (v, sformat[1], False)):
        if fmt == "f32":
            states.append(x.clone())
        elif fmt == "bf16":
            states.append(x.to(BF16))
        else:
            codes = torch.empty(n, dtype=torch.uint8)
            sc = torch.empty(-(-n // 256), dtype=torch.float32)
            _core.q8_quantize(x, codes, sc, signed)
            states.append(codes)
            scales.append(sc)
    ops["states"] = states
    ops["scales"] = scales or None
    ops["grad"] = g.to(gdtype)
    return ops


def _clone(ops: dict) -> dict:
    c = {}
    for k, v in ops.items():
        if isinstance(v, torch.Tensor):
            c[k] = v.clone()
        elif isinstance(v, list):
            c[k] = [t.clone() for t in v]
        else:
            c[k] = v
    return c


def _dests(ops: dict) -> list[torch.Tensor]:
    out = [ops["param"], *ops["states"]]
    out += [t for t in (ops["master"], ops["comp"]) if t is not None]
    out += ops["scales"] or []
    return out


def _old(ops: dict) -> dict:
    """The ``old`` argument of an update out of place that reads ``ops`` (then fresh buffers
    receive the results)."""
    old: dict = {"states": ops["states"]}
    if ops["master"] is not None:
        old["master"] = ops["master"]
    else:
        old["param"] = ops["param"]
    if ops["comp"] is not None:
        old["comp"] = ops["comp"]
    if ops["scales"] is not None:
        old["scales"] = ops["scales"]
    return old


def _fresh(ops: dict) -> dict:
    """Destination buffers of an update out of place: filled with garbage, fully overwritten."""
    f = _clone(ops)
    for t in _dests(f):
        t.view(torch.uint8).fill_(0xA5)
    return f


def _run(step_fn, ops: dict, hyper: dict, out_of_place: bool) -> list[torch.Tensor]:  # noqa: ANN001
    if out_of_place:
        dst = _fresh(ops)
        old = _old(ops)
    else:
        dst, old = _clone(ops), None
    step_fn(
        "adamw",
        hyper,
        dst["param"],
        dst["grad"] if not out_of_place else ops["grad"],
        dst["states"],
        master=dst["master"],
        comp=dst["comp"],
        scales=dst["scales"],
        old=old,
    )
    return _dests(dst)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that a NaN may carry another sign and payload (x86 makes negative
    NaNs, CUDA positive ones; both are NaN in the same places)."""
    if a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        a, b = a[~nan], b[~nan]
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


CASES = [
    (p, s, g)
    for p, s, g in itertools.product(
        ("f32", "bf16", "master", "comp"),
        (("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16"), ("q8", "q8")),
        (torch.float32, BF16, torch.float16),
    )
]


def compare_all(step_fn, sizes: tuple[int, ...], device: str = "cpu") -> int:  # noqa: ANN001
    """Runs every case through ``step_fn`` (the GPU kernel's entry) and ``_core.optim_step``;
    raises on the first difference; returns the number of comparisons."""
    rng = torch.Generator().manual_seed(0)
    count = 0
    runs = [(k, case, sizes[k % len(sizes)], False) for k, case in enumerate(CASES)]
    runs += [(k, case, max(sizes), True) for k, case in enumerate(CASES)]  # non-finite values
    for k, (pformat, sformat, gdtype), n, special in runs:
        offset = 0 if k % 4 else (1 << 32) - 256 * (-(-n // 256))  # ends just below 2^32
        if k % 8 == 1:
            offset = (3 << 32) + 512  # past 2^32: the keys of another window
        hyper = _hyper(rng, 1 + k % 9, offset)
        ops = _operands(rng, n, pformat, sformat, gdtype, special)
        for out_of_place in (False, True):
            want = _run(_core.optim_step, ops, hyper, out_of_place)
            if device == "cpu":
                got = _run(step_fn, ops, hyper, out_of_place)
            else:
                dev = {
                    key: (
                        v.to(device)
                        if isinstance(v, torch.Tensor)
                        else [t.to(device) for t in v]
                        if isinstance(v, list)
                        else v
                    )
                    for key, v in ops.items()
                }
                got = [t.cpu() for t in _run(step_fn, dev, hyper, out_of_place)]
            for i, (a, b) in enumerate(zip(want, got)):
                if not _same_bits(a, b):
                    diff = (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()[:5].flatten().tolist()
                    diff += [a.view(-1)[:8].tolist(), b.view(-1)[:8].tolist()]
                    raise AssertionError(
                        f"case {pformat}/{sformat}/{gdtype} n={n} offset={offset} "
                        f"out_of_place={out_of_place}: "
                        f"destination {i} differs at bytes {diff}"
                    )
            count += 1
    return count


def _interpreted(code: str) -> str:
    """Runs ``code`` in a Python process whose Triton interprets kernels on CPU tensors (this
    process's ramtorch and this directory on its path); returns its output."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(ramtorch.__file__)))
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([pkg, here])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_interpreted_kernel_equals_the_rust_kernel_bitwise():
    """Every format, in the interpreter, against ``_core.optim_step``."""
    pytest.importorskip("triton")
    code = (
        "import test_optim_gpu_kernel as t\n"
        "from ramtorch.optim._gpu_step import optim_step_here\n"
        "print(t.compare_all(optim_step_here, (1, 255, 700, 1600)))\n"
    )
    out = _interpreted(code)
    assert int(out.strip().splitlines()[-1]) == 4 * len(CASES)


def test_staged_pieces_equal_the_rust_kernel_in_the_interpreter():
    """The staged path cut into pieces of 1024 elements (each piece its own index offset, its
    own blocks' scales, its own buffers), on the CPU: the same bits as one call."""
    pytest.importorskip("triton")
    code = (
        "import torch, test_optim_gpu_kernel as t\n"
        "from ramtorch.optim import _gpu_step\n"
        "_gpu_step.PIECE = 1024\n"
        "s = _gpu_step.DeviceStepper(torch.device('cpu'))\n"
        "print(t.compare_all(lambda *a, **k: s.step(*a, **k), (1, 700, 2100)))\n"
        "print(s.up_bytes > 0 and s.down_bytes > 0)\n"
    )
    out = _interpreted(code).strip().splitlines()
    assert int(out[-2]) == 4 * len(CASES) and out[-1] == "True"


def test_the_kernel_refuses_what_it_does_not_implement():
    from ramtorch.optim._gpu_step import layout

    p = torch.zeros(4, dtype=torch.float16)
    g = torch.zeros(4)
    s = [torch.zeros(4), torch.zeros(4)]
    assert layout("adamw", p, g, s, torch.zeros(4), None, None) is None  # fp16 with a master
    assert layout("sgd", torch.zeros(4), g, s[:1], None, None, None) is None
    assert (
        layout("adamw", torch.zeros(4), g, [s[0], torch.zeros(4, dtype=torch.uint8)], None, None, [g]) is None
    )
    assert layout("adamw", torch.zeros(4), g, s, None, None, None) == (0, 0, 0)


@pytest.mark.gpu
def test_compiled_kernel_equals_the_rust_kernel_bitwise():
    from ramtorch.optim._gpu_step import optim_step_here

    assert compare_all(optim_step_here, (1, 255, 700, 1300, 70_000), device="cuda") == 4 * len(CASES)


@pytest.mark.gpu
def test_staged_steps_from_host_memory_equal_the_rust_kernel(monkeypatch: pytest.MonkeyPatch):
    """The path a host update takes on the GPU: pieces staged up on two streams, results copied
    down into host tensors; pieces small enough that a tensor takes several."""
    from ramtorch.optim import _gpu_step

    monkeypatch.setattr(_gpu_step, "PIECE", 1024)
    stepper = _gpu_step.DeviceStepper(torch.device("cuda"))

    def staged(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        for ev in stepper.step(*args, **kwargs):
            ev.synchronize()

    assert compare_all(staged, (1, 700, 5000, 9000)) == 4 * len(CASES)
    assert stepper.up_bytes > 0 and stepper.down_bytes > 0


def train_both_ways(
    device: str,
    precisions: tuple[str, ...] = ("compact", "fp32-master", "bf16"),
    overlap: bool | str = True,
    states: str = "device",
) -> str:
    """Trains a small offloaded model with ``gpu_updates`` off and on; returns one line per
    precision: whether the weights are bitwise equal, and the updates the GPU ran (speculated in
    backward and in ``step()``; only in ``step()`` with ``overlap=False``). ``states="host"``:
    the model is not offloaded, its states live in host RAM (``_resident``). On the CPU the
    caller makes ``_assist.supported`` true (Triton's interpreter runs the GPU kernel)."""
    lines = []
    for prec in precisions:
        weights, gpu_runs = [], 0
        for gpu in (False, True):
            torch.manual_seed(0)
            m = torch.nn.Sequential(
                torch.nn.Linear(64, 96, dtype=BF16), torch.nn.GELU(), torch.nn.Linear(96, 64, dtype=BF16)
            )
            if states == "host":  # the weights stay where they are, their states in host RAM
                m.to(device)
            else:
                ramtorch.offload(m, device=device)
            opt = ramtorch.optim.AdamW(
                m.parameters(), lr=1e-2, precision=prec, gpu_updates=gpu, overlap=overlap, states=states
            )
            torch.manual_seed(1)
            for _ in range(5):
                for _ in range(2):  # two micro-batches a step
                    x = torch.randn(8, 64, dtype=BF16, device=device)
                    m(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad()
            weights.append([p.detach().cpu().view(torch.int16).clone() for p in m.parameters()])
            gpu_runs = opt.timings["gpu_updates"] if gpu else gpu_runs
        same = all(torch.equal(a, b) for a, b in zip(*weights))
        lines.append(f"{prec} {same} {gpu_runs}")
    return "\n".join(lines)


def test_gpu_updates_train_bitwise_as_the_cpu_in_the_interpreter():
    """``gpu_updates=True`` end to end on the CPU: the GPU thread runs the updates (the kernel
    interpreted; the CPU leaves them all to it), and every step equals the CPU-only run bit for
    bit."""
    pytest.importorskip("triton")
    code = (
        "import test_optim_gpu_kernel as t\n"
        "from ramtorch.optim import _assist\n"
        "_assist.supported = lambda device: True\n"
        "_assist.GPU_ONLY = True\n"
        "print(t.train_both_ways('cpu'))\n"
        "print(t.train_both_ways('cpu', overlap=False))\n"
        "print(t.train_both_ways('cpu', states='host'))\n"
        "print(t.train_both_ways('cpu', overlap=False, states='host'))\n"
        "print(t.train_both_ways('cpu', overlap='backward', states='host'))\n"
    )
    out = _interpreted(code)
    rows = [line.split() for line in out.strip().splitlines()[-15:]]
    assert [row[0] for row in rows] == ["compact", "fp32-master", "bf16"] * 5
    for prec, same, runs in rows:
        assert same == "True", f"{prec}: the weights differ"
        assert int(runs) > 0, f"{prec}: the GPU thread ran no update"


def test_gpu_updates_is_a_bool():
    with pytest.raises(ValueError, match="gpu_updates"):
        ramtorch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], gpu_updates="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("states", ["device", "host"])
@pytest.mark.parametrize("overlap", [True, False, "backward"])
def test_gpu_updates_train_bitwise_as_the_cpu_on_cuda(overlap: bool | str, states: str):
    """Streamed units' updates committed during backward (``overlap="backward"``) are the CPU's
    alone: the GPU takes none of them, and the run is unchanged by the option."""
    cpu_only = overlap == "backward" and states == "device"
    for line in train_both_ways("cuda", overlap=overlap, states=states).splitlines():
        prec, same, runs = line.split()
        assert same == "True", f"{prec}: the weights differ"
        if cpu_only:
            assert int(runs) == 0, f"{prec}: the GPU ran a streamed unit's commit"
        else:
            assert int(runs) > 0, f"{prec}: the GPU ran no update"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["compact", "fp32-master", "bf16"])
def test_resident_weights_updated_in_place_then_by_the_cpu(monkeypatch: pytest.MonkeyPatch, precision: str):
    """``states="host"``: ``step()``'s GPU share updates the weights where they are (their host
    copies get the new ones), then the CPU alone takes over from those host copies; every step
    equals a CPU-only run bit for bit."""
    from ramtorch.optim import _assist

    def run(gpu: bool) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Linear(64, 96, dtype=BF16), torch.nn.Linear(96, 64, dtype=BF16)
        ).cuda()
        opt = ramtorch.optim.AdamW(
            m.parameters(), lr=1e-2, precision=precision, gpu_updates=gpu, overlap=False, states="host"
        )
        torch.manual_seed(1)
        for i in range(6):
            if gpu and i == 3:
                opt._assist.enabled = False  # the CPU from here on, reading the host copies
            m(torch.randn(8, 64, dtype=BF16, device="cuda")).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        weights = [p.detach().cpu().view(torch.int16).clone() for p in m.parameters()]
        return weights, opt.timings["gpu_updates"]

    monkeypatch.setattr(_assist, "GPU_ONLY", True)
    want, _ = run(False)
    got, runs = run(True)
    assert runs >= 2 * 4  # the GPU made every update of steps 2 and 3 (the first makes the states)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_forked_child_leaves_updates_to_the_cpu():
    """After a fork the GPU thread is gone: the child's assist is off and waits for nothing."""
    from ramtorch.optim import _assist

    a = _assist.GpuAssist()
    a.offer(lambda: None, [(_assist.Claim(), lambda: None)])  # starts the thread
    a._running = 1  # as if the fork came while it ran an update
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        ok = not a.enabled and not a.busy()
        if ok:
            a.wait()  # returns at once (else it would wait for a thread that is not there)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    a._running = 0
    a.close(5)
    assert got == b"1"


def _tiny(gpu: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 24, dtype=BF16), torch.nn.Linear(24, 8, dtype=BF16))
    ramtorch.offload(m, device="cpu")
    return m, ramtorch.optim.AdamW(
        m.parameters(), lr=1e-2, precision="compact", overlap=False, gpu_updates=gpu
    )


def _steps(m: torch.nn.Module, opt: torch.optim.Optimizer, n: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(1)
    for _ in range(n):
        m(torch.randn(4, 16, dtype=BF16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().view(torch.int16).clone() for p in m.parameters()]


def test_a_failed_gpu_update_falls_back_to_the_cpu(monkeypatch: pytest.MonkeyPatch):
    """The GPU's update raises: the CPU makes it (the same bits), and the GPU takes no more."""
    from ramtorch.optim import _assist, _gpu_step

    want = _steps(*_tiny(False))
    monkeypatch.setattr(_assist, "supported", lambda device: True)
    monkeypatch.setattr(_assist, "GPU_ONLY", True)

    def boom(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("boom")

    monkeypatch.setattr(_gpu_step.DeviceStepper, "step", boom)
    m, opt = _tiny(True)
    got = _steps(m, opt)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert not opt._assist.enabled and opt.timings["gpu_updates"] == 0


def test_an_update_the_gpu_thread_cannot_make_raises_in_step(monkeypatch: pytest.MonkeyPatch):
    """An error of an update on the GPU's thread (its fallback failing too) reaches ``step()``."""
    import threading

    from ramtorch.optim import _assist, _gpu_step, _state

    monkeypatch.setattr(_assist, "supported", lambda device: True)
    monkeypatch.setattr(_assist, "GPU_ONLY", True)
    monkeypatch.setattr(
        _gpu_step.DeviceStepper, "step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("gpu"))
    )
    original = _state.HostStates._update_host

    def update(self, p, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if threading.current_thread().name == "ramtorch-optim-gpu-step":
            raise ValueError("the fallback failed")
        return original(self, p, *args, **kwargs)

    monkeypatch.setattr(_state.HostStates, "_update_host", update)
    m, opt = _tiny(True)
    m(torch.randn(4, 16, dtype=BF16)).float().square().mean().backward()
    opt.step()  # the first step makes the states (every update in turn, on the CPU)
    m(torch.randn(4, 16, dtype=BF16)).float().square().mean().backward()
    with pytest.raises(ValueError, match="the fallback failed"):
        opt.step()


def test_no_update_of_a_dropped_offer_starts():
    """``step()`` drops the offers before it waits: an update whose offer the GPU thread had
    already taken (it was waiting for the gradients) does not start after that."""
    import threading

    from ramtorch.optim import _assist

    a = _assist.GpuAssist()
    gate, entered, ran = threading.Event(), threading.Event(), []

    def wait() -> None:
        entered.set()
        gate.wait()

    claim = _assist.Claim()
    a.offer(wait, [(claim, lambda: ran.append(1))])
    entered.wait()  # the thread holds the offer and waits for its gradients
    a.drop_offers()
    gate.set()
    a.close(None)  # joins the thread, which ends once it has passed the offer
    assert ran == [] and claim.by is None  # left to the CPU worker


def test_an_optimizer_with_gpu_updates_is_freed():
    """The GPU thread holds no reference to its optimizer between units: deleting the optimizer
    frees it (and its states) after updates ran on the GPU thread."""
    pytest.importorskip("triton")
    code = (
        "import gc, weakref, torch, ramtorch\n"
        "from ramtorch.optim import _assist\n"
        "_assist.supported = lambda device: True\n"
        "_assist.GPU_ONLY = True\n"
        "m = torch.nn.Linear(64, 64, dtype=torch.bfloat16)\n"
        "ramtorch.offload(m, device='cpu')\n"
        "opt = ramtorch.optim.AdamW(m.parameters(), precision='compact', gpu_updates=True)\n"
        "for _ in range(3):\n"
        "    m(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()\n"
        "    opt.step(); opt.zero_grad()\n"
        "print(opt.timings['gpu_updates'])\n"
        "r = weakref.ref(opt); del opt; gc.collect()\n"
        "print(r() is None)\n"
    )
    out = _interpreted(code).strip().splitlines()
    assert int(out[-2]) > 0 and out[-1] == "True"
