"""A large ``nn.Linear`` (an LM head) copied in parts and computed by blocks of rows as they land
(``ramtorch._stream.rows``): against plain torch (outputs, gradients, optimizer steps), on the
CPU's host device and on a GPU, with the cases that must take the whole copy instead. The
thresholds are lowered so that small heads qualify."""

from __future__ import annotations

import copy
import weakref

import pytest
import ramtorch
import torch
from ramtorch import _engine, _offload
from ramtorch._stream import rows
from torch import nn

VOCAB, WIDTH = 200, 32


@pytest.fixture(autouse=True)
def small_heads(monkeypatch):
    monkeypatch.setattr(rows, "MIN_BYTES", 1 << 12)
    monkeypatch.setattr(rows, "MIN_PART_BYTES", 1 << 10)
    monkeypatch.setattr(rows, "ROW_ALIGN", 8)


def model(dtype: torch.dtype = torch.float32, bias: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, WIDTH, dtype=dtype), nn.GELU(), nn.Linear(WIDTH, VOCAB, bias=bias, dtype=dtype)
    )


def by_rows(m: nn.Module) -> int:
    return ramtorch.stats(m)["forwards_by_rows"]


def tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(6, 16), (3, 5, 16)], ids=["2d", "3d"])
def test_by_rows_trains_as_torch(device, dtype, bias, shape):
    ref, ours = model(dtype, bias).to(device), model(dtype, bias)
    ramtorch.offload(ours, device=device)
    assert type(ours[2]) is rows.RowsLinear and isinstance(ours[2], nn.Linear)
    assert repr(ours[2]) == repr(ref[2]) and list(ours.state_dict()) == list(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    steps = 3
    for _ in range(steps):
        x = torch.randn(*shape, generator=gen).to(device, dtype)
        y_ref, y = ref(x), ours(x)
        assert y.shape == y_ref.shape and y.is_contiguous()
        torch.testing.assert_close(y, y_ref, **tol(dtype))
        w = torch.randn(y.shape, generator=gen).to(device, dtype)
        (y_ref * w).sum().backward()
        (y * w).sum().backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(b.grad.to(a.device), a.grad, **tol(dtype))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.detach().to(a.device), a.detach(), **tol(dtype))
    # A bias packed after the weight would hold every block back: such a head goes whole.
    cut = rows.blocks_of(ours[2]._ramtorch_unit) is not None
    assert cut == (not bias or _bias_first(ours[2]._ramtorch_unit))
    assert by_rows(ours) == (steps if cut else 0)


def _bias_first(u) -> bool:
    off = {e.name: u.layout.entries[e.index][0] for e in u.entries}
    return off["bias"] < off["weight"]


def test_blocks_cover_the_rows_and_parts_end_inside_the_copy():
    ours = model()
    ramtorch.offload(ours, device="cpu")
    ours(torch.randn(2, 16))
    u = ours[2]._ramtorch_unit
    b = rows.blocks_of(u)
    assert b is not None and len(b.blocks) > 1
    assert b.blocks[0][0] == 0 and b.blocks[-1][1] == VOCAB
    assert all(p[1] == q[0] for p, q in zip(b.blocks, b.blocks[1:]))
    assert all(r0 % rows.ROW_ALIGN == 0 for r0, _, _ in b.blocks)
    assert b.parts == sorted(set(b.parts)) and 0 < b.parts[0] and b.parts[-1] < u.layout.nbytes
    row_bytes = WIDTH * 4
    w0 = u.layout.entries[0][0]
    assert [upto for _, _, upto in b.blocks] == [w0 + r1 * row_bytes for _, r1, _ in b.blocks]


def test_a_bias_after_the_weight_is_waited_for_by_every_block():
    ours = model(bias=True)
    ramtorch.offload(ours, device="cpu")
    ours(torch.randn(2, 16))
    u = ours[2]._ramtorch_unit
    b = rows.blocks_of(u)
    if _bias_first(u):
        assert b is not None and b.blocks[0][2] < u.layout.nbytes  # the first block waits less
    else:
        assert b is None or all(upto == u.layout.nbytes for _, _, upto in b.blocks)


