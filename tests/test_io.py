"""ramtorch.load / ramtorch.save_pretrained: safetensors checkpoints loaded in place (CPU)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest
import ramtorch
import torch
from conftest import Doubling
from ramtorch import _core
from safetensors.torch import load_file, save_file
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 3, vocab: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.scale


def make(seed: int, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


def test_round_trip(tmp_path):
    src, dst = make(0), make(1)
    files = ramtorch.save_pretrained(src, tmp_path)
    assert files == ["model.safetensors"]
    # tied weight stored once, under its first name
    on_disk = load_file(tmp_path / "model.safetensors")
    assert "emb.weight" in on_disk and "head.weight" not in on_disk
    ptrs = {k: v.data_ptr() for k, v in dst.state_dict(keep_vars=True).items()}
    res = ramtorch.load(dst, tmp_path)
    assert res["missing"] == [] and res["unexpected"] == []
    assert res["bytes"] == sum(v.numel() * v.element_size() for v in on_disk.values())
    assert_same_state(src, dst)
    assert dst.head.weight is dst.emb.weight
    assert ptrs == {k: v.data_ptr() for k, v in dst.state_dict(keep_vars=True).items()}


def test_matches_safetensors_reader(tmp_path):
    torch.manual_seed(3)
    tensors = {"a": torch.randn(7, 5), "b": torch.randn(3).to(torch.bfloat16), "c": torch.arange(6)}
    save_file(tensors, tmp_path / "x.safetensors")
    f = _core.SafetensorsFile(str(tmp_path / "x.safetensors"))
    assert sorted(n for n, _, _ in f.tensors()) == ["a", "b", "c"]
    assert f.metadata() is None
    ref = load_file(tmp_path / "x.safetensors")

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.zeros(7, 5))
            self.b = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
            self.register_buffer("c", torch.zeros(6, dtype=torch.int64))

    m = M()
    ramtorch.load(m, tmp_path / "x.safetensors")
    for k, v in ref.items():
        assert torch.equal(m.state_dict()[k], v), k


def test_sharded_with_index(tmp_path):
    src, dst = make(0), make(1)
    files = ramtorch.save_pretrained(src, tmp_path, max_shard_size=2000)
    assert len(files) > 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert not (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob(".*tmp*"))
    res = ramtorch.load(dst, tmp_path)
    assert res["missing"] == [] and res["unexpected"] == []
    assert_same_state(src, dst)
    # saving again as one file removes the stale shards and index
    ramtorch.save_pretrained(src, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_directory_of_files_without_index(tmp_path):
    src, dst = make(0), make(1)
    sd = {k: v.clone() for k, v in src.state_dict().items() if k != "head.weight"}
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:3]}, tmp_path / "a.safetensors")
    save_file({k: sd[k] for k in keys[3:]}, tmp_path / "b.safetensors")
    ramtorch.load(dst, tmp_path)
    assert_same_state(src, dst)


@pytest.mark.parametrize(
    ("file_dtype", "model_dtype"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float16),
        (torch.float64, torch.float32),
    ],
)
def test_dtype_conversion(tmp_path, file_dtype, model_dtype):
    src = make(0, file_dtype)
    ramtorch.save_pretrained(src, tmp_path)
    dst = make(1, model_dtype)
    ramtorch.load(dst, tmp_path)
    for k, v in src.state_dict().items():
        got = dst.state_dict()[k]
        assert got.dtype == model_dtype
        assert torch.equal(got, v.to(model_dtype)), k


def test_offloaded_model_in_place(tmp_path):
    ref = make(0)
    ramtorch.save_pretrained(ref, tmp_path)
    model = ramtorch.offload(make(1), device="cpu")
    idx = torch.randint(0, 32, (2, 5))
    before = model(idx)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    params = {n: p for n, p in model.named_parameters()}
    ramtorch.load(model, tmp_path)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert all(p is params[n] for n, p in model.named_parameters())
    out = model(idx)
    assert not torch.equal(out, before)
    torch.testing.assert_close(out, ref(idx), rtol=0, atol=0)
    # round trip of the offloaded model (its parameters share one arena region per unit)
    ramtorch.save_pretrained(model, tmp_path / "again")
    fresh = make(2)
    ramtorch.load(fresh, tmp_path / "again")
    assert_same_state(ref, fresh)


def test_strict_key_mismatch(tmp_path):
    src = make(0)
    sd = {k: v.clone() for k, v in src.state_dict().items() if k not in ("head.weight", "blocks.0.fc.bias")}
    sd["extra.weight"] = torch.zeros(2)
    save_file(sd, tmp_path / "m.safetensors")
    dst = make(1)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"missing.*blocks\.0\.fc\.bias.*unexpected.*extra\.weight"):
        ramtorch.load(dst, tmp_path / "m.safetensors")
    for k, v in dst.state_dict().items():  # nothing written
        assert torch.equal(v, before[k])
    res = ramtorch.load(dst, tmp_path / "m.safetensors", strict=False)
    assert res["missing"] == ["blocks.0.fc.bias"] and res["unexpected"] == ["extra.weight"]
    assert torch.equal(dst.blocks[1].fc.weight, src.blocks[1].fc.weight)
    assert torch.equal(dst.blocks[0].fc.bias, before["blocks.0.fc.bias"])


def test_shape_mismatch(tmp_path):
    src = make(0)
    sd = {k: v.clone() for k, v in src.state_dict().items() if k != "head.weight"}
    sd["blocks.1.fc.weight"] = torch.zeros(16, 8)
    save_file(sd, tmp_path / "m.safetensors")
    with pytest.raises(
        RuntimeError, match=r"shape mismatch for 'blocks\.1\.fc\.weight'.*\[16, 8\].*\[16, 16\]"
    ):
        ramtorch.load(make(1), tmp_path / "m.safetensors")


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        ramtorch.load(make(0), tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        _core.SafetensorsFile(str(tmp_path / "nope.safetensors"))


def _raw(header: str | bytes, data: bytes = b"", declared: int | None = None) -> bytes:
    h = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(h) if declared is None else declared) + h + data


def _good(tmp_path) -> bytes:
    save_file({"w": torch.arange(8, dtype=torch.float32)}, tmp_path / "good.safetensors")
    return (tmp_path / "good.safetensors").read_bytes()


HOSTILE = {
    "truncated": lambda good: good[:-3],
    "tiny": lambda good: good[:5],
    "header_longer_than_file": lambda good: struct.pack("<Q", len(good) * 4) + good[8:],
    "header_huge": lambda good: struct.pack("<Q", 1 << 62) + good[8:],
    "offsets_out_of_range": lambda _: _raw(
        '{"w":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}', b"\0" * 16
    ),
    "size_lie": lambda _: _raw('{"w":{"dtype":"F32","shape":[8],"data_offsets":[0,16]}}', b"\0" * 16),
    "overlap": lambda _: _raw(
        '{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"v":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}',
        b"\0" * 24,
    ),
    "huge_shape": lambda _: _raw(
        '{"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,16]}}', b"\0" * 16
    ),
    "garbage": lambda _: _raw(b"\xff\xfe\x00garbage", b"\0" * 8),
    "not_json": lambda _: _raw("{{{{", b""),
}
MESSAGES = {
    "truncated": "run past the data section",
    "tiny": "truncated",
    "header_longer_than_file": "runs past the end of the file",
    "header_huge": "exceeds",
    "offsets_out_of_range": "run past the data section",
    "size_lie": "needs 32 bytes",
    "overlap": "overlap",
    "huge_shape": "more elements than fit",
    "garbage": "UTF-8",
    "not_json": "not a JSON object",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_files(tmp_path, kind):
    path = tmp_path / f"{kind}.safetensors"
    path.write_bytes(HOSTILE[kind](_good(tmp_path)))

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8))

    with pytest.raises(ValueError, match=MESSAGES[kind]) as e:
        ramtorch.load(M(), path)
    assert str(path) in str(e.value)


def test_hostile_files_do_not_crash_the_interpreter(tmp_path):
    good = _good(tmp_path)
    for kind, make_bytes in HOSTILE.items():
        (tmp_path / f"{kind}.safetensors").write_bytes(make_bytes(good))
    code = textwrap.dedent(
        f"""
        import glob, random
        import torch
        from ramtorch import _core
        random.seed(0)
        blobs = [open(p, "rb").read() for p in sorted(glob.glob({str(tmp_path)!r} + "/*.safetensors"))]
        n_ok = 0
        for i in range(300):
            b = bytearray(random.choice(blobs))
            for _ in range(random.randint(1, 4)):
                if b:
                    b[random.randrange(len(b))] = random.randrange(256)
            p = {str(tmp_path)!r} + "/fuzz.safetensors"
            open(p, "wb").write(bytes(b))
            try:
                f = _core.SafetensorsFile(p)
            except ValueError:
                continue
            n_ok += 1
            for name, dtype, shape in f.tensors():
                n = f.nbytes(name)
                f.copy_into(name, torch.empty(n, dtype=torch.uint8), n, dtype)
        print("survived", n_ok)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "survived" in r.stdout


