"""Mapped host memory against copies: torch kernels reading page-locked host memory in place (mapped
into the GPU's address space: no copy) against the same kernels after a copy of the operand into a
device slot, for the shapes where reading in place might win; writes one JSON list (BENCH.md
records, workload ``mapped:<kind>``, ``"transfer"``: ``mapped``/``copy``) and prints a table.

    python3 bench/mapped.py --out $OUT/mapped.json [--reps 20] [--warmup 3] [--layers 8]
        [--kinds matmul head embedding norm small attention] [--batch 1 2 4 8] [--head-batch 1 8]
        [--rows 1 8 512 4096] [--small-mib 1 4 16] [--context 4096 32768] [--hidden 4096]
        [--ffn 14336] [--kv-dim 1024] [--vocab 128256] [--heads 32] [--kv-heads 8] [--head-dim 128]
        [--commit abc1234]
    python3 bench/mapped.py --smoke --out /tmp/mapped.json   # CPU: tiny ops, then fake timings

Shapes (bf16; defaults: one Llama-3-8B layer): ``matmul``: ``x[B, k] @ W^T`` for W (n x k) in
ffn x hidden, hidden x ffn, hidden x hidden, kv_dim x hidden at each ``--batch``; ``head``: the LM
head vocab x hidden at ``--head-batch``; ``embedding``: ``F.embedding`` of ``--rows`` distinct ids
into a vocab x hidden table; ``norm``: ``F.rms_norm`` of ``x[1, hidden]`` by a host weight;
``small``: a ``--small-mib`` MiB weight (n x hidden) at B=1; ``attention``: one decode query
(``--heads`` heads) against a host cache of ``--context`` tokens (K and V ``[1, kv_heads, N,
head_dim]``), as ``scaled_dot_product_attention`` over the queries grouped by their KV head
(``q[1, kv_heads, heads/kv_heads, head_dim]``: GQA with nothing expanded, every cached token seen).

Paths. ``mapped``: the host operands live in one pinned pool (``torch.empty(pin_memory=True)``:
cudaHostAlloc, mapped on UVA systems); its device address comes from the driver
(``cuMemHostGetDevicePointer``) and each operand is wrapped as a CUDA tensor through
``__cuda_array_interface__`` (bf16 as int16, then ``.view``), checked to alias it (same
``data_ptr``), so the kernel reads host memory over the link. ``copy``: the operand is copied
(``non_blocking``) into a preallocated device slot and the same kernel reads the slot. Before timing,
each shape's mapped result must equal the copy path's bitwise (same kernel, same shapes), else it
gets an ``"error"`` record, no timings, and the run exits 1 after the other shapes. The embedding
has two copy paths: ``"copy": "table"`` (the whole table crosses) and ``"copy": "gather"``
(``index_select`` of the rows on the host into pinned staging, then a copy of the rows: what
``offload(gather_rows=True)`` does), with the ids ready on the host and the device.

Modes. ``latency``: one op alone (copy then compute, or the mapped compute), between CUDA events,
after an L2 flush and a synchronize. ``streamed``: a chain of ``--layers`` ops over as many distinct
host operands; the copy path copies on a side stream into two slots, double-buffered against the
compute on the current stream with events (as the engine does); the mapped path runs the ops back to
back; ``seconds`` is per op. The LM head and the embedding are one per model: latency only.
``batch``: rows of ``x`` (the embedding: ids). ``seconds``: median of ``--reps`` after ``--warmup``.
``bytes``: operand bytes that must cross (the embedding: the rows read); ``copied_bytes``: what the
copy path moves; ``h2d_gbps``: pinned H2D measured in this run (``arch.ceilings``);
``limit_seconds`` = bytes / H2D; ``ratio`` = limit / seconds. The table gives both paths and
``speedup`` = copy seconds (the best copy path) / mapped seconds; ``pick`` is ``mapped`` from 1.10.

The last record (``mapped:probe``) says whether memory page-locked the way ramtorch's arena does it
(``cuMemHostRegister`` with ``CU_MEMHOSTREGISTER_PORTABLE`` only) has a device address and reads
correctly from a kernel, against ``PORTABLE | DEVICEMAP``, with the device's mapping attributes; and
the same for a buffer of ramtorch's arena itself where ``ramtorch`` imports (the staged wheel).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from arch import ceilings, command_line
from benchlib import git_commit

DT = torch.bfloat16
ALIGN = 4096
WIN = 1.10  # mapped is picked from this speedup on
KINDS = ("matmul", "head", "embedding", "norm", "small", "attention")
Op = Callable[[list[torch.Tensor]], torch.Tensor]
Gather = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Case:
    """One shape: the bf16 host operands one op reads, the bytes that must cross, whether it runs
    as a chain of ``--layers`` ops too."""

    kind: str
    shape: str
    batch: int
    operands: list[tuple[int, ...]]
    bytes: int
    streamed: bool = True

    @property
    def set_bytes(self) -> int:
        """Bytes of one set of operands as laid out by ``layout`` (each 4 KiB aligned)."""
        return sum(_aligned(torch.Size(s).numel() * 2) for s in self.operands)


def cases(a: argparse.Namespace) -> list[Case]:
    h, out = a.hidden, []
    if "matmul" in a.kinds:
        for n, k in ((a.ffn, h), (h, a.ffn), (h, h), (a.kv_dim, h)):
            out += [Case("matmul", f"{n}x{k}", b, [(n, k)], n * k * 2) for b in a.batch]
    if "head" in a.kinds:
        v = a.vocab
        out += [Case("head", f"{v}x{h}", b, [(v, h)], v * h * 2, False) for b in a.head_batch]
    if "embedding" in a.kinds:
        out += [Case("embedding", f"{a.vocab}x{h}", r, [(a.vocab, h)], r * h * 2, False) for r in a.rows]
    if "norm" in a.kinds:
        out.append(Case("norm", f"{h}", 1, [(h,)], h * 2))
    if "small" in a.kinds:
        for mib in a.small_mib:
            n = mib * 2**20 // (2 * h)
            out.append(Case("small", f"{n}x{h}", 1, [(n, h)], n * h * 2))
    if "attention" in a.kinds:
        for n in a.context:
            s = (1, a.kv_heads, n, a.head_dim)
            shape = f"ctx={n} kv={a.kv_heads}x{a.head_dim} q={a.heads}"
            out.append(Case("attention", shape, 1, [s, s], 2 * a.kv_heads * n * a.head_dim * 2))
    return out


def op_for(c: Case, a: argparse.Namespace, dev: str) -> tuple[Op, Gather | None]:
    """The op of ``c`` on its operands (device tensors: mapped or slot views), inputs made on ``dev``;
    for the embedding also the host gather (host operands, pinned staging, device rows)."""
    torch.manual_seed(0)
    if c.kind == "embedding":
        ids_host = torch.randperm(a.vocab)[: c.batch]  # distinct: ``bytes`` is exact
        ids = ids_host.to(dev)

        def gather(host: list[torch.Tensor], staging: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            torch.index_select(host[0], 0, ids_host, out=staging)
            return rows.copy_(staging, non_blocking=True)

        return lambda ops: F.embedding(ids, ops[0]), gather
    if c.kind == "attention":
        q = torch.randn(1, a.kv_heads, a.heads // a.kv_heads, a.head_dim, dtype=DT, device=dev)
        return lambda ops: F.scaled_dot_product_attention(q, ops[0], ops[1]), None
    x = torch.randn(c.batch, c.operands[0][-1], dtype=DT, device=dev)  # the down projection: x[B, ffn]
    if c.kind == "norm":
        return lambda ops: F.rms_norm(x, (a.hidden,), ops[0], 1e-5), None
    return lambda ops: F.linear(x, ops[0]), None


def layout(buf: torch.Tensor, c: Case, n: int) -> list[list[torch.Tensor]]:
    """``n`` sets of ``c``'s operands as bf16 views of the uint8 buffer ``buf``, each 4 KiB aligned."""
    sets, off = [], 0
    for _ in range(n):
        s = []
        for shape in c.operands:
            nb = torch.Size(shape).numel() * 2
            s.append(buf[off : off + nb].view(DT).view(shape))
            off += _aligned(nb)
        sets.append(s)
    return sets


