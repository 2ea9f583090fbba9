"""``ramtorch.offload`` against the plain model on many tiny transformers architectures
(``bench/arch_zoo.py``: decoders, mixtures of experts, encoder-decoders, encoders, vision, audio,
Mamba), each in a process of its own. A diagnostic that checks and prints; it times nothing.

Per architecture and variant:
  forward      no-grad outputs
  grad1        gradients of one backward (and ``.grad`` None exactly where the plain model's is)
  accum        a second backward on another micro-batch without ``zero_grad``, against the plain
               model doing the same (and, where samples are independent, one backward of the
               concatenated batch)
  tuple        forward+backward with ``return_dict=False``
  adamw_ropt   two steps: torch's AdamW on the plain model, ``ramtorch.optim.AdamW`` on ours
  adamw_torch  two steps, torch's AdamW on both
Variants:
  default      ``offload(model)``, 2 layers
  budget40     a ``gpu_budget`` of 40% of the parameter bytes (given as a size string), 8 layers, so
               that some units stay resident and some stream
  small0       ``RAMTORCH_SMALL_PARAM_BYTES=0`` (norms and biases stream too)
  train        ``model.train()``, the RNG seeded alike before each forward (dropout masks match)
  recompute    ``train`` with ``offload(..., recompute=True)`` (transformers fill a KV cache)
fp32, TF32 off; tolerance 2e-5 (x10 for gradients and parameters after steps); a parameter whose
gradient is zero in exact arithmetic is only checked not to move further than AdamW can.

    python3 bench/arch_sweep.py --out sweep.json [--only gpt2,bart] [--variants default,recompute] [--jobs 2]
    SWEEP_DEVICE=cuda python3 bench/arch_sweep.py --out sweep.json --jobs 8    # on a GPU
    python3 bench/arch_sweep.py --report sweep.json                            # the table again
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 2e-5
L_DEFAULT = 2
L_BUDGET = 8
VARIANTS = ["default", "budget40", "small0", "train", "recompute"]
CHILD_TIMEOUT = 600


# ----------------------------------------------------------------------------- child side


def output(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits_per_image", "logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if t is not None:
            return t
    if isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, torch.Tensor):
                return t
    if hasattr(out, "to_tuple"):
        for t in out.to_tuple():
            if isinstance(t, torch.Tensor):
                return t
    raise AssertionError(f"no output tensor in {type(out).__name__}")


SEED = {"train": False, "n": 0}


def call(model, x, **kw):
    import torch

    x = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    if SEED["train"]:
        torch.manual_seed(1000 + SEED["n"])
    if os.environ.get("SWEEP_NO_CACHE") == "1":  # every pass with use_cache=False
        import inspect

        ps = inspect.signature(model.forward).parameters
        if "use_cache" in ps or (hasattr(getattr(model, "config", None), "use_cache") and "kwargs" in ps):
            kw = {**kw, "use_cache": False}
    return model(**x, **kw)


def loss_of(model, x, **kw):
    import torch

    y = output(call(model, x, **kw))
    w = torch.randn(y.shape[1:], generator=torch.Generator().manual_seed(7)).to(y.device)
    return (y * w).square().sum()


class CheckFail(AssertionError):
    pass


def maxdiff(a, b):
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


def close(a, b, what, scale=1.0):
    import torch

    tol = TOL * scale
    try:
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=tol, atol=tol)
    except AssertionError as e:
        raise CheckFail(
            f"{what}: maxabs {maxdiff(a.cpu(), b.cpu()):.3g} ({str(e).splitlines()[0]})"
        ) from None
    return maxdiff(a.cpu(), b.cpu())


def compare_grads(ref, ours, when):
    worst = 0.0
    checked = 0
    rn = list(ref.named_parameters())
    on = list(ours.named_parameters())
    if [n for n, _ in rn] != [n for n, _ in on]:
        raise CheckFail(f"{when}: parameter names differ: {set(n for n, _ in rn) ^ set(n for n, _ in on)}")
    for (name, p), (_, q) in zip(rn, on):
        if p.grad is None:
            if q.grad is not None:
                raise CheckFail(
                    f"{when}: {name} has a gradient (max {float(q.grad.abs().max()):.3g}) "
                    f"the plain model has not"
                )
            continue
        if q.grad is None:
            raise CheckFail(f"{when}: {name} has no gradient (plain max {float(p.grad.abs().max()):.3g})")
        worst = max(worst, close(p.grad, q.grad, f"{when}: grad of {name}", scale=10))
        checked += 1
    if checked == 0:
        raise CheckFail(f"{when}: no gradient to compare")
    return worst


def samples_independent(kind):
    return kind != "clip"


DEV = os.environ.get("SWEEP_DEVICE", "cpu")
OFFLOAD_KW: dict = {"device": DEV}


def make_pair(base, variant, budget):
    import ramtorch

    ref = copy.deepcopy(base).to(DEV)
    ours = ramtorch.offload(copy.deepcopy(base), **OFFLOAD_KW)
    if variant in ("train", "recompute"):
        ref.train()
        ours.train()
    return ref, ours


def tied_report(ref, ours):
    """Ties of the plain model that the offloaded one must keep."""

    def ties(m):
        seen = {}
        out = set()
        for mn, mod in m.named_modules():
            for pn, p in mod.named_parameters(recurse=False, prefix=""):
                full = f"{mn}.{pn}" if mn else pn
                if id(p) in seen:
                    out.add((seen[id(p)], full))
                else:
                    seen[id(p)] = full
        return out

    a, b = ties(ref), ties(ours)
    if a != b:
        raise CheckFail(f"tied parameters differ: plain {sorted(a)} vs offloaded {sorted(b)}")
    return sorted(a)


def adamw_check(base, kind, variant, budget, which):
    import ramtorch.optim as ropt
    import torch
    from arch_zoo import inputs

    ref, ours = make_pair(base, variant, budget)
    lr, steps = 1e-2, 2
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    if which == "ropt":
        opt = ropt.AdamW(ours.parameters(), lr=lr, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(ours.parameters(), lr=lr, weight_decay=0.01)
    largest = {}
    for step in range(steps):
        x = inputs(kind, 2, 10 + step)
        SEED["n"] = 10 + step
        for model, o in ((ref, opt_ref), (ours, opt)):
            (loss_of(model, x) / 100).backward()
            if model is ref:
                for pname, p in ref.named_parameters():
                    g = 0.0 if p.grad is None else float(p.grad.abs().max())
                    largest[pname] = max(largest.get(pname, 0.0), g)
            o.step()
            o.zero_grad(set_to_none=True)
    top = max(largest.values())
    worst = 0.0
    for (pname, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
        if largest[pname] <= 1e-6 * top:
            d = maxdiff(p.detach().cpu(), q.detach().cpu())
            if d > steps * lr:
                raise CheckFail(f"{pname} (zero-gradient parameter) moved too far: {d:.3g}")
            continue
        worst = max(worst, close(p, q, f"{pname} after two steps", scale=10))
    x = inputs(kind, 2, 99)
    SEED["n"] = 99
    with torch.no_grad():
        worst = max(
            worst, close(output(call(ref, x)), output(call(ours, x)), "forward after two steps", scale=10)
        )
    return worst


def run_child(name, variant):
    import logging

    import ramtorch
    import torch
    from arch_zoo import MODELS, UNIT, inputs

    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    logging.getLogger("ramtorch").setLevel(logging.WARNING)
    res = {"arch": name, "variant": variant, "checks": {}}
    builder, kind = MODELS[name]
    L = L_BUDGET if variant == "budget40" else L_DEFAULT
    try:
        torch.manual_seed(0)
        base = builder(L).float().eval()
    except Exception as e:  # noqa: BLE001
        res["status"] = "skip"
        res["why"] = f"build failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return res
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters())
    res["param_bytes"] = nbytes
    res["n_params"] = sum(1 for _ in base.parameters())
    budget = None
    SEED["train"] = variant in ("train", "recompute")
    if variant == "recompute":
        OFFLOAD_KW["recompute"] = True
    if variant == "budget40":
        budget = int(0.4 * nbytes)
        OFFLOAD_KW["gpu_budget"] = budget
        if name in UNIT:
            OFFLOAD_KW["unit"] = UNIT[name]
            res["unit"] = UNIT[name]
        try:
            ramtorch.offload(copy.deepcopy(base), **OFFLOAD_KW)
        except ValueError as e:
            m = re.search(r"needs at least ([\d.]+) (B|KiB|MiB|GiB)", str(e))
            if not m:
                raise
            mult = {"B": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]
            budget = int(float(m.group(1)) * mult * 1.05) + 64
            OFFLOAD_KW["gpu_budget"] = budget
        # pass the budget as a size string, as the README shows ("93.4KiB"), to exercise parsing too
        OFFLOAD_KW["gpu_budget"] = f"{budget / 1024:.1f}KiB"
        res["budget_arg"] = OFFLOAD_KW["gpu_budget"]
        res["budget_frac"] = round(budget / nbytes, 3)
    st = ramtorch.stats(ramtorch.offload(copy.deepcopy(base), **OFFLOAD_KW))
    res["plan"] = {k: st[k] for k in ("units", "resident_units", "streamed_units")}

    def check(cname, fn):
        t0 = time.time()
        try:
            v = fn()
            res["checks"][cname] = {"ok": True, "maxabs": v, "s": round(time.time() - t0, 2)}
        except CheckFail as e:
            res["checks"][cname] = {"ok": False, "msg": str(e)[:600]}
        except Exception:  # noqa: BLE001
            tb = traceback.format_exc().strip().splitlines()
            res["checks"][cname] = {"ok": False, "exc": True, "msg": "\n".join(tb[-6:])[:1500]}

    state = {}

    def fwd_grads():
        ref, ours = make_pair(base, variant, budget)
        res["ties"] = tied_report(ref, ours)
        x1, x2 = inputs(kind, 2, 1), inputs(kind, 3, 2)
        SEED["n"] = 1
        with torch.no_grad():
            d = close(output(call(ref, x1)), output(call(ours, x1)), "forward")
        state["pair"] = (ref, ours, x1, x2)
        return d

    def grad1():
        ref, ours, x1, x2 = state["pair"]
        SEED["n"] = 2
        loss_of(ref, x1).backward()
        loss_of(ours, x1).backward()
        res["none_grads_1"] = [n for n, p in ref.named_parameters() if p.grad is None]
        return compare_grads(ref, ours, "one backward")

    def accum():
        ref, ours, x1, x2 = state["pair"]
        SEED["n"] = 3
        loss_of(ours, x2).backward()
        loss_of(ref, x2).backward()
        res["none_grads_2"] = [n for n, p in ref.named_parameters() if p.grad is None]
        d = compare_grads(ref, ours, "accumulated backward (plain accumulates too)")
        if samples_independent(kind) and variant not in ("train", "recompute"):
            ref.zero_grad(set_to_none=True)
            both = {k: torch.cat([x1[k], x2[k]]) for k in x1}
            loss_of(ref, both).backward()
            d = max(d, compare_grads(ref, ours, "accumulated backward (vs concatenated batch)"))
        return d

    check("forward", fwd_grads)
    if "pair" in state:
        check("grad1", grad1)
        check("accum", accum)
    state.clear()

    def tuple_out():
        ref, ours = make_pair(base, variant, budget)
        x = inputs(kind, 2, 5)
        SEED["n"] = 5
        a, b = call(ref, x, return_dict=False), call(ours, x, return_dict=False)
        if type(a) is not type(b):
            raise CheckFail(f"return_dict=False: {type(a).__name__} vs {type(b).__name__}")
        d = close(output(a), output(b), "tuple forward")
        w = torch.randn(output(a).shape[1:], generator=torch.Generator().manual_seed(7)).to(DEV)
        (output(a) * w).square().sum().backward()
        (output(b) * w).square().sum().backward()
        return max(d, compare_grads(ref, ours, "tuple backward"))

    check("tuple", tuple_out)
    check("adamw_ropt", lambda: adamw_check(base, kind, variant, budget, "ropt"))
    check("adamw_torch", lambda: adamw_check(base, kind, variant, budget, "torch"))
    res["status"] = (
        "pass" if all(c["ok"] for c in res["checks"].values()) and len(res["checks"]) == 6 else "fail"
    )
    return res


# ----------------------------------------------------------------------------- driver side


def run_one(name, variant):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (HERE, env.get("PYTHONPATH", "")) if x)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RAMTORCH_SMALL_PARAM_BYTES", None)
    if variant == "small0":
        env["RAMTORCH_SMALL_PARAM_BYTES"] = "0"
    t0 = time.time()
    try:
        p = subprocess.run(
            [sys.executable, __file__, "--child", name, variant],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return {"arch": name, "variant": variant, "status": "fail", "why": f"timeout {CHILD_TIMEOUT}s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["wall"] = round(time.time() - t0, 1)
            return r
    return {
        "arch": name,
        "variant": variant,
        "status": "fail",
        "why": f"child rc={p.returncode}: " + "\n".join(p.stderr.strip().splitlines()[-8:]),
    }


def summarize(r):
    if r["status"] == "pass":
        worst = max(c["maxabs"] for c in r["checks"].values())
        extra = f" budget={r['budget_frac']:.0%}" if "budget_frac" in r else ""
        return f"pass (max|d|={worst:.2g}{extra})"
    if r["status"] == "skip":
        return "skip: " + r["why"]
    if "why" in r:
        return "FAIL: " + r["why"].splitlines()[-1][:200]
    bad = [f"{k}: {c['msg'].splitlines()[-1][:220]}" for k, c in r["checks"].items() if not c["ok"]]
    return "FAIL " + " | ".join(bad)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2)
    ap.add_argument("--only")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="arch-sweep.json", help="JSON list of the results")
    ap.add_argument("--report", nargs="+", help="print the table of these result files (merged)")
    a = ap.parse_args()
    if a.report:
        results = [r for f in a.report for r in json.load(open(f))]
        w = max(len(r["arch"]) for r in results)
        for r in results:
            print(f"{r['arch']:<{w}}  {r['variant']:<8}  {summarize(r)}")
        return
    if a.child:
        sys.path.insert(0, HERE)
        try:
            r = run_child(*a.child)
        except Exception:  # noqa: BLE001
            r = {
                "arch": a.child[0],
                "variant": a.child[1],
                "status": "fail",
                "why": traceback.format_exc()[-1500:],
            }
        print("RESULT " + json.dumps(r, default=str), flush=True)
        return
    sys.path.insert(0, HERE)
    from arch_zoo import MODELS

    names = a.only.split(",") if a.only else list(MODELS)
    jobs = [(n, v) for n in names for v in a.variants.split(",")]
    from concurrent.futures import ThreadPoolExecutor, as_completed

    w = max(len(n) for n in names)
    results = []
    with ThreadPoolExecutor(a.jobs) as ex:
        for fut in as_completed([ex.submit(run_one, *nv) for nv in jobs]):
            r = fut.result()
            results.append(r)
            print(f"{r['arch']:<{w}}  {r['variant']:<8}  {summarize(r)}", flush=True)
            with open(a.out, "w") as f:  # (rewritten as results come: a run cut short keeps them)
                json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
