"""A seeded fuzz of ``ramtorch.load`` and ``ramtorch.load_checkpoint``: a few hundred byte and
header mutations of small valid files. Each must load, or raise a clear ``ValueError``,
``OSError`` or ``RuntimeError`` (``CheckpointError``) leaving the model, the optimizer and torch's
RNG untouched; never crash the interpreter or raise anything else (``RecursionError``,
``TypeError``, ``KeyError``...)."""

from __future__ import annotations

import json
import random
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ramtorch
import ramtorch.optim
import torch
from conftest import changes, snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attacks"))
import make_attacks  # noqa: E402

CLEAR = (ValueError, OSError, RuntimeError)
CASES = 160  # per loader
SEED = 20261201

_VALUES: list[Any] = [
    None, True, -1, 0, 1, 7, 2**31, 2**63, 2**64 + 1, -(2**63), 1.5, -0.0, 1e308, "", "F32", "BF16",
    "I64", "U8", "x" * 300, [], [0], [-1], [1, 2, 3], [2**40, 2**40], [[1]], {}, {"a": 1},
    {"__tensor__": "model.lin.weight"}, {"__tensor__": "rng.cpu"}, {"__tuple__": 5}, {"__dict__": [[1]]},
    {"__dtype__": "int64"}, {"__device__": "nowhere"}, {"__float__": "nan"}, "[" * 300,
]  # fmt: skip


def _leaves(obj: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every value inside ``obj`` (dict keys and list indices)."""
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _leaves(v, (*path, i))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    if value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


_DELETE = object()


def _mutate_json(rng: random.Random, obj: Any) -> Any:
    path = rng.choice(_leaves(obj))
    choice = rng.random()
    if choice < 0.15 and path:
        return _set(obj, path, _DELETE)
    if choice < 0.25 and path and isinstance(path[-1], str):
        parent = obj
        for p in path[:-1]:
            parent = parent[p]
        parent[path[-1] + rng.choice(["", "x", ".0"])] = parent[path[-1]]  # a neighbouring key
        return obj
    return _set(obj, path, rng.choice(_VALUES))


def mutate(rng: random.Random, good: bytes) -> bytes:
    """One random mutation of the safetensors file ``good``."""
    head, body = make_attacks.split(good)
    kind = rng.randrange(8)
    if kind == 0:  # flip bytes in the header
        data = bytearray(good)
        n = struct.unpack("<Q", good[:8])[0]
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(8 + n)] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 1:  # flip bytes anywhere
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 2:  # cut or extend
        return good[: rng.randrange(len(good))] if rng.random() < 0.7 else good + bytes(rng.randint(1, 64))
    if kind == 3:  # another header length
        n = struct.unpack("<Q", good[:8])[0]
        new = rng.choice([0, 1, n - 1, n + 1, n + 8, len(good), 2**32, 2**64 - 1, rng.randrange(2 * n)])
        return struct.pack("<Q", new) + good[8:]
    if kind in (4, 5):  # a value of the header (tensor entries)
        return make_attacks.raw(_mutate_json(rng, head), body)
    # a value inside one of the JSON metadata entries (checkpoints), or of the metadata itself
    meta = head.get("__metadata__", {})
    keys = [k for k in meta if k.startswith("ramtorch.")]
    if not keys:
        return make_attacks.raw(_mutate_json(rng, head), body)
    key = rng.choice(keys)
    try:
        value = json.loads(meta[key])
        meta[key] = json.dumps(_mutate_json(rng, value))
    except ValueError:  # e.g. the version, a plain string
        meta[key] = rng.choice(["", "2", "0", "{", "1 ", "[1]"])
    return make_attacks.raw(head, body)


def _run(
    tmp_path: Path,
    good: bytes,
    load: Callable[[Path, Any, Any], Any],
    seed: int,
    victim: Callable[[int], tuple[torch.nn.Module, torch.optim.Optimizer]] = make_attacks.victim,
) -> None:
    rng = random.Random(seed)
    path = tmp_path / "fuzzed.safetensors"
    bad: list[str] = []
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(CASES):
        data = mutate(rng, good)
        path.write_bytes(data)
        model, opt = victim(0)
        before = snapshot(model, opt)
        try:
            load(path, model, opt)
            outcomes["loaded"] += 1
        except CLEAR as e:
            outcomes["refused"] += 1
            problem = changes(before, model, opt)
            if problem:
                bad.append(f"case {case}: {e!r}: {problem}")
        except Exception as e:  # noqa: BLE001 - an unclear error is what this test reports
            bad.append(f"case {case}: unclear error {e!r}")
            (tmp_path / f"case{case}.safetensors").write_bytes(data)
    assert not bad, "\n".join(bad)
    assert outcomes["refused"] > CASES // 4, outcomes  # the mutations do reach the checks


def ramtorch_victim(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The victim model with a ``ramtorch.optim.AdamW`` (host states, read in place on load)."""
    torch.manual_seed(seed)
    model = make_attacks.Victim()
    opt = ramtorch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.fixture(scope="module")
def good_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("good")
    model, opt = make_attacks.victim(1)
    ramtorch.save_checkpoint(d / "c.safetensors", model, opt, extra={"step": 3, "t": torch.ones(2)})
    ramtorch.save_pretrained(model, d / "pre")
    model, opt = ramtorch_victim(1)
    ramtorch.save_checkpoint(d / "r.safetensors", model, opt)
    return {
        "ramtorch": (d / "r.safetensors").read_bytes(),
        "checkpoint": (d / "c.safetensors").read_bytes(),
        "load": (d / "pre" / "model.safetensors").read_bytes(),
    }


def test_fuzzed_weights_files(tmp_path, good_files):
    _run(tmp_path, good_files["load"], lambda p, m, o: ramtorch.load(m, p), SEED)


def test_fuzzed_checkpoints(tmp_path, good_files):
    _run(tmp_path, good_files["checkpoint"], lambda p, m, o: ramtorch.load_checkpoint(p, m, o), SEED + 1)


def test_fuzzed_checkpoints_of_a_ramtorch_optimizer(tmp_path, good_files):
    _run(
        tmp_path,
        good_files["ramtorch"],
        lambda p, m, o: ramtorch.load_checkpoint(p, m, o),
        SEED + 2,
        ramtorch_victim,
    )
