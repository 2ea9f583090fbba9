"""The compiled layer (``ramtorch._core``) is not a hole: addresses, counts and sizes passed from
Python that do not name memory the call is entitled to are a clear ``ValueError``, never a crash
or a write outside a buffer; memory a queued copy uses stays mapped until the copy has run."""

from __future__ import annotations

import gc

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from ramtorch import _arena, _core
from torch import nn

OUTSIDE = "not inside memory ramtorch allocated"
HYPER = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}


def _adamw(p, g, m, v, numel, **kw):
    _core.adamw_step(p, "float32", g, "float32", m, v, "float32", numel=numel, **{**HYPER, **kw})


def _arena_buffers(n: int) -> list[torch.Tensor]:
    return [_arena.host_empty((n,), torch.float32, zeroed=True) for _ in range(4)]


def test_optimizer_kernels_refuse_addresses_outside_ramtorch_memory():
    p, g, m, v = _arena_buffers(16)
    plain = torch.zeros(16)
    bogus = [0x1000, 0xDEADBEE0, plain.data_ptr(), 2**62]
    for addr in bogus:
        with pytest.raises(ValueError, match=rf"p.*{OUTSIDE}|param: .*{OUTSIDE}"):
            _adamw(addr, g, m, v, 16)
        with pytest.raises(ValueError, match=rf"exp_avg_sq: .*{OUTSIDE}"):
            _adamw(p, g, m, addr, 16)
        with pytest.raises(ValueError, match=rf"master: .*{OUTSIDE}"):
            _adamw(p, g, m, v, 16, master=addr)
        with pytest.raises(ValueError, match=rf"tensor: .*{OUTSIDE}"):
            _core.grad_stats(addr, "float32", 16)
        with pytest.raises(ValueError, match=rf"tensor: .*{OUTSIDE}"):
            _core.scale_(addr, "float32", 16, 2.0)
        with pytest.raises(ValueError, match=rf"momentum_buffer: .*{OUTSIDE}"):
            _core.sgd_step(
                p, "float32", g, "float32", addr, "float32", numel=16, lr=0.1, momentum=0.9,
                dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False, first_step=True,
            )  # fmt: skip
        with pytest.raises(ValueError, match=rf"exp_avg: .*{OUTSIDE}"):
            _core.lion_step(
                p, "float32", g, "float32", addr, "float32", numel=16, lr=1e-4, beta1=0.9, beta2=0.99,
                weight_decay=0.0,
            )  # fmt: skip
    assert not any(bool(t.any()) for t in (p, g, m, v, plain)), "refused calls write nothing"


def test_counts_beyond_a_buffer_are_refused():
    p, g, m, v = _arena_buffers(16)
    # By address: the range must fit the region.
    with pytest.raises(ValueError, match=OUTSIDE):
        _adamw(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 17)
    with pytest.raises(ValueError, match=OUTSIDE):
        _core.scale_(g.data_ptr(), "float32", 1 << 40, 2.0)
    with pytest.raises(ValueError, match="too many"):
        _core.scale_(g.data_ptr(), "float32", 2**62, 2.0)
    # By tensor: the element count must be the tensor's.
    with pytest.raises(ValueError, match="exp_avg has 8 elements, expected 16"):
        _adamw(p, g, m[:8], v, 16)
    with pytest.raises(ValueError, match="param has 16 elements, expected 17"):
        _adamw(p, g, m, v, 17)
    with pytest.raises(ValueError, match="tensor has 16 elements, expected 100000"):
        _core.grad_stats(torch.zeros(16), "float32", 100_000)
    # Plain (non-arena) tensors work, with the same checks.
    q, h, a, b = (torch.zeros(16) for _ in range(4))
    h.fill_(1.0)
    _adamw(q, h, a, b, 16)
    assert bool((q < 0).all())
    with pytest.raises(ValueError, match="exp_avg_sq has 4 elements"):
        _adamw(q, h, a, b[:4], 16)
    assert not bool(p.any()), "refused calls write nothing"


