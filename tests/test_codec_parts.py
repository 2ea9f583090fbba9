"""Units streamed in fp8 (``offload(compress="fp8")``) computed as their copy lands: decoded part
by part, each part once the encoded bytes it reads have crossed (``_codec.encoded_upto``), a
unit of several layers by parts (``.parts``) and a large ``nn.Linear`` by blocks of rows
(``.rows``). Against the same model decoded whole: bitwise for parts (each layer computes the
same op on the same bytes), close for rows (a block's product may round unlike the whole's);
on the CPU's host device and on a GPU. ``"lossless"`` regions decode by parts too, from the
segments their parts' raw bytes lie in; a lossless unit cut by parts is bitwise the model's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ramtorch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ramtorch import _codec
from ramtorch._stream import parts, rows
from torch import nn


@pytest.fixture(autouse=True)
def small_units(monkeypatch):
    monkeypatch.setattr(parts, "MIN_BYTES", 1 << 14)
    monkeypatch.setattr(parts, "MIN_PART_BYTES", 1 << 12)
    monkeypatch.setattr(parts, "DOMINANCE", 0.0)  # (units alike are cut too)
    monkeypatch.setattr(parts, "compiled_anything", lambda: False)
    monkeypatch.setattr(rows, "MIN_BYTES", 1 << 12)
    monkeypatch.setattr(rows, "MIN_PART_BYTES", 1 << 10)
    monkeypatch.setattr(rows, "ROW_ALIGN", 8)


def _region(shapes: list[tuple[int, ...]], seed: int) -> tuple[torch.Tensor, list, int]:
    """A unit's raw region holding bf16 tensors of ``shapes`` at 64-byte aligned offsets."""
    gen = torch.Generator().manual_seed(seed)
    entries, at = [], 0
    for shape in shapes:
        at = -(-at // 64) * 64
        entries.append((at, shape, torch.bfloat16))
        at += 2 * int(torch.Size(shape).numel())
    flat = torch.zeros(at, dtype=torch.uint8)
    for off, shape, dtype in entries:
        n = int(torch.Size(shape).numel())
        t = torch.randn(n, generator=gen) * torch.logspace(-2, 1, n).flip(0)[torch.randperm(n, generator=gen)]
        flat[off : off + 2 * n] = t.to(dtype).view(torch.uint8)
    return flat, entries, at


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(
        st.one_of(
            st.tuples(st.integers(1, 24), st.integers(1, 40)),
            st.tuples(st.integers(1, 8), st.integers(1, 4), st.integers(1, 5)),
            st.tuples(st.integers(1, 60)),
        ),
        min_size=1,
        max_size=4,
    ),
    cuts=st.lists(st.floats(0, 1), max_size=5),
    aligned=st.booleans(),
    seed=st.integers(0, 2**16),
    codec=st.sampled_from(["fp8", "lossless"]),
    seg_blocks=st.sampled_from([1, 2, 256]),
)
def test_each_part_decodes_from_the_bytes_below_its_encoded_end(
    shapes, cuts, aligned, seed, codec, seg_blocks
):
    """Decoding part by part, each from a copy whose bytes past ``encoded_upto`` of its end are
    garbage (not landed yet), gives the bytes of decoding whole: at row boundaries, as .rows and
    .parts cut, and anywhere (a row, or a lossless segment, two parts share is decoded by both)."""
    flat, entries, nbytes = _region(shapes, seed)
    old_seg = _codec.SEG_BLOCKS
    _codec.SEG_BLOCKS = seg_blocks  # (hypothesis runs the examples in one test: not monkeypatch)
    try:
        enc = _codec.encode(codec, flat, entries, nbytes)
    finally:
        _codec.SEG_BLOCKS = old_seg
    if enc is None:
        return  # no matrix, or nothing saved
    _codec.validate(enc)
    whole = torch.zeros(nbytes, dtype=torch.uint8)
    _codec.decode((enc.codec, enc.meta), enc.data, whole)
    # Cuts at row boundaries of the matrices and anywhere in the raw tensors, as .rows and
    # .parts make them.
    bounds = set()
    for c in cuts:
        raw = int(c * nbytes)
        for off, shape, _ in entries:
            if aligned and off <= raw < off + 2 * int(torch.Size(shape).numel()) and len(shape) >= 2:
                row = 2 * int(torch.Size(shape[1:]).numel())
                raw = off + (raw - off) // row * row
        bounds.add(raw)
    ends = sorted(b for b in bounds if 0 < b < nbytes) + [nbytes]
    assert _codec.encoded_upto(enc, nbytes) == enc.nbytes
    out = torch.zeros(nbytes, dtype=torch.uint8)
    lo, last = 0, 0
    for hi in ends:
        upto = _codec.encoded_upto(enc, hi)
        assert last <= upto <= enc.nbytes  # parts land in order
        last = upto
        landed = torch.full((enc.data.numel(),), 0x7F, dtype=torch.uint8)  # (fp8 NaN, bf16 huge)
        landed[:upto] = enc.data[:upto]
        _codec.decode((enc.codec, enc.meta), landed, out, lo, hi)
        assert torch.equal(out[:hi], whole[:hi])  # what the compute below ``hi`` may read now
        lo = hi
    assert torch.equal(out, whole)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48), nn.LayerNorm(48)) for _ in range(3)
        )
        self.head = nn.Linear(48, 200, bias=False)
        self.to(torch.bfloat16).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _offloaded(device: str, compress: str) -> nn.Module:
    return ramtorch.offload(Net(), device=device, compress=compress)