def test_small_linears_and_other_modules_go_whole(monkeypatch):
    ours = model()
    ramtorch.offload(ours, device="cpu")
    assert type(ours[0]) is nn.Linear  # under the threshold: left as it is
    ours(torch.randn(2, 16))
    assert by_rows(ours) == 1
    rows.release(ours[2])  # a Linear of one block goes whole
    ours[2].__class__ = rows.RowsLinear
    monkeypatch.setattr(rows, "MIN_PART_BYTES", 1 << 20)
    ours[2]._ramtorch_unit._per_layout.clear()
    ours(torch.randn(2, 16))
    assert rows.blocks_of(ours[2]._ramtorch_unit) is None
    assert by_rows(ours) == 1


@pytest.mark.parametrize(
    "case", ["deterministic", "autocast", "hook", "kwargs", "other-dtype", "compile", "no-grad"]
)
def test_what_is_not_cut_waits_for_the_whole_copy_and_matches(case, monkeypatch):
    ref, ours = model(), model()
    ramtorch.offload(ours, device="cpu")
    x = torch.randn(4, 16)
    call = ours
    expect = 0
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    elif case == "hook":
        ours[2].register_forward_pre_hook(lambda m, a: None)
    elif case == "kwargs":
        ours[2].forward  # noqa: B018 - the class's forward
        call = lambda x: ours[2](input=ours[1](ours[0](x)))  # noqa: E731
        ref_call = lambda x: ref[2](input=ref[1](ref[0](x)))  # noqa: E731
    elif case == "other-dtype":
        ours[2].register_forward_pre_hook(lambda m, a: None)  # (so the cast input is accepted)
    elif case == "compile":
        call = torch.compile(ours, backend="eager")
    elif case == "no-grad":
        expect = 1  # no grad is no reason to go whole
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        with torch.no_grad() if case == "no-grad" else torch.enable_grad():
            y_ref = (ref_call if case == "kwargs" else ref)(x)
            y = call(x)
    if case == "deterministic":
        assert torch.equal(y, y_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    if case == "compile":
        # The hooks may run eagerly and cut the copy, but the traced forward waits for all of it
        # before its product (settle): the cut is never taken.
        assert ours[2].__dict__.get("_ramtorch_armed") is None
    else:
        assert by_rows(ours) == expect


def test_the_class_is_restored_when_streaming_ends():
    ours = model()
    ramtorch.offload(ours, device="cpu")
    assert type(ours[2]) is rows.RowsLinear
    ours(torch.randn(2, 16))
    _offload.detach_streamer(ours)
    assert type(ours[2]) is nn.Linear and "_ramtorch_armed" not in ours[2].__dict__


def test_a_forward_that_fails_leaves_the_slot_waited_for_and_the_model_usable():
    ref, ours = model(), model()
    ramtorch.offload(ours, device="cpu")
    with pytest.raises(RuntimeError):
        ours(torch.randn(2, 17))  # the first layer refuses the width
    with pytest.raises(RuntimeError):
        ours[2](torch.randn(2, WIDTH + 1))  # the head refuses it (not cut: wrong width)
    x = torch.randn(3, 16)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)
    assert "_ramtorch_armed" not in ours[2].__dict__ or ours[2].__dict__["_ramtorch_armed"] is None