def test_copy_many_fills_every_destination_and_refuses_overlaps(tmp_path):
    """The batched copy puts each tensor where it belongs, converting where asked; destinations
    that overlap are refused before anything is written."""
    a = torch.randn(300, 7)
    b = torch.randn(1 << 19)  # 2 MiB: several pieces
    c = torch.arange(10, dtype=torch.int64)
    path = tmp_path / "m.safetensors"
    save_file({"a": a, "b": b, "c": c}, str(path))
    f = _core.SafetensorsFile(str(path))
    oa = torch.empty(300, 7, dtype=torch.bfloat16)
    ob = torch.empty_like(b)
    oc = torch.empty_like(c)
    f.copy_many(
        [
            ("a", oa, oa.numel() * 2, "BF16"),
            ("b", ob, ob.numel() * 4, "F32"),
            ("c", oc, oc.numel() * 8, "I64"),
        ]
    )
    assert torch.equal(oa, a.to(torch.bfloat16))
    assert torch.equal(ob, b)
    assert torch.equal(oc, c)

    out = torch.full((300 * 7 + 8,), 7.0)
    with pytest.raises(ValueError, match="destinations overlap"):
        f.copy_many([("a", out, 300 * 7 * 4, "F32"), ("c", out[8:], 80, "I64")])
    assert torch.all(out == 7.0)