class Driver:
    """The CUDA driver calls the mapping needs (libcuda through ctypes), on torch's context."""

    def __init__(self) -> None:
        torch.zeros(1, device="cuda")  # the runtime makes the primary context current
        self.lib = ctypes.CDLL("libcuda.so.1")
        ctx, dev = ctypes.c_void_p(), ctypes.c_int()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:  # not made current on this thread: torch's device's primary context
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.check(self.lib.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
        self.dev = dev.value

    @staticmethod
    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def attr(self, n: int) -> int:
        v = ctypes.c_int()
        self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(v), n, self.dev), "cuDeviceGetAttribute")
        return v.value

    def device_pointer(self, host: int) -> tuple[int, int]:
        """(CUresult, device address) of mapped host memory at ``host``."""
        d = ctypes.c_uint64()
        rc = self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(d), ctypes.c_void_p(host), 0)
        return rc, d.value


class _HostView:
    """``t``'s memory at device address ``dptr``, for ``torch.as_tensor`` (int16: bf16 has no typestr)."""

    def __init__(self, t: torch.Tensor, dptr: int) -> None:
        assert t.is_contiguous() and t.element_size() == 2
        self.keep = t  # the host memory lives as long as the CUDA tensor (torch holds this object)
        iface = dict(shape=tuple(t.shape), typestr="<i2", data=(dptr, False), strides=None, version=2)
        self.__cuda_array_interface__ = iface


