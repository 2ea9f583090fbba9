"""offload(compress=...): the codecs' round trip (bit-exact for "lossless"), corrupt regions
refused, and offloaded models with compressed units against the same model uncompressed
(forward, LoRA-style training of an adapter on a frozen base, edits torch counts)."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import ramtorch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ramtorch import _codec
from torch import nn


def _roundtrip(raw: torch.Tensor) -> tuple[_codec.Encoded, torch.Tensor]:
    enc = _codec.encode_lossless(raw, raw.numel())
    assert enc is not None
    _codec.validate(enc)
    out = torch.empty_like(raw)
    _codec._decode_lossless_torch(enc.data, enc.meta, out)
    return enc, out


def test_every_16_bit_word_round_trips():
    words = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    raw = words.view(torch.uint8).clone()
    _, out = _roundtrip(raw)
    assert torch.equal(out, raw)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3 * _codec.BLOCK + 17),
    scale=st.sampled_from([1e-30, 1e-3, 0.02, 1.0, 1e4]),
    special=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_weights_round_trip_bit_exact(n: int, scale: float, special: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * scale).to(torch.bfloat16)
    if special:
        k = torch.randint(0, n, (max(1, n // 10),), generator=g)
        w[k] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40])[k % 6].to(w.dtype)
    raw = w.view(torch.uint8).clone()
    _, out = _roundtrip(raw)
    assert torch.equal(out, raw)


def test_trained_like_weights_take_about_seven_tenths():
    w = (torch.randn(1 << 20) * 0.02).to(torch.bfloat16)
    enc, _ = _roundtrip(w.view(torch.uint8).clone())
    assert 0.6 < enc.ratio < 0.75


def test_odd_or_empty_regions_are_not_encoded():
    assert _codec.encode_lossless(torch.zeros(7, dtype=torch.uint8), 7) is None
    assert _codec.encode_lossless(torch.zeros(8, dtype=torch.uint8), 0) is None


def test_a_region_that_does_not_compress_streams_raw():
    noise = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)  # incompressible bytes
    assert _codec.encode("lossless", noise, [], noise.numel()) is None


def _corrupt(enc: _codec.Encoded, what: str) -> _codec.Encoded:
    lay = enc.meta
    data = enc.data.clone()
    first, words, base, o_codes, o_top, o_esc = lay.seg(0)
    if what == "escape count":
        return dataclasses.replace(enc, meta=dataclasses.replace(lay, m=lay.m + 1))
    if what == "start":
        data[: lay.o_seg].view(torch.int32)[1] += 1
    elif what == "code":
        # An escape code turned into an ordinary one: counts no longer match.
        esc = (_codec._seg_codes(data, o_codes, words) == 7).nonzero()[0, 0]
        g = o_codes + int(esc) // 8 * 3
        v = int(data[g]) | int(data[g + 1]) << 8 | int(data[g + 2]) << 16
        v &= ~(7 << (3 * (int(esc) % 8)))
        data[g : g + 3] = torch.tensor([v & 255, v >> 8 & 255, v >> 16 & 255], dtype=torch.uint8)
    elif what == "short":
        data = data[: enc.nbytes - 1]
    elif what == "top":
        data[o_top] = 0  # block 0's codes now point below exponent 0
    elif what == "segment end":
        ends = list(lay.ends)
        ends[0] += 1
        return dataclasses.replace(enc, meta=dataclasses.replace(lay, ends=tuple(ends)))
    return dataclasses.replace(enc, data=data)


@pytest.mark.parametrize("what", ["escape count", "start", "code", "short", "top", "segment end"])
def test_corrupt_lossless_regions_are_refused(what: str, monkeypatch):
    monkeypatch.setattr(_codec, "SEG_BLOCKS", 2)  # (two segments)
    w = (torch.randn(3 * _codec.BLOCK) * 0.02).to(torch.bfloat16)
    w[::97] = 1e-30  # escapes in every block
    enc = _codec.encode_lossless(w.view(torch.uint8).clone(), w.numel() * 2)
    assert enc is not None and enc.meta.m > 0
    with pytest.raises(ValueError, match="lossless region"):
        _codec.validate(_corrupt(enc, what))


def test_corrupt_escape_count_is_refused_by_the_decoder_too():
    w = (torch.randn(_codec.BLOCK) * 0.02).to(torch.bfloat16)
    w[::50] = 1e-30
    enc = _codec.encode_lossless(w.view(torch.uint8).clone(), w.numel() * 2)
    assert enc is not None
    bad = _corrupt(enc, "escape count")
    with pytest.raises(ValueError, match="escape"):
        _codec._decode_lossless_torch(bad.data, bad.meta, torch.empty(w.numel() * 2, dtype=torch.uint8))


def test_fp8_keeps_rows_close_and_leaves_vectors_raw():
    torch.manual_seed(0)
    m = torch.randn(64, 48).to(torch.bfloat16) * torch.logspace(-3, 1, 64).unsqueeze(1).to(torch.bfloat16)
    v = torch.randn(48).to(torch.bfloat16)
    flat = torch.zeros(64 * 48 * 2 + 128, dtype=torch.uint8)
    flat[: m.numel() * 2] = m.view(-1).view(torch.uint8)
    off = -(-m.numel() * 2 // 64) * 64
    flat[off : off + 96] = v.view(torch.uint8)
    entries = [(0, (64, 48), torch.bfloat16), (off, (48,), torch.bfloat16)]
    enc = _codec.encode("fp8", flat, entries, off + 96)
    assert enc is not None and enc.ratio < 0.6
    _codec.validate(enc)
    out = torch.zeros(off + 96, dtype=torch.uint8)
    _codec.decode((enc.codec, enc.meta), enc.data, out)
    got = out[: m.numel() * 2].view(torch.bfloat16).view(64, 48).float()
    rel = (got - m.float()).norm(dim=1) / m.float().norm(dim=1)
    assert float(rel.max()) < 0.06  # e4m3 keeps 3 mantissa bits: a few percent per row
    assert torch.equal(out[off : off + 96], flat[off : off + 96])


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32), nn.LayerNorm(32)) for _ in range(4)
        )
        self.head = nn.Linear(32, 7)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _pair(compress: str, dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(3)
    ref = Net(dtype).requires_grad_(False)
    ours = ramtorch.offload(copy.deepcopy(ref), device="cpu", compress=compress)
    return ref, ours


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lossless_offload_equals_the_model_bit_for_bit(dtype: torch.dtype):
    ref, ours = _pair("lossless", dtype)
    x = torch.randint(0, 50, (3, 11))
    for _ in range(3):
        assert torch.equal(ours(x), ref(x))
    st = ours._ramtorch_streamer.stats()
    if dtype == torch.bfloat16:
        assert set(st["compressed_units"]) >= {f"blocks.{k}" for k in range(4)}
        assert st["link_bytes_per_pass"] < 0.8 * st["streamed_bytes_per_pass"]
    assert st["decoded_bytes"] > 0 or not st["compressed_units"]


def test_fp8_offload_is_close_and_moves_half_the_bytes():
    ref, ours = _pair("fp8")
    x = torch.randint(0, 50, (3, 11))
    want, got = ref(x).float(), ours(x).float()
    assert torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), 0) > 0.99
    st = ours._ramtorch_streamer.stats()
    assert st["link_bytes_per_pass"] < 0.62 * st["streamed_bytes_per_pass"]


def test_edits_torch_counts_are_encoded_again():
    ref, ours = _pair("lossless")
    x = torch.randint(0, 50, (2, 5))
    ours(x)
    with torch.no_grad():
        for m in (ref, ours):
            m.blocks[1][0].weight.mul_(-3)  # a version counter moves
        sd = {k: v.clone() * 0.5 for k, v in ref.state_dict().items() if k.startswith("blocks.2.")}
        ref.load_state_dict(sd, strict=False)
        ours.load_state_dict(sd, strict=False)
    assert torch.equal(ours(x), ref(x))
    new = torch.randn(32, 96).to(torch.bfloat16)
    ours.blocks[3][2].weight = nn.Parameter(new.clone(), requires_grad=False)  # a parameter set anew
    ref.blocks[3][2].weight = nn.Parameter(new.clone(), requires_grad=False)
    assert torch.equal(ours(x), ref(x))


def test_a_frozen_compressed_base_trains_an_adapter_like_the_model():
    """LoRA's case: the base is frozen (streamed encoded), an adapter beside it trains; gradients
    and three optimizer steps equal the uncompressed model's."""
    torch.manual_seed(5)

    class Adapted(Net):
        def __init__(self) -> None:
            super().__init__()  # bf16 (an fp32 region's low halves do not compress)
            self.requires_grad_(False)
            self.lora = nn.Parameter(torch.zeros(32, 32, dtype=torch.bfloat16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for b in self.blocks:
                h = h + b(h) + h @ self.lora
            return self.head(h)

    ref = Adapted()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu", compress="lossless")
    assert ours._ramtorch_streamer.stats()["compressed_units"]
    opts = [torch.optim.AdamW([m.lora], lr=1e-2) for m in (ref, ours)]
    for step in range(3):
        x = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(step))
        for m, opt in zip((ref, ours), opts):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        assert torch.equal(ours.lora.grad, ref.lora.grad)
        assert torch.equal(ours.lora, ref.lora)


def test_units_that_train_stream_raw_until_frozen():
    torch.manual_seed(2)
    ref = Net()
    ours = ramtorch.offload(copy.deepcopy(ref), device="cpu", compress="lossless")
    assert ours._ramtorch_streamer.stats()["compressed_units"] == {}
    x = torch.randint(0, 50, (2, 5))
    ours(x).sum().backward()
    ref(x).sum().backward()
    assert torch.equal(ours.blocks[0][0].weight.grad, ref.blocks[0][0].weight.grad)
    ours.requires_grad_(False)
    ref.requires_grad_(False)
    assert torch.equal(ours(x), ref(x))
    assert ours._ramtorch_streamer.stats()["compressed_units"]


def test_compressed_units_beside_resident_ones_under_a_budget():
    torch.manual_seed(6)
    ref = Net().requires_grad_(False)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    ours = ramtorch.offload(copy.deepcopy(ref), gpu_budget=total * 3 // 4, device="cpu", compress="lossless")
    st = ours._ramtorch_streamer.stats()
    assert st["resident_units"] and st["compressed_units"]
    x = torch.randint(0, 50, (2, 6))
    assert torch.equal(ours(x), ref(x))


def test_unknown_codec_is_a_clear_error():
    with pytest.raises(ValueError, match="compress='zstd'"):
        ramtorch.offload(Net(), device="cpu", compress="zstd")


def test_triton_kernel_matches_the_torch_decoder_in_the_interpreter():
    """The device kernel's logic, run by Triton's interpreter on CPU tensors."""
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from ramtorch import _codec\n"
        "from ramtorch._codec_triton import decode_lossless\n"
        "torch.manual_seed(0)\n"
        "w = (torch.randn(2 * _codec.BLOCK + 77) * 0.02).to(torch.bfloat16)\n"
        "w[::31] = 1e-30\n"
        "w[5] = float('nan')\n"
        "raw = w.view(torch.uint8).clone()\n"
        "for seg in (256, 1):\n"
        "    _codec.SEG_BLOCKS = seg\n"
        "    enc = _codec.encode_lossless(raw, raw.numel())\n"
        "    out = torch.zeros_like(raw)\n"
        "    decode_lossless(enc.data, enc.meta, out, _codec.BLOCK)\n"
        "    assert torch.equal(out, raw), 'interpreted kernel differs'\n"
        "    # By parts, each from the bytes below its encoded end (garbage past it).\n"
        "    out = torch.zeros_like(raw)\n"
        "    lo = 0\n"
        "    for hi in (3000, 4096, 9000, raw.numel()):\n"
        "        landed = torch.full_like(enc.data, 0x7F)\n"
        "        upto = _codec.encoded_upto(enc, hi)\n"
        "        landed[:upto] = enc.data[:upto]\n"
        "        decode_lossless(landed, enc.meta, out, _codec.BLOCK, lo, hi)\n"
        "        assert torch.equal(out[:hi], raw[:hi]), ('part', seg, hi)\n"
        "        lo = hi\n"
        "    # A corrupt table of escape starts decodes to wrong words, never outside the region.\n"
        "    bad = enc.data.clone()\n"
        "    bad[: enc.meta.o_seg].view(torch.int32).fill_(2**30)\n"
        "    decode_lossless(bad, enc.meta, torch.zeros_like(raw), _codec.BLOCK)\n"
        "print('ok')\n"
    )
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(ramtorch.__file__)))  # this process's ramtorch
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pkg}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("compress", ["lossless", "fp8"])
def test_compressed_offload_on_cuda(compress: str):
    """On the GPU: the Triton decoder gives the raw bytes back exactly (lossless: the offloaded
    model equals the resident one bit for bit), fp8 stays close; under a budget too."""
    torch.manual_seed(4)
    ref = Net().requires_grad_(False).cuda()
    x = torch.randint(0, 50, (3, 64), device="cuda")
    want = ref(x)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    for budget in (None, total * 3 // 4):
        ours = copy.deepcopy(ref).cpu()
        ramtorch.offload(ours, gpu_budget=budget, compress=compress)
        for _ in range(2):
            got = ours(x).float().flatten()
            if compress == "lossless":
                assert torch.equal(got, want.float().flatten())
            else:
                assert torch.nn.functional.cosine_similarity(got, want.float().flatten(), 0) > 0.99
        st = ours._ramtorch_streamer.stats()
        assert st["decoded_bytes"] > 0 and st["compressed_units"]
        assert (budget is None) == (not st["resident_units"])
        del ours


@pytest.mark.gpu
def test_triton_decoder_is_bit_exact_on_cuda():
    torch.manual_seed(1)
    for n in (1, 9, _codec.BLOCK, 5 * _codec.BLOCK + 3):
        w = (torch.randn(n) * 0.02).to(torch.bfloat16)
        w[:: max(1, n // 7)] = 1e-30
        raw = w.view(torch.uint8).clone()
        enc = _codec.encode_lossless(raw, raw.numel())
        out = torch.zeros(raw.numel(), dtype=torch.uint8, device="cuda")
        _codec.decode((enc.codec, enc.meta), enc.data[: enc.nbytes].cuda(), out)
        assert torch.equal(out.cpu(), raw)