def test_a_head_run_twice_in_a_pass_and_accumulating_gradients():
    """A Linear called twice in one forward (a tied or shared head), its gradients accumulating
    over two backwards."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp = nn.Linear(16, WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
            self.back = nn.Linear(VOCAB, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.back(self.head(self.inp(x))))

    ref, ours = Twice(), copy.deepcopy(Twice())
    ramtorch.offload(ours, device="cpu")
    for _ in range(2):
        x = torch.randn(5, 16)
        ref(x).square().mean().backward()
        ours(x).square().mean().backward()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    assert by_rows(ours) >= 4


@pytest.mark.parametrize(
    "case", ["fresh", "accumulating", "hooked", "frozen-input", "ramtorch-optim", "opaque-listener"]
)
def test_the_head_weight_gradient_leaves_by_blocks_as_computed(device, case, monkeypatch):
    """The head's weight gradient is computed first and by the forward's blocks of rows, each
    block's copy queued as soon as the block is computed: gradients, accumulated gradients (the
    device sum crossing by blocks) and optimizer steps equal torch's, with torch's optimizer or
    ramtorch's (an engine listener that reduces nothing here). A gradient hook on the weight, or
    a listener that cannot say whether it reduces the gradient, reads it whole: then it is
    computed whole and crosses in one copy."""
    wide, vocab = 64, 1024  # a 256 KiB head: above the size whose gradient waits for a batch
    calls: list[int] = []
    sizes: list[int] = []
    real_push, real_copy = _engine.DeviceEngine.push_grad_by_rows, _engine.DeviceEngine._queue_copy

    def push(self, param, dtype, blocks, fill, *a, **k):
        calls.append(len(blocks))
        return real_push(self, param, dtype, blocks, fill, *a, **k)

    def queue(self, dst, src, nbytes, *a, **k):
        sizes.append(nbytes)
        return real_copy(self, dst, src, nbytes, *a, **k)

    monkeypatch.setattr(_engine.DeviceEngine, "push_grad_by_rows", push)
    monkeypatch.setattr(_engine.DeviceEngine, "_queue_copy", queue)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, wide), nn.GELU(), nn.Linear(wide, vocab, bias=False))

    ref, ours = make().to(device), make()
    ramtorch.offload(ours, device=device)
    # The device's engine is shared by every model on it: listeners other tests left (their
    # objects not yet collected) are not this test's.
    monkeypatch.setattr(ours._ramtorch_streamer.eng, "_listeners", weakref.WeakSet())
    if case == "hooked":
        for m in (ref, ours):
            m[2].weight.register_hook(lambda g: g * 2)
    if case == "frozen-input":
        for m in (ref, ours):
            m[0].requires_grad_(False)
    if case == "opaque-listener":

        class Opaque:  # no ``reduces_grad``: taken to read every gradient whole
            def on_grads(self, _eng, _params):
                pass

            def reduce_grad(self, _param, _grad):
                return None

            def before_finish(self, _eng):
                pass

            def after_finish(self):
                pass

        listener = Opaque()
        ours._ramtorch_streamer.eng.add_listener(listener)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    make_opt = ramtorch.optim.AdamW if case == "ramtorch-optim" else torch.optim.AdamW
    opt = make_opt(ours.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for _ in range(2 if case == "accumulating" else 1):
            x = torch.randn(3, 7, 16, generator=gen).to(device)
            w = torch.randn(3, 7, vocab, generator=gen).to(device)
            (ref(x) * w).sum().backward()
            (ours(x) * w).sum().backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            if a.requires_grad:
                torch.testing.assert_close(b.grad.to(a.device), a.grad, rtol=1e-5, atol=1e-5)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.detach().to(a.device), a.detach(), rtol=1e-5, atol=1e-5)
    if case == "ramtorch-optim":
        assert opt in set(ours._ramtorch_streamer.eng._listeners)  # it listened to the backward
    n = len(rows.blocks_of(ours[2]._ramtorch_unit).blocks)
    assert n >= 2 and calls == [n] * len(calls) and len(calls) == (6 if case == "accumulating" else 3)
    block = 4 * wide * rows.blocks_of(ours[2]._ramtorch_unit).blocks[0][1]
    whole = 4 * wide * vocab
    if case in ("hooked", "opaque-listener"):
        assert whole in sizes and block not in sizes
    else:
        assert block in sizes and whole not in sizes


@pytest.mark.parametrize("accumulating", [False, True], ids=["fresh", "accumulating"])
def test_a_head_backward_failing_between_blocks_leaves_grad_as_it_was(accumulating, monkeypatch):
    """The head's gradient fails after some of its blocks were queued (an out-of-memory error in a
    block's product): the backward raises that error, ``.grad`` is what it was before it (no
    block landed in it; a device sum that may hold some is dropped), and the next backwards
    are torch's."""
    wide, vocab = 64, 1024
    real_push = _engine.DeviceEngine.push_grad_by_rows
    fail = {"on": False}

    class Boom(Exception):
        pass

    def push(self, param, dtype, blocks, fill, *a, **k):
        def failing(r0, r1, out):
            if fail["on"] and r0 > 0:
                raise Boom
            fill(r0, r1, out)

        return real_push(self, param, dtype, blocks, failing, *a, **k)

    monkeypatch.setattr(_engine.DeviceEngine, "push_grad_by_rows", push)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, wide), nn.GELU(), nn.Linear(wide, vocab, bias=False))

    ref, ours = make(), make()
    ramtorch.offload(ours, device="cpu")
    monkeypatch.setattr(ours._ramtorch_streamer.eng, "_listeners", weakref.WeakSet())
    gen = torch.Generator().manual_seed(1)

    def both() -> None:
        x, w = torch.randn(3, 16, generator=gen), torch.randn(3, vocab, generator=gen)
        (ref(x) * w).sum().backward()
        (ours(x) * w).sum().backward()

    for _ in range(2 if accumulating else 1):  # two: the engine keeps device sums from then on
        both()
    if not accumulating:
        ref.zero_grad()
        ours.zero_grad()
    before = {n: None if p.grad is None else p.grad.clone() for n, p in ours.named_parameters()}
    fail["on"] = True
    x = torch.randn(3, 16, generator=gen)
    with pytest.raises(Boom):
        (ours(x) * torch.randn(3, vocab, generator=gen)).sum().backward()
    fail["on"] = False
    ramtorch.synchronize()
    for n, p in ours.named_parameters():
        if before[n] is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, before[n])
    for _ in range(2):
        both()
        for a, b in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_under_autocast_a_head_of_autocasts_dtype_goes_by_rows_as_torch(device, bias, monkeypatch):
    """Under autocast (a training loop's ``torch.autocast(dtype=torch.bfloat16)``, as the
    Trainer's ``bf16=True`` runs it) a bf16 head is cut as without it: its input, float32 out of
    a LayerNorm that autocast runs in float32, is cast to bf16 as autocast casts a linear's
    input, and the weight's gradient leaves by blocks. Outputs, gradients and optimizer steps
    are those of the same model resident under the same autocast."""
    pushed: list[int] = []
    real_push = _engine.DeviceEngine.push_grad_by_rows

    def push(self, param, dtype, blocks, fill, *a, **k):
        pushed.append(len(blocks))
        return real_push(self, param, dtype, blocks, fill, *a, **k)

    monkeypatch.setattr(_engine.DeviceEngine, "push_grad_by_rows", push)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 1024, bias=bias)).to(
            torch.bfloat16
        )

    ref, ours = make().to(device), make()
    ramtorch.offload(ours, device=device)
    monkeypatch.setattr(ours._ramtorch_streamer.eng, "_listeners", weakref.WeakSet())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    kind = torch.device(device).type
    steps = 3
    for _ in range(steps):
        x = torch.randn(3, 5, 16, generator=gen).to(device)
        w = torch.randn(3, 5, 1024, generator=gen).to(device)
        with torch.autocast(kind, dtype=torch.bfloat16):
            y_ref, y = ref(x), ours(x)
        assert y.dtype == y_ref.dtype == torch.bfloat16
        torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
        (y_ref.float() * w).sum().backward()
        (y.float() * w).sum().backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            assert b.grad.dtype == a.grad.dtype
            torch.testing.assert_close(b.grad.to(a.device).float(), a.grad.float(), rtol=3e-2, atol=3e-2)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.detach().to(a.device).float(), a.detach().float(), rtol=2e-2, atol=2e-2)
    cut = rows.blocks_of(ours[2]._ramtorch_unit) is not None
    assert cut == (not bias or _bias_first(ours[2]._ramtorch_unit))
    assert by_rows(ours) == (steps if cut else 0)
    assert len(pushed) == (steps if cut else 0)


