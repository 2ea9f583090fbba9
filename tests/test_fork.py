"""A process forked after ramtorch started (``os.fork``, ``multiprocessing`` with the ``fork``
start method) gets a clear error at its first use of ramtorch, as torch refuses CUDA there, never
a hang: the engine's threads are not in the child. A child may drop the parent's streamed
models, and ramtorch works in a child forked before its parent used it. Before, the child hung at its first
forward, waiting for a copy thread that fork() had not copied."""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from ramtorch import _arena
from torch import nn

#: Generous: only a hang comes near it (CI machines are slow and loaded).
JOIN_SECONDS = 300.0
FORKED = r"forked after ramtorch started in its parent.*'spawn'"

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _in_forked_child(body: Callable[[], str], out: Path) -> str:
    """Runs ``body`` in a child made by multiprocessing's ``fork`` start method; returns what it
    returned (or the error it raised, as ``"TypeName: message"``)."""

    def child() -> None:
        # A hang shows where it is (on stderr) before the parent gives up.
        faulthandler.dump_traceback_later(JOIN_SECONDS - 10, exit=True)
        try:
            result = body()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = f"{type(e).__name__}: {e}"
        out.write_text(result)

    proc = multiprocessing.get_context("fork").Process(target=child, daemon=True)
    proc.start()
    proc.join(JOIN_SECONDS)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail("the forked child hangs")
    assert proc.exitcode == 0, f"the child ended with {proc.exitcode}"
    return out.read_text()


def _models() -> dict[str, tuple[nn.Module, nn.Module]]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    off = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    off = ramtorch.offload(off, device="cpu", unit=nn.Linear)
    off.load_state_dict(ref.state_dict())
    layers = nn.Sequential(rnn.Linear(32, 32), nn.ReLU(), rnn.Linear(32, 8))
    layers.load_state_dict(ref.state_dict())
    return {"offload": (ref, off), "layers": (ref, layers)}


@pytest.mark.parametrize("kind", ["offload", "layers"])
def test_a_child_forked_after_the_engine_started_gets_a_clear_error_not_a_hang(kind, tmp_path):
    ref, model = _models()[kind]
    held = {"model": model}  # the only reference the children see (one drops it)
    del model
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(held["model"](x), ref(x))  # the engine runs in the parent

    def forward() -> str:
        with torch.no_grad():
            held["model"](x)
        return "ran"

    got = _in_forked_child(forward, tmp_path / "forward")
    assert got.startswith("RuntimeError: ") and re.search(FORKED, got), got

    def plain_torch_and_direct_calls() -> str:
        # The compiled layer refuses in the child too; dropping the parent's model (its arena
        # memory) neither hangs nor crashes. (No torch kernel runs here: torch's own CPU thread
        # pool, used by the parent, does not survive fork() either.)
        held.clear()
        gc.collect()
        try:
            _arena.host_bytes(64)
        except RuntimeError as e:
            return str(e)
        return "allocated"

    got = _in_forked_child(plain_torch_and_direct_calls, tmp_path / "direct")
    assert re.search(FORKED, got), got
    with torch.no_grad():  # the parent goes on
        torch.testing.assert_close(held["model"](x), ref(x))
    ramtorch.synchronize()


def test_a_child_forked_before_ramtorch_started_uses_it(tmp_path):
    """A fresh interpreter imports ramtorch and forks before using it: the child streams."""
    script = textwrap.dedent(
        """
        import multiprocessing, sys
        import torch, ramtorch
        from torch import nn

        def child(q):
            torch.manual_seed(0)
            ref = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
            model = ramtorch.offload(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)), device="cpu",
                                     unit=nn.Linear)
            model.load_state_dict(ref.state_dict())
            x = torch.randn(2, 16)
            with torch.no_grad():
                q.put(bool(torch.equal(model(x), ref(x))))

        JOIN_SECONDS = float(sys.argv[1])

        if __name__ == "__main__":
            ctx = multiprocessing.get_context("fork")
            q = ctx.SimpleQueue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            p.join(JOIN_SECONDS)
            sys.exit(0 if p.exitcode == 0 and q.get() is True else 1)
        """
    )
    path = tmp_path / "fork_first.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, str(path), str(JOIN_SECONDS)]
    done = subprocess.run(cmd, env=env, timeout=2 * JOIN_SECONDS, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_child_forked_while_an_optimizer_job_runs_does_not_hang(tmp_path):
    """The optimizer's worker is not in a forked child: waiting for its jobs there returns (the
    parent runs them) instead of waiting forever; the parent's job still finishes."""
    import threading

    from ramtorch.optim._jobs import _Jobs

    jobs = _Jobs()
    release, started, ran = threading.Event(), threading.Event(), []

    def job() -> None:
        started.set()
        release.wait()
        ran.append(1)

    jobs.submit(job)
    jobs.submit(lambda: ran.append(2))  # queued behind the running one
    assert started.wait(JOIN_SECONDS)

    def wait_in_child() -> str:
        jobs.wait()
        return f"waited, busy={jobs.busy()}"

    got = _in_forked_child(wait_in_child, tmp_path / "jobs")
    assert got == "waited, busy=False", got
    release.set()
    jobs.wait()
    assert sorted(ran) == [1, 2]
    jobs.close()
