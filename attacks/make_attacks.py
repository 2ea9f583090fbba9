"""Builds hostile files for ramtorch's readers (``ramtorch.load`` and ``ramtorch.load_checkpoint``).

Each attack is a file (or a folder of shards) written into a directory at test time, with the
loader it targets and a pattern its error message must match. ``attacks/README.md`` lists the ideas
covered; ``tests/test_attacks.py`` loads each one into a model and expects a clear exception and an
untouched model, optimizer and RNG. Run ``python attacks/make_attacks.py OUT_DIR`` to write them
for inspection.

The victims are small and fixed: :func:`victim` (a model and an AdamW optimizer after one step),
whose valid checkpoint and pretrained file the semantic attacks start from.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["Attack", "build", "victim"]


@dataclass(frozen=True)
class Attack:
    """One hostile input."""

    name: str
    #: ``"load"`` (``ramtorch.load(model, path)``) or ``"checkpoint"`` (``load_checkpoint``).
    target: str
    path: Path
    #: A regular expression the error message must match.
    expect: str
    about: str


class Victim(nn.Module):
    """The model every attack is loaded into: a linear layer and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def victim(seed: int = 0) -> tuple[Victim, torch.optim.Optimizer]:
    """A model and an AdamW optimizer holding state (one step taken), from ``seed``."""
    torch.manual_seed(seed)
    model = Victim()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


# -- raw safetensors ------------------------------------------------------------------------------