def test_tensor_buffers_are_checked_for_dtype_layout_and_device():
    p, g, m, v = (torch.zeros(16) for _ in range(4))
    with pytest.raises(ValueError, match=r"grad is torch.float16, expected float32"):
        _adamw(p, g.half(), m, v, 16)
    with pytest.raises(ValueError, match="contiguous"):
        _adamw(p, torch.zeros(32)[::2], m, v, 16)
    with pytest.raises(ValueError, match="must be a torch tensor or an int address"):
        _adamw(p, "grad", m, v, 16)

    class LooksLikeATensor:
        """Duck-types a tensor over memory it does not own."""

        dtype, is_cpu = torch.float32, True

        def data_ptr(self) -> int:
            return 0xDEADBEE0

        def numel(self) -> int:
            return 16

        def is_contiguous(self) -> bool:
            return True

    with pytest.raises(ValueError, match="grad must be a torch tensor or an int address"):
        _adamw(p, LooksLikeATensor(), m, v, 16)
    with pytest.raises(ValueError, match="must be a CPU tensor"):
        _adamw(p, torch.zeros(16, device="meta"), m, v, 16)
    # A view's bytes must lie in its storage; a view of an arena region keeps the region's checks.
    flat = _arena.host_empty((64,), torch.float32, zeroed=True)
    _adamw(flat[0:16], flat[16:32], flat[32:48], flat[48:64], 16)
    with pytest.raises(ValueError, match="overlap"):
        _adamw(flat[0:16], flat[8:24], flat[32:48], flat[48:64], 16)


def test_a_freed_region_is_no_longer_writable_by_address():
    p, g, m, v = _arena_buffers(1024)
    addr = v.data_ptr()
    del v
    gc.collect()
    with pytest.raises(ValueError, match=OUTSIDE):
        _adamw(p, g, m, addr, 1024)