def mapped(t: torch.Tensor, dptr: int) -> torch.Tensor:
    """A CUDA tensor aliasing the page-locked host tensor ``t`` at device address ``dptr``."""
    d = torch.as_tensor(_HostView(t, dptr), device="cuda").view(t.dtype)
    if d.data_ptr() != dptr:
        raise RuntimeError(f"torch copied the mapped operand ({d.data_ptr():#x} != {dptr:#x})")
    return d


# CU_DEVICE_ATTRIBUTE_*: CAN_MAP_HOST_MEMORY, UNIFIED_ADDRESSING, PAGEABLE_MEMORY_ACCESS,
# CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES
ATTRS = {
    "can_map_host_memory": 19,
    "unified_addressing": 41,
    "pageable_memory_access": 88,
    "can_use_host_pointer_for_registered_mem": 91,
    "pageable_memory_access_uses_host_page_tables": 100,
}


def _read_check(drv: Driver, host: torch.Tensor) -> dict:
    """cuMemHostGetDevicePointer's CUresult for the int16 ``host`` filled with a pattern, whether
    the device address is the host one, and (only where the driver gave an address) whether a
    kernel reads the pattern through it."""
    host.copy_(torch.arange(host.numel(), dtype=torch.int32).remainder(30011).to(torch.int16))
    rc, dptr = drv.device_pointer(host.data_ptr())
    res = {"device_pointer_rc": rc, "same_pointer": dptr == host.data_ptr()}
    if rc == 0:
        res["kernel_read_ok"] = torch.equal(mapped(host, dptr).clone().cpu(), host)
    return res