def _outputs(m: nn.Module, device: str, n: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return [m(torch.randn(3, 48, generator=gen).to(device, torch.bfloat16)).cpu() for _ in range(n)]


def test_a_block_of_rows_needs_the_scales_and_its_rows_only():
    flat, entries, nbytes = _region([(64, 48), (48,)], 0)
    enc = _codec.encode("fp8", flat, entries, nbytes)
    assert enc is not None
    (leaf, vec) = enc.meta
    assert leaf.scale < leaf.q  # the scales first
    assert _codec.encoded_upto(enc, 16 * 96) == leaf.q + 16 * 48 < enc.nbytes
    assert _codec.encoded_upto(enc, 16 * 96 + 1) == leaf.q + 17 * 48
    assert _codec.encoded_upto(enc, vec.src + 4) == vec.q + 4
    assert _codec.encoded_upto(enc, 0) == 0


def test_fp8_units_are_computed_by_parts_and_rows_as_decoded_whole(device, monkeypatch):
    ours = _offloaded(device, "fp8")
    st = ours._ramtorch_streamer.stats()
    assert set(st["compressed_units"]) >= {"blocks.0", "blocks.1", "blocks.2", "head"}
    got = _outputs(ours, device)
    s = ramtorch.stats(ours)
    # Each block's first forward in a mode is watched (whole); the later ones are cut.
    assert s["forwards_by_parts"] == 3 * 3 and s["forwards_by_rows"] == 4
    monkeypatch.setattr(parts, "by_parts", lambda *a, **k: None)
    monkeypatch.setattr(rows, "by_rows", lambda *a, **k: None)
    whole = _offloaded(device, "fp8")
    want = _outputs(whole, device)
    assert ramtorch.stats(whole)["forwards_by_parts"] == ramtorch.stats(whole)["forwards_by_rows"] == 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)  # the head's blocks may round apart


def test_fp8_parts_are_bitwise_the_whole_decode(device, monkeypatch):
    monkeypatch.setattr(rows, "by_rows", lambda *a, **k: None)  # (the head whole: bitwise)
    got = _outputs(_offloaded(device, "fp8"), device)
    monkeypatch.setattr(parts, "by_parts", lambda *a, **k: None)
    want = _outputs(_offloaded(device, "fp8"), device)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_copies_of_fp8_units_are_cut_at_encoded_offsets(device):
    from ramtorch._stream import itinerary

    ours = _offloaded(device, "fp8")
    _outputs(ours, device, 1)
    for u in ours._ramtorch_streamer.units:
        enc = u.encoding()
        cuts = itinerary._copy_parts(u)
        raw = itinerary._raw_parts(u)
        assert enc is not None and raw, u.name
        assert cuts == sorted(set(cuts)) and all(0 < c < enc.nbytes for c in cuts)
        assert cuts == sorted({_codec.encoded_upto(enc, r) for r in raw} - {enc.nbytes})


def test_lossless_units_are_cut_and_equal_the_model(device, monkeypatch):
    """Lossless units computed by parts and rows as their segments land: bitwise the model."""
    monkeypatch.setattr(_codec, "SEG_BLOCKS", 1)
    monkeypatch.setattr(_codec, "MAX_RATIO", 1.0)  # (small random weights compress little)
    ref = Net()
    ours = _offloaded(device, "lossless")
    with torch.no_grad():
        x = torch.randn(3, 48).to(torch.bfloat16)
        for _ in range(4):
            assert torch.equal(ours(x.to(device)).cpu(), ref(x))
    s = ramtorch.stats(ours)
    assert s["forwards_by_parts"] > 0
    assert any(parts.plan_of(u) is not None for u in ours._ramtorch_streamer.units)