def test_optimizer_state_loaded_for_other_shapes_is_refused_not_a_heap_write():
    """A checkpoint loaded into an optimizer listing the same parameters in another order: the
    states no longer match their parameters. A clear error, at load or at the next step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    opt = ramtorch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = opt.state_dict()
    before = [p.detach().clone() for p in model.parameters()]
    other = ramtorch.optim.AdamW(list(model.parameters())[::-1], lr=1e-3)
    with pytest.raises((ValueError, RuntimeError)):
        other.load_state_dict(state)
        model(torch.randn(4, 64)).sum().backward()
        other.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b), "no parameter was written by the refused step"


def test_engine_refuses_host_ranges_outside_ramtorch_memory():
    eng = _core.Engine("cpu")
    slots = [_arena.host_bytes(256, zeroed=True) for _ in range(3)]
    eng.set_slots(slots, 256)
    plain = torch.zeros(256, dtype=torch.uint8)
    unit = _arena.host_bytes(256)
    for src in (0x1000, plain.data_ptr(), plain, unit.data_ptr() + 1):
        with pytest.raises(ValueError, match=rf"acquire: src: .*{OUTSIDE}"):
            eng.acquire(src, 256, 2, 0)
        with pytest.raises(ValueError, match=rf"prefetch: src: .*{OUTSIDE}"):
            eng.prefetch(None, src, 256, 2, [])
        with pytest.raises(ValueError, match=rf"copy_to_host: dst: .*{OUTSIDE}"):
            eng.copy_to_host(src, plain, 256, 2, 0)
    with pytest.raises(ValueError, match="holds 128 bytes, 256 asked for"):
        eng.acquire(unit[:128], 256, 2, 0)
    with pytest.raises(ValueError, match=r"src: the tensor holds 16 bytes, 256 asked for"):
        eng.copy_to_host(unit, torch.zeros(16, dtype=torch.uint8), 256, 2, 0)
    with pytest.raises(ValueError, match=r"src must be a tensor, not an int address"):
        eng.copy_to_host(unit, 0, 256, 2, 0)
    assert eng.in_flight() == (0, 0), "refused calls queue nothing"
    # An empty unit names no memory: nothing to check, nothing copied.
    index, _ = eng.acquire(torch.empty(0, dtype=torch.uint8), 0, 2, 0)
    eng.release(index, 0)
    eng.synchronize()
    # The same calls on valid memory work, by tensor and by address.
    unit.copy_(torch.arange(256, dtype=torch.uint8))
    for src in (unit, unit.data_ptr()):
        index, _ = eng.acquire(src, 256, 2, 0)
        assert torch.equal(slots[index], unit)
        eng.release(index, 0)
    dst = _arena.host_bytes(256, zeroed=True)
    eng.copy_to_host(dst, slots[index], 256, 2, 0)
    eng.synchronize()
    assert torch.equal(dst, unit)


def test_slots_are_checked():
    eng = _core.Engine("cpu")
    with pytest.raises(ValueError, match="slot 1: the tensor holds 64 bytes, 128 asked for"):
        eng.set_slots([_arena.host_bytes(128), _arena.host_bytes(64)], 128)
    with pytest.raises(ValueError, match=f"slot 0: .*{OUTSIDE}"):
        eng.set_slots([0], 128)
    t = _arena.host_bytes(512)
    with pytest.raises(ValueError, match="overlap"):
        eng.set_slots([t[:128], t[64:192]], 128)
    with pytest.raises(ValueError, match="overlap"):
        eng.set_slots([t.data_ptr(), t.data_ptr() + 64], 128)  # addresses inside the arena
    with pytest.raises(ValueError, match=OUTSIDE):
        eng.set_slots([2**64 - 8], 128)
    assert eng.slots() == (0, 0), "refused slots are not taken"
    # Slot memory is kept alive by the engine while it is its slots.
    eng.set_slots([_arena.host_bytes(128) for _ in range(2)], 128)
    gc.collect()
    ramtorch.empty_cache()
    unit = _arena.host_bytes(128)
    unit.fill_(7)
    index, ptr = eng.acquire(unit, 128, 2, 0)
    eng.release(index, 0)
    eng.synchronize()


def test_the_host_engine_writes_and_reads_only_memory_it_may():
    """The host device's slots and gradient sources are host memory: slots must be memory ramtorch
    allocated (the engine writes them, and holds them), gradient sources tensors (never an int,
    which could name any byte of the process)."""
    eng = _core.Engine("cpu")
    victim = torch.zeros(256, dtype=torch.uint8)
    for slot in (victim, victim.data_ptr()):
        with pytest.raises(ValueError, match=f"set_slots: slot 0: .*{OUTSIDE}"):
            eng.set_slots([slot, _arena.host_bytes(256)], 256)
    assert eng.slots() == (0, 0)
    eng.set_slots([_arena.host_bytes(256) for _ in range(3)], 256)
    unit = _arena.host_bytes(256)
    unit.fill_(9)
    index, _ = eng.acquire(unit, 256, 2, 0)
    eng.release(index, 0)
    eng.synchronize()
    assert not bool(victim.any()), "a refused slot was written"
    secret = torch.full((256,), 5, dtype=torch.uint8)
    dst = _arena.host_bytes(256, zeroed=True)
    with pytest.raises(ValueError, match="copy_to_host: src must be a tensor, not an int address"):
        eng.copy_to_host(dst, secret.data_ptr(), 256, 2, 0)
    eng.synchronize()
    assert not bool(dst.any()), "a refused copy read memory"
    with pytest.raises(ValueError, match="src must be a CPU tensor, got one on meta"):
        eng.copy_to_host(dst, torch.empty(256, dtype=torch.uint8, device="meta"), 256, 2, 0)
    eng.copy_to_host(dst, secret, 256, 2, 0)  # a tensor: its own bytes
    eng.synchronize()
    assert torch.equal(dst, secret)


class _Liar(torch.Tensor):
    """A tensor subclass whose methods report another buffer's memory."""

    target: torch.Tensor

    def data_ptr(self) -> int:
        return type(self).target.data_ptr()

    def numel(self) -> int:
        return type(self).target.numel()


