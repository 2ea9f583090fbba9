"""What a well-kept library owes its users besides its features: a distribution of its own with a
license and type information, messages through ``logging`` and ``warnings`` with sizes a person
reads, and ranges in the profilers people already use."""

from __future__ import annotations

import ast
import copy
import logging
import os
import re
import zipfile
from pathlib import Path

import pytest
import ramtorch
import torch
from conftest import Net
from ramtorch import _arena, _offload, _profile
from ramtorch._units import format_bytes
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "ramtorch"

# -- packaging --------------------------------------------------------------------------------------


def _toml(name: str) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / name).read_text())


def _pyproject() -> dict:
    return _toml("pyproject.toml")


def test_distribution_has_its_own_name_and_full_metadata():
    project = _pyproject()["project"]
    # "ramtorch" on the package index is another project installing the same import package.
    assert project["name"] != "ramtorch" and project["name"].startswith("ramtorch")
    assert _pyproject()["tool"]["maturin"]["module-name"] == "ramtorch._core"  # import name kept
    cargo = _toml("Cargo.toml")["workspace"]["package"]
    assert project["license"] == cargo["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert project["urls"] and all(u.startswith("https://") for u in project["urls"].values())
    assert project["requires-python"] == ">=3.10"
    assert any(d.startswith("torch") for d in project["dependencies"])
    assert project["description"] and project["readme"] == "README.md"
    assert "Typing :: Typed" in project["classifiers"]
    assert (PACKAGE / "py.typed").is_file()


def test_version_comes_from_our_distribution():
    src = (PACKAGE / "__init__.py").read_text()
    assert f'version("{_pyproject()["project"]["name"]}")' in src


def _wheels() -> list[Path]:
    given = os.environ.get("RAMTORCH_WHEEL")
    if given:
        return [Path(given)]
    return sorted((ROOT / "dist").glob("*.whl"))


@pytest.mark.skipif(not _wheels(), reason="no wheel built (make wheel, or RAMTORCH_WHEEL=path)")
def test_built_wheel_is_abi3_typed_and_licensed():
    name = _pyproject()["project"]["name"].replace("-", "_")
    for whl in _wheels():
        assert whl.name.startswith(f"{name}-") and "-cp310-abi3-manylinux_" in whl.name, whl.name
        with zipfile.ZipFile(whl) as z:
            files = set(z.namelist())
            assert "ramtorch/py.typed" in files and "ramtorch/__init__.py" in files
            assert any(f.startswith("ramtorch/_core") and f.endswith(".so") for f in files)
            meta = next(f for f in files if f.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode()
            assert f"Name: {_pyproject()['project']['name']}" in text
            assert "License-Expression: Apache-2.0" in text and "Requires-Dist: torch" in text
            assert any(f.endswith(".dist-info/licenses/LICENSE") for f in files)
            # The manylinux tag promises the glibc the binary needs at most: the newest symbol
            # version it names (its dynamic string table) must not be newer than the tag's.
            tag = re.search(r"manylinux_(\d+)_(\d+)_", whl.name)
            assert tag is not None, whl.name
            so = next(f for f in files if f.startswith("ramtorch/_core") and f.endswith(".so"))
            needed = {tuple(map(int, v)) for v in re.findall(rb"GLIBC_(\d+)\.(\d+)", z.read(so))}
            assert needed and max(needed) <= (int(tag[1]), int(tag[2])), (whl.name, max(needed))


# -- messages ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (100, "100 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (5 << 20, "5.0 MiB"),
        (300 << 20, "300.0 MiB"),
        (3 << 30, "3.00 GiB"),
        (2 << 40, "2.00 TiB"),
    ],
)
def test_format_bytes_reads_for_humans(n, text):
    assert format_bytes(n) == text


def test_too_small_budget_on_a_small_model_names_real_sizes():
    model = Net()
    with pytest.raises(ValueError) as e:
        ramtorch.offload(model, gpu_budget=100, device="cpu")
    msg = str(e.value)
    assert "gpu_budget of 100 B is too small" in msg and "0.0 MiB" not in msg and "KiB" in msg


def test_pinning_fallback_is_a_user_warning(monkeypatch):
    monkeypatch.setattr(_arena._core, "take_pin_warning", lambda: "page-locking host memory was refused")
    with pytest.warns(UserWarning, match="page-locking") as rec:
        _arena.host_bytes(64)
    assert not issubclass(rec[0].category, ResourceWarning)  # hidden by default, unlike this one


def test_the_library_prints_nothing():
    """Library code reports through the ``ramtorch`` logger, warnings or exceptions; only the
    command line (``__main__``) writes its output with ``print``."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_auto_plan_report_goes_to_the_ramtorch_logger(caplog):
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("ramtorch").handlers)
    model = Net()
    ramtorch.offload(model, device="cpu")
    units = model._ramtorch_streamer.units
    pl = _offload.plan([u.nbytes for u in units], [], 1 << 20, 2)
    with caplog.at_level(logging.INFO, logger="ramtorch"):
        _offload._report_auto_plan(model, units, pl, 1 << 20, torch.device("cpu"))
    (rec,) = [r for r in caplog.records if r.name == "ramtorch"]
    assert rec.levelno == logging.INFO
    assert "budget 1.0 MiB" in rec.getMessage() and "predicted at 4096 tokens" in rec.getMessage()


# -- profilers --------------------------------------------------------------------------------------


def test_torch_profiler_sees_unit_passes_copies_and_waits():
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    ramtorch.offload(model, device="cpu")
    x = torch.randn(4, 8)
    model(x).sum().backward()  # a first step learns the itinerary
    ref(x).sum().backward()
    assert not _profile.active()  # no profiler: the hot paths open no range
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = model(x)
        out.sum().backward()
    expect = ref(x)
    expect.sum().backward()
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    names = {e.name for e in prof.events()}
    for unit in ("inp", "blocks.0", "blocks.3", "out"):
        assert f"ramtorch.forward {unit}" in names and f"ramtorch.backward {unit}" in names, names
    for op in ("ramtorch.copy_to_device", "ramtorch.copy_to_host", "ramtorch.wait_copy"):
        assert op in names
    assert "ramtorch.wait_gradient_copies" in names
    assert not _profile.active()
    # Ranges close where they open: each unit's forward range holds the unit's own ops.
    fwd = [e for e in prof.events() if e.name == "ramtorch.forward blocks.0"]
    assert fwd and all(e.time_range.end >= e.time_range.start for e in fwd)