@pytest.mark.gpu
def test_a_large_head_by_rows_on_cuda(monkeypatch):
    """At the real thresholds: a 128 MiB bf16 head is cut, its logits and gradients are torch's
    (to bf16's rounding), and the forward took it by parts."""
    monkeypatch.setattr(rows, "MIN_BYTES", 64 << 20)
    monkeypatch.setattr(rows, "MIN_PART_BYTES", 16 << 20)
    monkeypatch.setattr(rows, "ROW_ALIGN", 64)
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 65536, bias=False)).to(torch.bfloat16)  # noqa: E731
    ref = make().cuda()
    torch.manual_seed(0)
    ours = make()
    ramtorch.offload(ours, device="cuda")
    u = ours[1]._ramtorch_unit
    for _ in range(2):
        x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
        y_ref, y = ref(x), ours(x)
        torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
        y_ref.float().square().mean().backward()
        y.float().square().mean().backward()
    torch.cuda.synchronize()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad.cuda().float(), a.grad.float(), rtol=5e-2, atol=1e-3)
    assert len(rows.blocks_of(u).blocks) == 8
    assert by_rows(ours) == 2


@pytest.mark.gpu
def test_a_large_fp8_head_by_rows_on_cuda(monkeypatch):
    """At the thresholds of the default: a head of 64 MiB and more streams in fp8 and computes by
    blocks of rows as its parts are decoded."""
    monkeypatch.setattr(rows, "MIN_BYTES", 64 << 20)
    monkeypatch.setattr(rows, "MIN_PART_BYTES", 16 << 20)
    monkeypatch.setattr(rows, "ROW_ALIGN", 64)
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(64, 4096), nn.Linear(4096, 16384, bias=False)).to(torch.bfloat16)
    head.requires_grad_(False)
    ref = copy.deepcopy(head)
    ramtorch.offload(head, compress="fp8")  # (the head decodes by parts: .codec_parts tests)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = [head(x) for _ in range(3)]
    assert ramtorch.stats(head)["forwards_by_rows"] == 3
    monkeypatch.setattr(rows, "by_rows", lambda *a, **k: None)
    whole = copy.deepcopy(ref)
    ramtorch.offload(whole, compress="fp8")
    with torch.no_grad():
        want = whole(x)
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-2, atol=1e-2)
    cos = torch.nn.functional.cosine_similarity(want.float().flatten(), ref.cuda()(x).float().flatten(), 0)
    assert float(cos) > 0.99


def test_greedy_generation_with_a_head_cut_by_rows():
    """transformers' ``generate()`` (its passes reuse the copies prefetched at the end of the
    pass before, whose parts' events are older): the tokens and scores of the plain model, with
    the head cut on every pass."""
    transformers = pytest.importorskip("transformers")
    from conftest import greedy, tiny_llama_config

    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=512, tie_word_embeddings=False, initializer_range=0.2)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    assert type(ours.lm_head) is rows.RowsLinear
    ids = torch.randint(0, 512, (2, 7))

    seq_ref, scores_ref = greedy(ref, ids, new=8)
    seq, scores = greedy(ours, ids, new=8)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(scores, scores_ref, rtol=1e-5, atol=1e-5)
    assert by_rows(ours) >= 8