class _TorchFunctionLiar(torch.Tensor):
    """Lies through ``__torch_function__``, which torch consults even for ``TensorBase``'s methods."""

    target: torch.Tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        name = getattr(func, "__name__", "")
        if name in ("data_ptr", "numel"):
            return getattr(cls.target, name)()
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("liar", [_Liar, _TorchFunctionLiar], ids=["override", "torch_function"])
def test_a_tensor_subclass_cannot_point_the_kernels_at_other_memory(liar, tmp_path):
    """A subclass can make ``data_ptr()``/``numel()`` say anything: only ``torch.Tensor`` and
    ``nn.Parameter`` are taken, so a lie writes nothing (before, the kernels wrote the victim)."""
    victim = torch.ones(16)
    liar.target = victim
    t = torch.zeros(1).as_subclass(liar)
    assert t.data_ptr() == victim.data_ptr() and t.numel() == 16  # the lie
    sub = "must be a torch.Tensor or torch.nn.Parameter, not the subclass"
    with pytest.raises(ValueError, match=f"tensor {sub} {liar.__name__}"):
        _core.scale_(t, "float32", 16, 2.0)
    p, g, m, v = _arena_buffers(16)
    with pytest.raises(ValueError, match=f"param {sub}"):
        _adamw(t, g, m, v, 16)
    f, w = _st_file(tmp_path)
    with pytest.raises(ValueError, match=sub):
        f.copy_into("w", t, w.numel() * 4, "F32")
    eng = _core.Engine("cpu")
    with pytest.raises(ValueError, match=f"slot 0 {sub}"):
        eng.set_slots([t], 4)
    eng.set_slots([_arena.host_bytes(64) for _ in range(2)], 64)
    with pytest.raises(ValueError, match=f"src {sub}"):
        eng.copy_to_host(_arena.host_bytes(64), t, 64, 2, 0)
    with pytest.raises(ValueError, match=f"src {sub}"):
        eng.acquire(t, 64, 2, 0)
    eng.synchronize()
    assert torch.equal(victim, torch.ones(16)), "a refused call wrote the victim"
    # A parameter is taken (type nn.Parameter exactly), and so is the honest subclass's plain view.
    q = nn.Parameter(torch.ones(16))
    _core.scale_(q, "float32", 16, 2.0)
    assert torch.equal(q.detach(), torch.full((16,), 2.0))
    plain = torch.ones(16).as_subclass(liar).as_subclass(torch.Tensor)
    _core.scale_(plain, "float32", 16, 2.0)
    assert torch.equal(plain, torch.full((16,), 2.0))


def test_attributes_set_on_a_tensor_do_not_change_what_the_kernels_see():
    """``t.data_ptr = ...`` on a plain tensor shadows the method for Python code; the compiled
    layer reads the tensor's memory through torch's C type, so the lie changes nothing."""
    victim = torch.ones(16)
    t = torch.ones(4)
    t.data_ptr = victim.data_ptr  # type: ignore[method-assign]
    t.numel = victim.numel  # type: ignore[method-assign]
    t.is_contiguous = lambda: True  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="tensor has 4 elements, expected 16"):
        _core.scale_(t, "float32", 16, 2.0)
    _core.scale_(t, "float32", 4, 3.0)
    assert torch.equal(victim, torch.ones(16)), "the victim was written"
    assert torch.equal(t, torch.full((4,), 3.0))
    strided = torch.ones(8)[::2]
    strided.is_contiguous = lambda: True  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="contiguous"):
        _core.scale_(strided, "float32", 4, 2.0)


def test_a_queued_copy_keeps_its_memory_until_it_has_run():
    """The engine holds the memory of every copy it queued: freeing the tensors and emptying the
    cache right after leaves the regions mapped until the engine has seen the copies complete."""
    eng = _core.Engine("cpu")
    eng.set_slots([_arena.host_bytes(4096) for _ in range(3)], 4096)
    gc.collect()  # regions earlier tests left to the collector go now, not during the count
    ramtorch.empty_cache()
    base = _core.arena_stats()["regions"]
    unit = _arena.host_bytes(4096)
    unit.fill_(3)
    slot, _, copied = eng.prefetch(1, unit, 4096, 2, [])
    grad_dst = _arena.host_bytes(4096)
    eng.copy_to_host(grad_dst, torch.ones(4096, dtype=torch.uint8), 4096, 2, 0)
    del unit, grad_dst
    gc.collect()
    ramtorch.empty_cache()
    assert copied
    assert _core.arena_stats()["regions"] == base + 2, "memory of queued copies was freed"
    eng.claim(slot, 0)
    eng.release(slot, 0)
    eng.synchronize()
    assert _core.arena_stats()["regions"] == base, "retired copies let their memory go"


