"""pytest plugin: records CUDA allocation history around the budget test and dumps it."""
import os
import pytest
import torch


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    on = "peak_gpu_memory_stays_within_budget" in item.name
    if on:
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    outcome = yield
    if on:
        name = item.name.replace("[", "_").replace("]", "")
        tag = "fail" if outcome.excinfo is not None else "pass"
        out = os.environ.get("OUT", "/tmp")
        torch.cuda.memory._dump_snapshot(f"{out}/snap-{name}-{tag}.pickle")
        torch.cuda.memory._record_memory_history(enabled=None)
        import ramtorch
        with open(f"{out}/stats-{name}-{tag}.txt", "w") as fh:
            fh.write(repr(ramtorch.stats()))
