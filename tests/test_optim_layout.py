"""The ``ramtorch.optim`` package: it imports only the layers below it (the engine), and the names
the module it was had stay importable."""

from __future__ import annotations

import ast
from pathlib import Path

import ramtorch.optim

PACKAGE = Path(ramtorch.optim.__file__).parent
BELOW = {"_engine", "_arena", "_core", "_config", "_disk", "_profile", "_log", "_nodes", "_units"}


def _ramtorch_imports(path: Path) -> set[str]:
    """The ramtorch modules (first name under ``ramtorch``) ``path`` imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                continue  # the package itself
            if node.level == 2:
                names = [node.module] if node.module else [a.name for a in node.names]
            elif node.level == 0 and node.module and node.module.split(".")[0] == "ramtorch":
                parts = node.module.split(".")
                names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            else:
                continue
            found.update(n.split(".")[0] for n in names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "ramtorch" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_the_package_imports_only_the_layers_below_it():
    files = sorted(PACKAGE.glob("*.py"))
    assert {f.name for f in files} >= {
        "__init__.py",
        "_optimizer.py",
        "_state.py",
        "_schedule.py",
        "_jobs.py",
        "_zero.py",
        "_rules.py",
    }
    above = {f.name: sorted(_ramtorch_imports(f) - BELOW) for f in files}
    assert all(not v for v in above.values()), above
    assert _ramtorch_imports(PACKAGE / "_jobs.py") == set()


def test_the_names_of_the_module_stay_importable():
    from ramtorch.optim import (  # noqa: F401
        _DTYPES,
        _LISTENING,
        SGD,
        AdamW,
        Lion,
        _describe,
        _first_diff,
        _HostOptimizer,
        _is_host,
        _Jobs,
        listen_on,
    )

    assert {AdamW.__module__, SGD.__module__, Lion.__module__} == {"ramtorch.optim"}
    assert issubclass(AdamW, _HostOptimizer) and AdamW._state_names == ("exp_avg", "exp_avg_sq")
    assert SGD._state_names == ("momentum_buffer",) and Lion._state_names == ("exp_avg",)