def raw(header: Any, data: bytes = b"", declared: int | None = None) -> bytes:
    """A file: 8-byte length (``declared``, default the header's), header (JSON of ``header``
    unless str/bytes), data."""
    if isinstance(header, bytes):
        h = header
    elif isinstance(header, str):
        h = header.encode()
    else:
        h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if declared is None else declared) + h + data


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header (as a dict) and data section of a valid safetensors file."""
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def rewrite(data: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    """``data`` with its header changed by ``change`` (in place), data section kept."""
    header, body = split(data)
    change(header)
    return raw(header, body)


def set_meta(key: str, value: str | None) -> Callable[[dict[str, Any]], None]:
    def change(h: dict[str, Any]) -> None:
        if value is None:
            h["__metadata__"].pop(key, None)
        else:
            h["__metadata__"][key] = value

    return change


def set_entry(name: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def change(h: dict[str, Any]) -> None:
        h[name].update(fields)

    return change


DEEP = "[" * 100_000 + "]" * 100_000


def _pretrained_attacks(good: bytes, prefix: str = "") -> dict[str, tuple[bytes, str, str]]:
    """name → (file bytes, expected message, about) for ``ramtorch.load`` of one file (``prefix``:
    of the tensor names, as in a checkpoint)."""
    head, body = split(good)
    weight = prefix + "lin.weight"
    w = head[weight]
    n = len(body)
    f32 = {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}
    return {
        "header_length_huge": (
            struct.pack("<Q", 1 << 62) + good[8:],
            "exceeds",
            "header length of 2^62 bytes",
        ),
        "header_length_past_eof": (
            struct.pack("<Q", len(good) * 4) + good[8:],
            "runs past the end of the file",
            "header length larger than the file",
        ),
        "shorter_than_length": (good[:5], "truncated", "file shorter than the 8-byte length"),
        "empty_file": (b"", "truncated", "empty file"),
        "header_not_utf8": (raw(b"\xff\xfe\x00garbage", b"\0" * 8), "UTF-8", "header bytes not UTF-8"),
        "header_not_json": (raw("{{{{"), "not a JSON object", "header not JSON"),
        "header_is_a_list": (raw("[]"), "not a JSON object", "header a JSON list"),
        "deep_json_header": (raw(DEEP), "not a JSON object", "JSON nested 100000 deep"),
        "overlapping_offsets": (
            raw(
                {
                    "lin.weight": f32,
                    "lin.bias": {"dtype": "F32", "shape": [3], "data_offsets": [36, 48]},
                    "steps": {"dtype": "I64", "shape": [], "data_offsets": [48, 56]},
                },
                b"\0" * 56,
            ),
            "overlap",
            "two tensors share bytes",
        ),
        "offsets_out_of_file": (
            rewrite(good, set_entry(weight, data_offsets=[w["data_offsets"][0], n + 64])),
            "run past the data section|needs",
            "a tensor ending past the end of the file",
        ),
        "offsets_reversed": (
            rewrite(good, set_entry(weight, data_offsets=[48, 0])),
            "end before they start",
            "end offset before start offset",
        ),
        "offset_negative": (
            rewrite(good, set_entry(weight, data_offsets=[-48, 0])),
            "bad data offset",
            "negative offset",
        ),
        "dtype_shape_mismatch": (
            rewrite(good, set_entry(weight, shape=[4, 4])),
            "needs 64 bytes",
            "shape's byte count differs from the offsets",
        ),
        "huge_shape_overflow": (
            rewrite(good, set_entry(weight, shape=[1 << 32, 1 << 32, 1 << 32])),
            "more elements than fit",
            "element count overflows",
        ),
        "huge_shape_bytes_overflow": (
            rewrite(good, set_entry(weight, shape=[1 << 31, 1 << 31, 3])),
            "overflows a byte count|more elements than fit",
            "byte count overflows",
        ),
        "negative_dimension": (
            rewrite(good, set_entry(weight, shape=[-3, -4])),
            "bad dimension",
            "negative size",
        ),
        "fractional_dimension": (
            rewrite(good, set_entry(weight, shape=[1.5, 8])),
            "bad dimension",
            "non-integer size",
        ),
        "nan_dimension": (
            raw(json.dumps(head).replace('"shape": [3, 4]', '"shape": [NaN, 4]', 1), body),
            "not a JSON object",
            "NaN size (not JSON)",
        ),
        "too_many_dimensions": (
            rewrite(good, set_entry(weight, shape=[1] * 100)),
            "dimensions",
            "100 dimensions",
        ),
        "unknown_dtype": (rewrite(good, set_entry(weight, dtype="F128")), "unknown dtype", "dtype F128"),
        "entry_not_object": (
            rewrite(good, lambda h: h.update({weight: 5})),
            "not an object",
            "a tensor entry that is a number",
        ),
        "metadata_not_strings": (
            rewrite(good, lambda h: h.update({"__metadata__": {"format": 1}})),
            "not a string",
            "metadata values not strings",
        ),
        "duplicate_keys": (
            raw(
                '{"lin.weight":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},'
                '"lin.weight":{"dtype":"F32","shape":[3,4],"data_offsets":[48,96]}}',
                b"\0" * 96,
            ),
            "more than once",
            "the same key twice, at different offsets",
        ),
        "duplicate_keys_identical": (
            raw(
                "{" + ",".join(2 * [json.dumps(weight) + ":" + json.dumps(w)]) + "," + json.dumps(head)[1:],
                body,
            ),
            "more than once",
            "the same key and entry twice",
        ),
        "shape_mismatch": (
            rewrite(good, set_entry(weight, shape=[4, 3])),
            "shape mismatch|does not match",
            "a weight of another shape (same byte count)",
        ),
        "gap_in_data": (good + b"\0" * 16, "rejected by the safetensors reader", "bytes no tensor covers"),
        "truncated_tensor_data": (good[:-3], "run past the data section", "data section cut short"),
    }


def _checkpoint_attacks(good: bytes) -> dict[str, tuple[bytes, str, str]]:
    """name → (file bytes, expected message, about) for ``load_checkpoint``."""
    head, _ = split(good)
    structural = {
        name: (data, "not a readable safetensors checkpoint", about)
        for name, (data, _, about) in _pretrained_attacks(good, "model.").items()
        if name
        in (
            "header_length_huge",
            "header_length_past_eof",
            "empty_file",
            "deep_json_header",
            "truncated_tensor_data",
            "dtype_shape_mismatch",
            "gap_in_data",
            "huge_shape_overflow",
        )
    }
    optim = json.loads(head["__metadata__"]["ramtorch.optimizer"])

    def optim_with(change: Callable[[dict[str, Any]], None]) -> str:
        o = json.loads(json.dumps(optim))
        change(o)
        return json.dumps(o)

    semantic = {
        "wrong_version": (
            rewrite(good, set_meta("ramtorch.checkpoint", "99")),
            "unknown checkpoint format version",
            "format version 99",
        ),
        "no_version": (
            rewrite(good, set_meta("ramtorch.checkpoint", None)),
            "not a ramtorch checkpoint",
            "a plain safetensors file",
        ),
        "metadata_not_json": (
            rewrite(good, set_meta("ramtorch.extra", "{")),
            "not valid JSON",
            "metadata entry not JSON",
        ),
        "deep_json_metadata": (
            rewrite(good, set_meta("ramtorch.extra", DEEP)),
            "nested more than",
            "metadata JSON nested 100000 deep",
        ),
        "deep_value_metadata": (
            rewrite(good, set_meta("ramtorch.extra", "[" * 900 + "]" * 900)),
            "nested more than",
            "metadata JSON nested 900 deep",
        ),
        "model_keys_not_list": (
            rewrite(good, set_meta("ramtorch.model", '{"keys": "lin.weight"}')),
            "malformed",
            "model keys a string",
        ),
        "model_keys_not_strings": (
            rewrite(good, set_meta("ramtorch.model", '{"keys": [1, 2, 3]}')),
            "malformed",
            "model keys numbers",
        ),
        "alias_list": (
            rewrite(good, set_meta("ramtorch.aliases", '{"model.lin.bias": ["model.lin.weight"]}')),
            "malformed",
            "an alias that is a list",
        ),
        "alias_to_missing_tensor": (
            rewrite(good, set_meta("ramtorch.aliases", '{"model.lin.bias": "nowhere"}')),
            "not in the file",
            "an alias naming no tensor",
        ),
        "tensor_ref_missing": (
            rewrite(good, set_meta("ramtorch.extra", '{"t": {"__tensor__": "nowhere"}}')),
            "not in the file",
            "a tensor reference naming no tensor",
        ),
        "tensor_ref_list": (
            rewrite(good, set_meta("ramtorch.extra", '{"t": {"__tensor__": ["x"]}}')),
            "not a string|malformed",
            "a tensor reference that is a list",
        ),
        "unknown_torch_dtype": (
            rewrite(good, set_meta("ramtorch.extra", '{"d": {"__dtype__": "__class__"}}')),
            "malformed",
            "a dtype torch does not have",
        ),
        "optimizer_groups_malformed": (
            rewrite(good, set_meta("ramtorch.optimizer", optim_with(lambda o: o.update(param_groups=5)))),
            "malformed",
            "param_groups a number",
        ),
        "optimizer_groups_mismatch": (
            rewrite(
                good,
                set_meta("ramtorch.optimizer", optim_with(lambda o: o["param_groups"][0].update(params=[0]))),
            ),
            "does not match the optimizer",
            "a parameter group of another size",
        ),
        "rng_not_object": (
            rewrite(good, set_meta("ramtorch.rng", '["rng.cpu"]')),
            "ramtorch.rng' is malformed",
            "RNG entry a list",
        ),
        "rng_key_not_string": (
            rewrite(good, set_meta("ramtorch.rng", '{"cpu": 5}')),
            "malformed|not a string",
            "RNG key a number",
        ),
        "rng_names_a_weight": (
            rewrite(good, set_meta("ramtorch.rng", '{"cpu": "model.lin.weight"}')),
            "RNG state",
            "RNG state pointing at a float tensor",
        ),
        "model_key_unknown": (
            rewrite(
                good,
                set_meta(
                    "ramtorch.model",
                    json.dumps({"keys": ["lin.weight", "lin.bias", "steps", "extra"], "objects": {}}),
                ),
            ),
            "does not match the model",
            "a key the model does not have",
        ),
        "model_shape_mismatch": (
            rewrite(good, set_entry("model.lin.weight", shape=[4, 3])),
            "does not match the model",
            "a weight of another shape (same byte count)",
        ),
    }
    return {**structural, **semantic}


def build(out: str | os.PathLike[str]) -> list[Attack]:
    """Writes every attack into directory ``out`` (created) and returns them."""
    import ramtorch  # here: building the valid files needs it, listing the module does not
    from safetensors.torch import load_file, save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, opt = victim(1)
    good_ckpt = out / "good.checkpoint.safetensors"
    ramtorch.save_checkpoint(good_ckpt, model, opt, extra={"step": 1})
    good_dir = out / "good.pretrained"
    ramtorch.save_pretrained(model, good_dir)
    good = (good_dir / "model.safetensors").read_bytes()
    attacks: list[Attack] = []

    for name, (data, expect, about) in _pretrained_attacks(good).items():
        p = out / f"load.{name}.safetensors"
        p.write_bytes(data)
        attacks.append(Attack(name, "load", p, expect, about))
    for name, (data, expect, about) in _checkpoint_attacks(good_ckpt.read_bytes()).items():
        p = out / f"checkpoint.{name}.safetensors"
        p.write_bytes(data)
        attacks.append(Attack(name, "checkpoint", p, expect, about))

    # A bad RNG state tensor (right name, wrong bytes).
    tensors = load_file(good_ckpt)
    meta = split(good_ckpt.read_bytes())[0]["__metadata__"]
    for name, state in (
        ("rng_state_too_short", torch.zeros(10, dtype=torch.uint8)),
        ("rng_state_wrong_dtype", torch.zeros(5056, dtype=torch.int64)),
    ):
        p = out / f"checkpoint.{name}.safetensors"
        save_file({**tensors, "rng.cpu": state}, p, metadata=meta)
        attacks.append(Attack(name, "checkpoint", p, "RNG state", "an RNG state torch would refuse"))

    # Sharded folders with a hostile index.
    def folder(
        name: str,
        weight_map: Any,
        expect: str,
        about: str,
        shards: dict[str, bytes] | None = None,
        index_text: str | None = None,
    ) -> None:
        d = out / f"load.{name}"
        d.mkdir(exist_ok=True)
        for fname, data in (shards or {}).items():
            (d / fname).write_bytes(data)
        text = index_text if index_text is not None else json.dumps({"weight_map": weight_map})
        (d / "model.safetensors.index.json").write_text(text)
        attacks.append(Attack(name, "load", d, expect, about))

    everything = {
        "lin.weight": "model.safetensors",
        "lin.bias": "model.safetensors",
        "steps": "model.safetensors",
    }
    for label, bad in (
        ("parent", "../good.pretrained/model.safetensors"),
        ("absolute", str(good_dir / "x")),
        ("dotdot", ".."),
        ("empty", ""),
        ("not_a_string", 5),
    ):
        folder(
            f"index_path_{label}",
            {**everything, "lin.weight": bad},
            "bad file name",
            f"shard name in the index: {bad!r}",
            {"model.safetensors": good},
        )
    folder("index_not_json", None, "not a valid index", "index not JSON", index_text="{")
    folder(
        "index_duplicate_keys",
        None,
        "not a valid index",
        "a key twice in the weight map, for two shards",
        {"model.safetensors": good},
        index_text='{"weight_map": {"lin.weight": "model.safetensors", "lin.bias": "model.safetensors", '
        '"steps": "model.safetensors", "lin.weight": "other.safetensors"}}',
    )
    folder("index_map_not_object", ["x"], "not a valid index", "weight_map a list")
    folder("index_deep_json", None, "not a valid index", "index nested 100000 deep", index_text=DEEP)
    folder(
        "index_names_absent_key",
        {**everything, "lin.extra": "model.safetensors"},
        "does not hold them",
        "index assigns a key the shard lacks",
        {"model.safetensors": good},
    )
    d = out / "load.key_in_two_files"
    d.mkdir(exist_ok=True)
    (d / "a.safetensors").write_bytes(good)
    (d / "b.safetensors").write_bytes(good)
    attacks.append(
        Attack("key_in_two_files", "load", d, "is in both", "a folder of two files with the same keys")
    )

    # Non-regular files.
    if hasattr(os, "mkfifo"):
        fifo = out / "checkpoint.fifo.safetensors"
        if not fifo.exists():
            os.mkfifo(fifo)
        attacks.append(Attack("fifo", "checkpoint", fifo, "not a regular file", "a FIFO as the checkpoint"))
        d = out / "load.fifo_shard"
        d.mkdir(exist_ok=True)
        if not (d / "model.safetensors").exists():
            os.mkfifo(d / "model.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": everything}))
        attacks.append(Attack("fifo_shard", "load", d, "not a regular file", "a FIFO as a shard of an index"))
        d = out / "load.fifo_index"
        d.mkdir(exist_ok=True)
        if not (d / "model.safetensors.index.json").exists():
            os.mkfifo(d / "model.safetensors.index.json")
        attacks.append(Attack("fifo_index", "load", d, "not a regular file", "a FIFO as the index"))
    d = out / "checkpoint.directory.safetensors"
    d.mkdir(exist_ok=True)
    attacks.append(
        Attack("directory", "checkpoint", d, "not a regular file", "a directory as the checkpoint")
    )
    if os.path.exists("/dev/zero"):
        attacks.append(
            Attack(
                "char_device",
                "checkpoint",
                Path("/dev/zero"),
                "not a regular file",
                "a character device (endless zeros) as the checkpoint",
            )
        )
        d = out / "load.device_shard"
        d.mkdir(exist_ok=True)
        if not (d / "model.safetensors").exists():
            os.symlink("/dev/zero", d / "model.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": everything}))
        attacks.append(
            Attack("device_shard", "load", d, "not a regular file", "a link to /dev/zero as a shard")
        )
    return attacks


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python attacks/make_attacks.py OUT_DIR")
    for a in build(sys.argv[1]):
        print(f"{a.target:10} {a.name:28} {a.about}")