def arena_probe(drv: Driver, size: int = 16 << 20) -> dict:
    """Anonymous pageable memory registered as the arena pins it (cuMemHostRegister with PORTABLE =
    1, crates/ramtorch-core/src/cuda.rs) and with PORTABLE | DEVICEMAP (3), then ``_read_check``;
    and a buffer of ramtorch's own arena where the package imports."""
    out: dict = {name: drv.attr(n) for name, n in ATTRS.items()}
    for name, flags in (("portable", 1), ("portable_devicemap", 3)):
        m = mmap.mmap(-1, size)
        host = torch.frombuffer(m, dtype=torch.int16)
        addr = host.data_ptr()
        res = {
            "register_rc": drv.lib.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(size), flags)
        }
        if res["register_rc"] == 0:
            res.update(_read_check(drv, host))
            res["unregister_rc"] = drv.lib.cuMemHostUnregister(ctypes.c_void_p(addr))
        out[name] = res
        del host  # m is unmapped when the last tensor over it goes
    try:
        from ramtorch._arena import host_bytes

        out["ramtorch_arena"] = _read_check(drv, host_bytes(size).view(torch.int16))
    except Exception as e:  # no wheel here, or no arena: said in the record
        out["ramtorch_arena"] = f"not probed: {e!r}"
    return out


def timed(fn: Callable[[], object], reps: int, warmup: int, flush: Callable[[], object]) -> float:
    """Median seconds of ``fn`` between CUDA events on the current stream, each call after an L2
    flush and a synchronize (so host work inside ``fn`` is inside the window too)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        flush()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def copy_chain(
    host: list[list[torch.Tensor]], slots: list[list[torch.Tensor]], op: Op, side: torch.cuda.Stream
) -> None:
    """The engine's pattern: copies on ``side`` into two slots, each op on the current stream after
    its copy's event, each copy after the op that last read its slot."""
    main = torch.cuda.current_stream()
    copied = [torch.cuda.Event() for _ in slots]
    used = [torch.cuda.Event() for _ in slots]
    side.wait_stream(main)
    for i, src in enumerate(host):
        b = i % len(slots)
        with torch.cuda.stream(side):
            if i >= len(slots):
                side.wait_event(used[b])
            for d, s in zip(slots[b], src):
                d.copy_(s, non_blocking=True)
            copied[b].record(side)
        main.wait_event(copied[b])
        op(slots[b])
        used[b].record(main)


class Mismatch(Exception):
    """A mapped (or gathered) result that is not bitwise the copy path's."""


def measure(c: Case, a: argparse.Namespace, pool: torch.Tensor, base: int, env: dict) -> list[tuple]:
    """(transfer, mode, copy path, seconds, copied bytes) of ``c``'s paths, after the equality check."""
    n = a.layers if c.streamed else 1
    host = layout(pool, c, n)
    for w in (w for s in host for w in s):
        w.copy_(torch.randn(w.shape, dtype=DT, device="cuda"))  # filled on the GPU: fast
    maps = [[mapped(w, base + w.data_ptr() - pool.data_ptr()) for w in s] for s in host]
    bufs = [torch.empty(c.set_bytes, dtype=torch.uint8, device="cuda") for _ in range(1 + c.streamed)]
    slots = [layout(b, c, 1)[0] for b in bufs]
    op, gather = op_for(c, a, "cuda")

    def copy_op() -> torch.Tensor:
        for d, s in zip(slots[0], host[0]):
            d.copy_(s, non_blocking=True)
        return op(slots[0])

    def same(want: torch.Tensor, got: torch.Tensor, what: str) -> None:
        if not torch.equal(want, got):
            diff = (want.float() - got.float()).abs().max().item()
            raise Mismatch(f"{what} differs from the copy path's (max abs difference {diff})")

    same(copy_op(), op(maps[0]), "the mapped result")

    def t(fn: Callable[[], object]) -> float:
        return timed(fn, a.reps, a.warmup, env["flush"])

    table_copy = "table" if c.kind == "embedding" else None
    out = [
        ("copy", "latency", table_copy, t(copy_op), c.set_bytes),
        ("mapped", "latency", None, t(lambda: op(maps[0])), 0),
    ]
    if gather is not None:
        staging = torch.empty(c.batch, a.hidden, dtype=DT, pin_memory=True)
        rows = torch.empty(c.batch, a.hidden, dtype=DT, device="cuda")
        same(copy_op(), gather(host[0], staging, rows), "the host gather")
        out.append(("copy", "latency", "gather", t(lambda: gather(host[0], staging, rows)), c.bytes))
    if c.streamed:
        chain = t(lambda: copy_chain(host, slots, op, env["side"]))
        out.append(("copy", "streamed", None, chain / n, c.set_bytes))
        out.append(("mapped", "streamed", None, t(lambda: [op(s) for s in maps]) / n, 0))
    return out


