"""The ``ramtorch.io`` package: its public names, its place in the layers (it imports nothing above
it), one dtype table for both file kinds, one atomic write."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import ramtorch
import ramtorch.checkpoint
import ramtorch.io
import ramtorch.io.format as fmt
import torch
from ramtorch.io import _dtypes
from torch import nn

PACKAGE = Path(ramtorch.io.__file__).parent
#: What the package may import from ramtorch (modules below it).
BELOW = {"_arena", "_core", "_engine", "_units"}


def test_public_names_keep_working():
    assert ramtorch.load is ramtorch.io.load
    assert ramtorch.save_pretrained is ramtorch.io.save
    assert ramtorch.load_checkpoint is ramtorch.io.load_checkpoint is ramtorch.checkpoint.load_checkpoint
    assert ramtorch.save_checkpoint is ramtorch.io.save_checkpoint is ramtorch.checkpoint.save_checkpoint
    assert ramtorch.checkpoint.CheckpointError is ramtorch.io.CheckpointError
    assert ramtorch.checkpoint.FORMAT_VERSION == fmt.FORMAT_VERSION == 1
    assert callable(ramtorch.io.plain_loading)
    assert ramtorch.io.INDEX_NAME == "model.safetensors.index.json"


def test_the_package_imports_nothing_above_it():
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:  # from .. / from ..x
                names = [node.module] if node.module else [a.name for a in node.names]
                above = [n for n in names if n.split(".")[0] not in BELOW]
                assert not above, f"{path.name}:{node.lineno} imports {above} from above the package"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not node.module.startswith("ramtorch"), f"{path.name}:{node.lineno}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("ramtorch") for a in node.names), (
                    f"{path.name}:{node.lineno}"
                )


def test_one_dtype_table_for_both_formats(tmp_path):
    """Every dtype the table names is written and read back by checkpoints and pretrained files."""
    dtypes = [d for d in _dtypes.TORCH_TO_ST if d is not torch.complex64]
    m = nn.Module()
    for i, d in enumerate(dtypes):
        m.register_buffer(f"b{i}", torch.arange(6).reshape(2, 3).to(d))
    ramtorch.save_checkpoint(tmp_path / "c.safetensors", m)
    ramtorch.save_pretrained(m, tmp_path / "pre")
    for load in (
        lambda dst: ramtorch.load_checkpoint(tmp_path / "c.safetensors", dst),
        lambda dst: ramtorch.load(dst, tmp_path / "pre"),
    ):
        dst = nn.Module()
        for i, d in enumerate(dtypes):
            dst.register_buffer(f"b{i}", torch.zeros(2, 3, dtype=d))
        load(dst)
        for i, d in enumerate(dtypes):
            got, want = getattr(dst, f"b{i}"), getattr(m, f"b{i}")
            assert got.dtype == d and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), d


def test_save_pretrained_writes_atomically_and_cleans_up_after_a_killed_save(tmp_path):
    stale = tmp_path / ".model.safetensors.999999999.0123abcd.tmp"  # a pid that cannot be alive
    stale.write_bytes(b"partial")
    ramtorch.save_pretrained(nn.Linear(3, 3), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_load_checkpoint_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        ramtorch.load_checkpoint(tmp_path / "missing.safetensors", nn.Linear(2, 2))
    assert not os.path.exists(tmp_path / "missing.safetensors")


def test_sizes_for_humans():
    from ramtorch._units import format_bytes, parse_bytes

    assert parse_bytes(None) is None
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes(4096) == 4096
    for bad in ("-1GB", "9" * 400, "12 parsecs", float("nan"), -1, "inf"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_bytes(bad, "max_shard_size")
    with pytest.raises(TypeError, match="max_shard_size"):
        parse_bytes(True, "max_shard_size")
    assert format_bytes(3 << 30) == "3.00 GiB" and format_bytes(5 << 20) == "5.0 MiB"