@pytest.mark.parametrize("kind", ["linear", "offload"])
def test_freeing_a_model_while_its_next_pass_is_prefetched_does_not_crash(kind):
    """An inference pass ends by prefetching the next pass's first units; deleting the model and
    emptying the cache right after must not unmap memory a queued copy still reads."""
    torch.manual_seed(0)
    x = torch.randn(2, 1024)
    for _ in range(4):
        layers = [nn.Linear(1024, 1024) for _ in range(6)]
        ref = nn.Sequential(*layers)
        want = ref(x)
        if kind == "linear":
            model = nn.Sequential(*[rnn.Linear(1024, 1024) for _ in range(6)])
            model.load_state_dict(ref.state_dict())
        else:
            model = ramtorch.offload(ref, device="cpu", unit=nn.Linear)
        with torch.no_grad():
            for _ in range(2):
                got = model(x)
                torch.testing.assert_close(got, want.detach())
        del model, ref, layers
        gc.collect()
        ramtorch.empty_cache()
    ramtorch.synchronize()
    ramtorch.empty_cache()


def _st_file(tmp_path) -> tuple[_core.SafetensorsFile, torch.Tensor]:
    from safetensors.torch import save_file

    w = torch.randn(64, 8)
    path = tmp_path / "w.safetensors"
    save_file({"w": w}, str(path))
    return _core.SafetensorsFile(str(path)), w


def test_file_reads_refuse_destinations_that_are_not_host_memory_they_may_write(tmp_path):
    f, w = _st_file(tmp_path)
    n = w.numel() * 4
    plain = torch.zeros(w.numel())
    for addr in (0x1000, 0xDEADBEE0, plain.data_ptr(), 2**62):
        with pytest.raises(ValueError, match=OUTSIDE):
            f.copy_into("w", addr, n, "F32")
        with pytest.raises(ValueError, match=OUTSIDE):
            f.copy_many([("w", addr, n, "F32")])
    assert not bool(plain.any()), "refused calls write nothing"
    with pytest.raises(ValueError, match="holds 1020 bytes, 2048 asked for"):
        f.copy_into("w", torch.zeros(255), n, "F32")
    with pytest.raises(ValueError, match="must be a CPU tensor"):
        f.copy_into("w", torch.empty(w.numel(), device="meta"), n, "F32")
    strided = torch.zeros(w.numel() * 2)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        f.copy_into("w", strided, n, "F32")
    assert not bool(strided.any())
    with pytest.raises(ValueError, match="must be a torch tensor or an int address"):
        f.copy_into("w", bytearray(n), n, "F32")
    with pytest.raises((ValueError, OverflowError, TypeError)):
        f.copy_into("w", -1, n, "F32")
    # One bad destination refuses the whole batch before anything is written.
    good = torch.zeros(w.numel())
    with pytest.raises(ValueError, match=OUTSIDE):
        f.copy_many([("w", good, n, "F32"), ("w", plain.data_ptr(), n, "F32")])
    assert not bool(good.any())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_file_reads_refuse_a_cuda_destination(tmp_path):
    f, w = _st_file(tmp_path)
    with pytest.raises(ValueError, match="must be a CPU tensor"):
        f.copy_into("w", torch.empty(w.numel(), device="cuda"), w.numel() * 4, "F32")