def record(c: Case, path: tuple, meta: dict, layers: int) -> dict:
    transfer, mode, copy, seconds, copied = path
    limit = c.bytes / (meta["h2d_gbps"] * 1e9)
    r = {"workload": f"mapped:{c.kind}", "shape": c.shape, "batch": c.batch, "transfer": transfer}
    r.update(mode=mode, seconds=seconds, bytes=c.bytes, limit_seconds=limit, ratio=limit / seconds)
    if transfer == "copy":
        r.update(copied_bytes=copied, **({"copy": copy} if copy else {}))
    if mode == "streamed":
        r["layers"] = layers
    return {**r, **meta}


def table(records: list[dict]) -> str:
    """Shapes x both paths x ratio to the link limit, and mapped's speedup over the best copy path."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in records:
        if "transfer" in r:
            key = (r["workload"].split(":")[1], r["shape"], r["batch"], r["mode"])
            groups.setdefault(key, {}).setdefault(r["transfer"], []).append(r)
    head = "kind | shape | B | mode | MiB | copy us | copy ratio | mapped us | mapped ratio | speedup | pick"
    lines = [f"| {head} |", "|" + " --- |" * 11]
    for (kind, shape, b, mode), g in groups.items():
        if not g.get("copy") or not g.get("mapped"):
            continue
        cp, mp = min(g["copy"], key=lambda r: r["seconds"]), g["mapped"][0]
        speed, how = cp["seconds"] / mp["seconds"], f" ({cp['copy']})" if "copy" in cp else ""
        lines.append(
            f"| {kind} | {shape} | {b} | {mode} | {mp['bytes'] / 2**20:.3g} | {cp['seconds'] * 1e6:.1f}{how}"
            f" | {cp['ratio']:.2f} | {mp['seconds'] * 1e6:.1f} | {mp['ratio']:.2f} | {speed:.2f}"
            f" | {'mapped' if speed >= WIN else 'copy'} |"
        )
    return "\n".join(lines)


def smoke(a: argparse.Namespace, meta: dict) -> list[dict]:
    """The ops and layouts on tiny shapes on the CPU (copy path, host gather checked against the
    embedding), then the records of the real shapes on fake timings."""
    tiny = argparse.Namespace(**{**vars(a), "hidden": 64, "ffn": 96, "kv_dim": 16, "vocab": 5000})
    tiny.context, tiny.heads, tiny.kv_heads, tiny.head_dim, tiny.small_mib = [64], 4, 2, 16, [1]
    for c in cases(tiny):
        sets = layout(torch.zeros(2 * c.set_bytes, dtype=torch.uint8), c, 2)
        for t in (t for s in sets for t in s):
            t.copy_(torch.randn(t.shape, dtype=DT))
        op, gather = op_for(c, tiny, "cpu")
        want = op(sets[1])
        if gather is not None:
            rows = torch.empty(c.batch, tiny.hidden, dtype=DT)
            assert torch.equal(gather(sets[1], torch.empty_like(rows), rows), want), c
    records, fake = [], {"copy": (1.2, 8e-6, 1.05), "mapped": (1.05, 0.0, 1.1)}  # latency *, +; streamed *
    for c in cases(a):
        floor = c.bytes / (meta["h2d_gbps"] * 1e9)
        for tr, (lat, add, st) in fake.items():
            copied = c.set_bytes if tr == "copy" else 0
            how = "table" if c.kind == "embedding" and tr == "copy" else None
            records.append(record(c, (tr, "latency", how, lat * floor + add, copied), meta, a.layers))
            if c.streamed:
                records.append(record(c, (tr, "streamed", None, st * floor, copied), meta, a.layers))
    return records


def run(a: argparse.Namespace, meta: dict) -> list[dict]:
    """Every case's records (the file rewritten after each case), then the probe record."""
    drv, cs = Driver(), cases(a)
    need = max(c.set_bytes * (a.layers if c.streamed else 1) for c in cs)
    pool = torch.empty(need, dtype=torch.uint8, pin_memory=True)
    rc, base = drv.device_pointer(pool.data_ptr())
    drv.check(rc, "cuMemHostGetDevicePointer on torch's pinned memory")
    l2 = torch.cuda.get_device_properties().L2_cache_size
    scratch = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
    env = {"flush": scratch.zero_, "side": torch.cuda.Stream()}
    records: list[dict] = []
    for c in cs:
        try:
            got = [record(c, p, meta, a.layers) for p in measure(c, a, pool, base, env)]
        except Mismatch as e:  # loud, and the other shapes still run
            print(f"FAIL {c.kind} {c.shape} B={c.batch}: {e}", file=sys.stderr, flush=True)
            got = [
                {"workload": f"mapped:{c.kind}", "shape": c.shape, "batch": c.batch, "error": str(e), **meta}
            ]
        records += got
        done = ", ".join(
            f"{r['transfer']}/{r['mode']}/{r.get('copy', '')} {r['seconds'] * 1e6:.1f}"
            for r in got
            if "error" not in r
        )
        print(f"# {c.kind} {c.shape} B={c.batch} (us): {done}", file=sys.stderr, flush=True)
        save(a, records)
    # last: a kernel reading memory the driver mapped wrongly would end the process
    probe = {"workload": "mapped:probe", "pinned_same_pointer": base == pool.data_ptr(), **arena_probe(drv)}
    print(f"# {json.dumps(probe)}", file=sys.stderr, flush=True)
    return [*records, {**probe, **meta}]


