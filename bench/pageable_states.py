"""An experiment, not an option: ``bench/throughput.py`` with ``AdamW(gpu_updates=True)`` whose
states and spare buffers are left pageable (by default the option page-locks them, since the GPU
copies them), so that the GPU's copies of them go through the driver's staging. It asks whether
the GPU's share is worth having without the page-locking of every state.

    python3 bench/pageable_states.py --gpu-updates on --resident-layers 0 0 [throughput.py's arguments]

The records are ``bench/throughput.py``'s, with ``"states_pinned": false`` in their options and
this script in their command.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any

import ramtorch.optim._optimizer as _optimizer

_init = _optimizer._HostOptimizer.__init__


def _pageable_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    self._pin_states = False
    self._shadows.pin_all = False


def main() -> None:
    _optimizer._HostOptimizer.__init__ = _pageable_init
    here = os.path.dirname(os.path.abspath(__file__))
    args = sys.argv[1:]
    sys.argv = [os.path.join(here, "throughput.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
    if "--out" in args:
        path = args[args.index("--out") + 1]
        with open(path) as f:
            records = json.load(f)
        for r in records:
            if r.get("system") == "ramtorch":
                r["options"] = {**r.get("options", {}), "states_pinned": False}
            r["command"] = "python3 bench/pageable_states.py " + " ".join(args)
        with open(path, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