def test_file_reads_fill_tensors_and_ramtorch_memory(tmp_path):
    f, w = _st_file(tmp_path)
    n = w.numel() * 4
    fresh = torch.empty(w.numel())
    f.copy_into("w", fresh, n, "F32")
    assert torch.equal(fresh.view(64, 8), w)
    region = _arena.host_empty((2 * w.numel(),), torch.float32, zeroed=True)
    f.copy_many([("w", region.data_ptr() + n, n, "F32")])  # an address inside the region
    assert torch.equal(region[w.numel() :].view(64, 8), w)
    assert not bool(region[: w.numel()].any())
    view = region[: w.numel()]  # a view into the region, passed as a tensor
    f.copy_into("w", view, n, "F32")
    assert torch.equal(view.view(64, 8), w)
    bf = _arena.host_bytes(1 << 12)  # a staging buffer longer than the tensor, converted
    f.copy_into("w", bf, w.numel() * 2, "BF16")
    assert torch.equal(bf[: w.numel() * 2].view(torch.bfloat16).view(64, 8), w.to(torch.bfloat16))
    with pytest.raises(ValueError, match=OUTSIDE):  # the range must fit the region
        f.copy_into("w", region.data_ptr() + n + 4, n, "F32")


def test_front_end_hands_the_engine_its_slot_and_gradient_tensors():
    """The front end passes its slot tensors and gradient sources to the engine as tensors (so the
    size checks apply and the engine holds the slots); a streamed layer still matches torch."""
    torch.manual_seed(0)
    ref = nn.Linear(48, 24)
    layer = rnn.Linear(48, 24, device="cpu")
    with torch.no_grad():
        layer.weight.copy_(ref.weight)
        layer.bias.copy_(ref.bias)
    x = torch.randn(5, 48)
    x_ref = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    y = layer(x)
    y.sum().backward()
    ref(x_ref).sum().backward()
    ramtorch._engine.engine_for(torch.device("cpu")).synchronize()
    torch.testing.assert_close(y, ref(x_ref))
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    eng = ramtorch._engine.engine_for(torch.device("cpu"))
    assert eng._core.slots() == (len(eng._slots), eng._slot_bytes)
    assert len(eng._slots) > 0


@pytest.mark.parametrize("dtype", list(_arena._DLPACK) + [torch.complex64, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 1, 4)])
def test_typed_host_tensors_are_the_dtype_and_shape_asked_for(dtype, shape):
    t = _arena.host_empty(shape, dtype, zeroed=True)
    assert (t.dtype, tuple(t.shape), t.is_contiguous()) == (dtype, shape, True)
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if t.numel() == 0:
        return
    src = torch.arange(t.numel()).reshape(shape).to(dtype)
    t.copy_(src)
    v = _arena.view_at(t.data_ptr(), shape, dtype)  # a storage of its own over the same bytes
    assert (v.dtype, tuple(v.shape), v.data_ptr()) == (dtype, shape, t.data_ptr())
    assert v.untyped_storage().data_ptr() != 0 and torch.equal(v, src)
    del t
    gc.collect()
    assert torch.equal(v, src)  # the view keeps the region alive


def test_typed_capsules_refuse_types_and_shapes_that_do_not_fit():
    t = _arena.host_empty((6,), torch.float32)
    with pytest.raises(ValueError, match="does not cover"):
        _core.arena_view(t.data_ptr(), 24, (2, 32), [7])
    with pytest.raises(ValueError, match="does not cover"):
        _core.arena_alloc(24, False, True, (2, 32), [2, 2])
    with pytest.raises(ValueError, match="negative size"):
        _core.arena_view(t.data_ptr(), 24, (2, 32), [-6])
    with pytest.raises(ValueError, match="overflows"):
        _core.arena_view(t.data_ptr(), 24, (2, 32), [1 << 40, 1 << 40])
    with pytest.raises(ValueError, match="not one ramtorch exports"):
        _core.arena_view(t.data_ptr(), 24, (5, 64), [3])
    with pytest.raises(ValueError, match="together"):
        _core.arena_view(t.data_ptr(), 24, (2, 32), None)
    with pytest.raises(ValueError, match=OUTSIDE):
        _core.arena_view(12345, 24, (2, 32), [6])
