"""W2 logits under ramtorch.offload against the resident model, layer by layer: is a difference
numerics (kernels that round differently from run to run) or wrong data (a weight or cache read
before it was written)? Prints one JSON line per comparison.

The resident W2 generates 8 greedy tokens; then the same prompt and tokens are fed teacher-forced
(prefill, then one decode step per token, dynamic KV cache) to the resident model twice and to the
offloaded model twice per configuration (``--configs``: ``8GiB`` = ``gpu_budget="8GiB"``,
``8GiB-inflight1`` = the same with ``max_inflight=1``, ``all-resident`` = a budget that keeps every
layer on the GPU, ``stream-all`` = 4 GiB). Forward hooks record every decoder layer's output at
every pass; for each run against the first resident run (and each configuration's second run
against its first) the script reports bitwise equality of the last-position logits, the largest
difference per step, and the first (pass, layer) whose output differs, with whether that layer's
input was still equal.

    python3 bench/determinism.py --batch 1
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 bench/determinism.py --batch 1 --deterministic \\
        --configs 8GiB all-resident
"""

from __future__ import annotations

import argparse
import json

import ramtorch
import torch
from generate import compare_logits, forced_logits, generate, model_stats, prompt_ids
from w2 import build, config, to_host

CONFIGS = {
    "8GiB": {"gpu_budget": "8GiB"},
    "8GiB-inflight1": {"gpu_budget": "8GiB", "max_inflight": 1},
    "all-resident": {"gpu_budget": "60GiB"},
    "stream-all": {"gpu_budget": "4GiB"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--deterministic", action="store_true", help="deterministic kernels")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    a = ap.parse_args()
    if a.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    cfg = config(False, 600)
    model = build(cfg, "cuda")
    ids = prompt_ids(a.batch, 512, cfg.vocab_size, "cuda")
    toks = generate(model, ids, 8, "dynamic")[:, 512:]
    box: dict = {"caps": {}}

    def cap(i: int):  # noqa: ANN202
        def hook(mod: torch.nn.Module, args: object, out: object) -> None:
            h = out[0] if isinstance(out, tuple) else out
            box["caps"].setdefault(i, []).append(h.detach().float().cpu())

        return hook

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(cap(i))

    def run(tag: str) -> tuple[str, torch.Tensor, dict]:
        box["caps"] = {}
        lg = forced_logits(model, ids, toks, "dynamic")
        torch.cuda.synchronize()
        return tag, lg, box["caps"]

    def first_diff(x: dict, y: dict) -> dict | None:
        for p in range(len(x[0])):
            for i in sorted(x):
                if not torch.equal(x[i][p], y[i][p]):
                    return {
                        "pass": p,
                        "layer": i,
                        "max_diff": float((x[i][p] - y[i][p]).abs().max()),
                        "input_equal": i == 0 or torch.equal(x[i - 1][p], y[i - 1][p]),
                    }
        return None

    runs = [run("resident-1"), run("resident-2")]
    to_host(model)
    for label in a.configs:
        try:
            ramtorch.offload(model, device="cuda", **CONFIGS[label])
        except Exception as e:  # noqa: BLE001 - reported, the other configurations still run
            print(json.dumps({"run": label, "error": repr(e)}), flush=True)
            continue
        st = model_stats(model)
        units = {"resident_units": st["resident_units"], "slots": st["slot_count"]}
        print(json.dumps({"config": label, **units}), flush=True)
        runs += [run(label + "-1"), run(label + "-2")]
        ramtorch.synchronize()
        ramtorch._offload.detach_streamer(model)
        to_host(model)
    ref = runs[0]
    for tag, lg, caps in runs[1:]:
        c = compare_logits(ref[1], lg)
        rec = {"run": tag, "vs": ref[0], "bitwise": c["bitwise_equal"], "max_abs_diff": c["max_abs_diff"]}
        rec.update(per_step=c["max_abs_diff_per_step"], first_layer_diff=first_diff(ref[2], caps))
        print(json.dumps(rec), flush=True)
    for k in range(2, len(runs), 2):
        x, y = runs[k], runs[k + 1]
        rec = {"run": y[0], "vs": x[0], "bitwise": bool(torch.equal(x[1], y[1]))}
        print(json.dumps({**rec, "first_layer_diff": first_diff(x[2], y[2])}), flush=True)


if __name__ == "__main__":
    main()