def test_a_frozen_fp8_base_cut_by_parts_trains_an_adapter_as_decoded_whole(device, monkeypatch):
    """Gradients through cut fp8 units (the backward decodes whole): an adapter on top trains as
    with the units decoded whole."""

    def run() -> list[torch.Tensor]:
        torch.manual_seed(2)
        base = Net()
        adapter = nn.Linear(200, 8).to(torch.bfloat16)
        ramtorch.offload(base, device=device, compress="fp8")
        adapter.to(device)
        opt = torch.optim.SGD(adapter.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(3)
        seen = []
        for _ in range(3):
            x = torch.randn(4, 48, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
            loss = adapter(base(x)).float().square().mean()
            loss.backward()
            seen += [loss.detach().cpu(), x.grad.cpu(), adapter.weight.grad.cpu()]
            opt.step()
            opt.zero_grad()
        assert ramtorch.stats(base)["forwards_by_parts"] > 0 or parts.by_parts is not original
        return seen

    original = parts.by_parts
    monkeypatch.setattr(rows, "by_rows", lambda *a, **k: None)
    got = run()
    monkeypatch.setattr(parts, "by_parts", lambda *a, **k: None)
    want = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


_KERNEL_CHECK = """
import torch
from ramtorch._codec_triton import decode_fp8_rows
gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for scale in (3.0, 1e-30, 1e30, 448.0, 0.0):
        codes = torch.randperm(256 * 9, generator=gen).remainder(256).to(torch.uint8).view(18, 128)
        s = (torch.randn(18, generator=gen) * scale).to(dtype)
        want = codes.view(torch.float8_e4m3fn).to(dtype) * s.unsqueeze(1)
        got = torch.empty(18, 128, dtype=dtype)
        decode_fp8_rows(codes, s, got)
        iv = torch.int32 if dtype == torch.float32 else torch.int16
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), (dtype, scale)
        assert torch.equal(got[~nan].view(iv), want[~nan].view(iv)), (dtype, scale)
print("ok")
"""


def test_the_fp8_kernel_gives_torchs_bits_in_the_interpreter():
    """The device kernel's logic (every code, each weight dtype, scales that overflow and
    underflow), run by Triton's interpreter on CPU tensors, against torch's conversion and
    multiply."""
    pytest.importorskip("triton")
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(ramtorch.__file__)))  # this process's ramtorch
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pkg}
    r = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.gpu
def test_the_fp8_kernel_decodes_torchs_bits_on_cuda(monkeypatch):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        flat, entries, nbytes = _region([(96, 200), (64,), (33, 7, 3)], 5)
        flat = flat.view(torch.bfloat16).to(dtype).view(torch.uint8)  # (offsets scale with the size)
        entries = [(off * dtype.itemsize // 2, shape, dtype) for off, shape, _ in entries]
        enc = _codec.encode("fp8", flat, entries, flat.numel())
        assert enc is not None
        src = enc.data.cuda()
        got = torch.zeros(enc.raw, dtype=torch.uint8, device="cuda")
        _codec.decode((enc.codec, enc.meta), src, got, 0, enc.raw // 3)
        _codec.decode((enc.codec, enc.meta), src, got, enc.raw // 3, enc.raw)
        want = torch.zeros_like(got)
        with monkeypatch.context() as mp:
            mp.setattr(_codec, "_TRITON_FP8", None)  # torch's ops
            _codec.decode((enc.codec, enc.meta), src, want)
        assert torch.equal(got, want), dtype


def test_an_fp8_units_last_linear_goes_by_rows_within_its_parts(device, monkeypatch):
    """W1's block in fp8: its last Linear decodes and computes block by block of rows."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(
            nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 64)),
            nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)),
        )
        return ramtorch.offload(m.to(torch.bfloat16).requires_grad_(False), device=device, compress="fp8")

    def run(m: nn.Module) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            return [m(torch.randn(3, 32, generator=gen).to(device, torch.bfloat16)).cpu() for _ in range(4)]

    cut = build()
    got = run(cut)
    plan = parts.plan_of(cut._ramtorch_streamer.units[-1])
    assert plan is not None and plan.rows
    # Both units are cut here (the fixture's DOMINANCE); the first forward is watched (whole).
    assert ramtorch.stats(cut)["forwards_by_rows"] == 2 * 3
    monkeypatch.setattr(parts, "by_parts", lambda *a, **k: None)
    want = run(build())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("codec", ["fp8", "lossless"])
def test_units_on_disk_decode_by_parts_as_in_memory(tmp_path, codec, monkeypatch):
    """A disk unit's encoded bytes are read into a staging buffer, whose copy is cut at the same
    encoded offsets: the outputs equal the same model's in host memory, and the units are cut."""
    if codec == "lossless":
        monkeypatch.setattr(_codec, "SEG_BLOCKS", 1)
        monkeypatch.setattr(_codec, "MAX_RATIO", 1.0)  # (small random weights compress little)
    ram = _offloaded("cpu", codec)
    disk = ramtorch.offload(Net(), device="cpu", compress=codec, host_budget=0, disk=tmp_path)
    want, got = _outputs(ram, "cpu"), _outputs(disk, "cpu")
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if codec == "lossless":
        for a, b in zip(got, _outputs(Net(), "cpu")):
            assert torch.equal(a, b)  # bit for bit the plain model
    s = ramtorch.stats(disk)
    assert s["forwards_by_parts"] == 3 * 3 and s["forwards_by_rows"] == 4