def save(a: argparse.Namespace, records: list[dict]) -> None:
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(records, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON list of the records")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8, help="ops (distinct host operands) of a streamed chain")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8], help="matmul rows")
    ap.add_argument("--head-batch", type=int, nargs="+", default=[1, 8], help="LM head rows")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512, 4096], help="embedding ids (B*T)")
    ap.add_argument("--small-mib", type=int, nargs="+", default=[1, 4, 16], help="small weights, MiB")
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768], help="cached tokens")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--kv-dim", type=int, default=1024, help="rows of the K or V projection")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--commit", default=None, help="default: git rev-parse --short HEAD, else unknown")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny ops, records and table on fake timings")
    a = ap.parse_args()
    if a.heads % a.kv_heads or max(a.rows) > a.vocab:
        ap.error("--heads must be a multiple of --kv-heads and --rows at most --vocab")
    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda and not a.smoke:
        sys.exit("the mapped path needs CUDA (run with --smoke to check the script on the CPU)")
    bw = ceilings("cuda" if cuda else "cpu")
    meta = {"h2d_gbps": bw["h2d_gbps"], "d2h_gbps": bw["d2h_gbps"], "dtype": "bf16", "reps": a.reps}
    meta.update(warmup=a.warmup, device=torch.cuda.get_device_name() if cuda else "cpu", gpus=int(cuda))
    meta.update(commit=a.commit or git_commit(), command=command_line())
    if cuda:
        records = run(a, meta)
    else:
        print("# the mapped path needs CUDA: checking the script on the CPU, fake timings", file=sys.stderr)
        records = smoke(a, {**meta, "fake_timings": True})
    print(table(records))
    save(a, records)
    failed = [r for r in records if "error" in r]
    if failed:
        sys.exit(f"FAIL: {len(failed)} shape(s) where the mapped result differs (records with 'error')")


if __name__ == "__main__":
    main()