_SAVE_PEAK = """
import sys, threading
from pathlib import Path
import torch, ramtorch
from torch import nn
from safetensors.torch import load_file

def anon():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
torch.manual_seed(0)
# Weight and bias of a layer share one packed region: safetensors' own writer refuses such views.
m = ramtorch.offload(nn.Sequential(*[nn.Linear(1024, 1024, dtype=torch.bfloat16)
                                     for _ in range(64)]), device="cpu", progress=False)
nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
before = anon()
peak = [before]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], anon()); stop.wait(0.001)
th = threading.Thread(target=sample, daemon=True); th.start()
ramtorch.save_pretrained(m, sys.argv[1], max_shard_size="64MB", progress=False)
stop.set(); th.join()
got = {}
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    got.update(load_file(f))
assert all(torch.equal(got[k], v) for k, v in m.state_dict().items())
print(nbytes, peak[0] - before)
"""


def test_save_pretrained_holds_no_copy_of_a_shard(tmp_path):
    """An offloaded model's parameters are views into packed units: they are written straight
    from there, not copied shard by shard first (the files still read back equal)."""
    r = subprocess.run(
        [sys.executable, "-c", _SAVE_PEAK, str(tmp_path / "out")], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    nbytes, grew = (int(x) for x in r.stdout.split())
    assert nbytes == 64 * (1024 + 1) * 1024 * 2
    assert grew < 0.2 * nbytes, r.stdout


def test_save_pretrained_refuses_unstorable_tensors_before_writing(tmp_path):
    m = nn.Linear(4, 4)
    m.register_buffer("c", torch.zeros(2, device="meta"))
    with pytest.raises(TypeError, match="'c' is on the meta device"):
        ramtorch.save_pretrained(m, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*"))


def test_load_respects_modules_with_their_own_loading(tmp_path):
    """Their tensors go through load_state_dict (as torch would load them); the others are
    written in place."""
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(4, 4), Doubling(4, 4), nn.Sequential(nn.Linear(4, 4)))
    ramtorch.save_pretrained(src, tmp_path)
    dst = ramtorch.offload(
        nn.Sequential(nn.Linear(4, 4), Doubling(4, 4), nn.Sequential(nn.Linear(4, 4))), device="cpu"
    )

    def negate(module, state_dict, prefix, *args):  # noqa: ANN001, ANN002
        state_dict[prefix + "0.weight"] = -state_dict[prefix + "0.weight"]

    dst[2].register_load_state_dict_pre_hook(negate)  # above the layer it changes
    ptrs = [p.data_ptr() for p in dst.parameters()]
    ramtorch.load(dst, tmp_path)
    assert [p.data_ptr() for p in dst.parameters()] == ptrs
    assert torch.equal(dst[0].weight, src[0].weight)
    assert torch.equal(dst[1].weight, src[1].weight * 2)
    assert torch.equal(dst[1].bias, src[1].bias)
    assert torch.equal(dst[2][0].weight, -src[2][0].weight)
    assert torch.equal(dst[2][0].bias, src[2][0].bias)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_reader_never_maps_the_file(tmp_path):
    """The header is read with positioned reads like the tensors: the file is never mapped, so a
    file truncated by another process meanwhile is an error, not a SIGBUS."""
    path = tmp_path / "never-mapped.safetensors"
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, path)
    f = _core.SafetensorsFile(str(path))
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()
    with open(path, "r+b") as fh:  # cut short after opening
        fh.truncate(100)
    out = torch.empty(4096)
    with pytest.raises(ValueError, match="reading the file failed"):
        f.copy_into("w", out, out.numel() * 4, "F32")
    del f
