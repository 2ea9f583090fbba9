"""The package's imports point one way: engine layer, streaming layer, features, public namespace.

Every module under ``python/ramtorch`` is parsed with ``ast``; every import counts, including the
lazy ones inside functions (only ``if TYPE_CHECKING:`` blocks are left out). A module may import
modules of its own layer or of a lower one; a feature may import another feature only along an
edge declared in ``FEATURE_EDGES``; and there is no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "ramtorch"

ENGINE, STREAM, FEATURE, TOP = 0, 1, 2, 3
LAYER_NAMES = {ENGINE: "engine", STREAM: "streaming", FEATURE: "feature", TOP: "public namespace"}

#: The layer of each module, by its name or the name of the package it belongs to (the longest
#: match wins). Features are named by their top module: two modules of one feature may import
#: each other.
LAYERS: dict[str, int] = {
    "ramtorch._core": ENGINE,
    "ramtorch._engine": ENGINE,
    "ramtorch._arena": ENGINE,
    "ramtorch._codec": ENGINE,
    "ramtorch._codec_triton": ENGINE,
    "ramtorch._disk": ENGINE,
    "ramtorch._config": ENGINE,
    "ramtorch._units": ENGINE,
    "ramtorch._kv_sizes": ENGINE,
    "ramtorch._log": ENGINE,
    "ramtorch._profile": ENGINE,
    "ramtorch._nodes": ENGINE,
    "ramtorch._stream": STREAM,
    "ramtorch._offload": FEATURE,
    "ramtorch._kv_cache": FEATURE,
    "ramtorch._keep": FEATURE,
    "ramtorch.nn": FEATURE,
    "ramtorch.optim": FEATURE,
    "ramtorch.io": FEATURE,
    "ramtorch.checkpoint": FEATURE,
    "ramtorch.plan": FEATURE,
    "ramtorch._trace": FEATURE,
    "ramtorch.distributed": FEATURE,
    "ramtorch.convert": FEATURE,
    "ramtorch.integrations": FEATURE,
    "ramtorch": TOP,
    "ramtorch.__main__": TOP,
}

#: Features built on other features.
FEATURE_EDGES = {
    ("ramtorch.convert", "ramtorch.nn"),  # replace_linear builds ramtorch.nn.Linear
    ("ramtorch._offload", "ramtorch.plan"),  # gpu_budget="auto" prints the predicted times
    ("ramtorch.checkpoint", "ramtorch.io"),  # the old import path of ramtorch.io.checkpoint
    ("ramtorch.integrations", "ramtorch.optim"),  # the Trainer's optimizer is ramtorch.optim.AdamW
    ("ramtorch.plan", "ramtorch.optim"),  # the plan prices the optimizer's own state layout
    ("ramtorch._offload", "ramtorch._keep"),  # offload(keep=True) opens or makes a kept store
    ("ramtorch._keep", "ramtorch.io"),  # a kept store's commits are checkpoints of what is outside it
}

#: Imports known to break the layering, to be removed: each must still exist (the test says when
#: one is gone, so that this list shrinks instead of silently allowing it again).
KNOWN_BAD_EDGES: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _resolve(name: str, known: set[str]) -> str | None:
    """The module ``name`` refers to: itself, or the closest package above it that is known."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports (``from X import a`` imports ``X.a`` if that is
    a module, else ``X`` itself: ``from . import synchronize`` imports the package)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            for a in node.names:
                full = f"{mod}.{a.name}"
                targets.append(full if full in known else mod)
        for t in targets:
            if not (t == "ramtorch" or t.startswith("ramtorch.")):
                continue
            r = _resolve(t, known)
            if r is not None and r != name:
                out.add(r)
    return out


def _group(module: str) -> str:
    """The entry of ``LAYERS`` that ``module`` belongs to."""
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len, default=None)
    assert best is not None, f"{module} has no layer: add it to LAYERS in tests/test_layers.py"
    return best


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods) | {"ramtorch._core"}
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _edge_ok(src: str, dst: str) -> bool:
    gs, gd = _group(src), _group(dst)
    ls, ld = LAYERS[gs], LAYERS[gd]
    if ld < ls:
        return True
    if ld > ls:
        return False
    if ls == FEATURE:
        return gs == gd or (gs, gd) in FEATURE_EDGES
    return True


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for name in _modules():
        _group(name)


def test_imports_follow_the_layers():
    graph = _graph()
    bad = []
    for src, dsts in sorted(graph.items()):
        for dst in sorted(dsts):
            if (_group(src), _group(dst)) in KNOWN_BAD_EDGES:
                continue
            if not _edge_ok(src, dst):
                ls, ld = LAYERS[_group(src)], LAYERS[_group(dst)]
                bad.append(f"{src} ({LAYER_NAMES[ls]}) imports {dst} ({LAYER_NAMES[ld]})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    pruned = {
        src: {dst for dst in dsts if (_group(src), _group(dst)) not in KNOWN_BAD_EDGES}
        for src, dsts in graph.items()
    }
    cycles = _cycles(pruned)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_known_bad_edges_still_exist():
    """Each listed exception must still be needed: once an edge is gone, remove it from the list."""
    graph = _graph()
    present = {(_group(s), _group(d)) for s, dsts in graph.items() for d in dsts}
    gone = sorted(KNOWN_BAD_EDGES - present)
    assert not gone, f"these imports are gone: remove them from KNOWN_BAD_EDGES: {gone}"


def test_the_checker_sees_lazy_and_upward_imports(tmp_path):
    """The parser counts imports inside functions and leaves out ``if TYPE_CHECKING:`` blocks."""
    src = tmp_path / "mod.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import _engine\n"
        "if TYPE_CHECKING:\n"
        "    from .optim import AdamW\n"
        "def f():\n"
        "    from . import synchronize\n"
        "    from ._stream import units\n"
    )
    known = {"ramtorch", "ramtorch._engine", "ramtorch.optim", "ramtorch._stream", "ramtorch._stream.units"}
    found = _imports("ramtorch._arena", src, known)
    assert found == {"ramtorch._engine", "ramtorch", "ramtorch._stream.units"}
    assert not _edge_ok("ramtorch._arena", "ramtorch._stream.units")
    assert not _edge_ok("ramtorch._engine", "ramtorch")
    assert not _edge_ok("ramtorch.optim", "ramtorch.io")
    assert _edge_ok("ramtorch.convert", "ramtorch.nn.linear")
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
