"""``python -m ramtorch plan``: predict placement and step time without running the model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from . import plan as _plan


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m ramtorch", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan",
        help="which units stay resident, and the predicted times",
        description="Plans a model as ramtorch.offload would and predicts its pass times, without "
        "running it (the model is built on the meta device). The ceilings' defaults are those "
        "BENCHMARKS.md measured on one H200 (PCIe gen5, 16 host cores); give your machine's.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a transformers config.json (decoder, encoder, encoder-decoder or vision model), "
        "or package.module:factory returning an nn.Module",
    )
    p.add_argument("--budget", default=None, help="GPU budget, e.g. 24GiB (default: stream everything)")
    p.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="tokens per pass: batch x sequence (vision: batch x patches; encoder-decoder: each "
        "stack's) (default: %(default)s)",
    )
    p.add_argument(
        "--unit",
        default=None,
        help="block class name (default: the children of the largest ModuleList, or Sequential of "
        "blocks of one class, and of every other such list outside it)",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="copies in flight (default: RAMTORCH_MAX_INFLIGHT, else 2)",
    )
    c = _plan.Ceilings()
    gb = "(default: %(default)s, measured)"
    p.add_argument("--h2d-gbps", type=float, default=c.h2d_gbps, help=f"pinned host->device GB/s {gb}")
    p.add_argument("--d2h-gbps", type=float, default=c.d2h_gbps, help=f"device->host GB/s {gb}")
    p.add_argument(
        "--links",
        type=int,
        default=c.links,
        help="links into the GPU, each at --h2d-gbps/--d2h-gbps (offload(links=...): its own and "
        "its peers') (default: %(default)s)",
    )
    p.add_argument(
        "--tflops", type=float, default=c.tflops, help="GPU matmul TFLOP/s, peak (default: %(default)s)"
    )
    p.add_argument(
        "--efficiency",
        type=float,
        default=c.efficiency,
        help="fraction of the peak reached (default: %(default)s)",
    )
    p.add_argument(
        "--host-gbps",
        type=float,
        default=c.host_gbps,
        help="optimizer host memory traffic GB/s, the AdamW kernel's (default: %(default)s, measured)",
    )
    p.add_argument(
        "--precision",
        choices=_plan.PRECISIONS,
        default="fp32-master",
        help="ramtorch.optim.AdamW's precision priced for training (default: %(default)s)",
    )
    p.add_argument(
        "--states",
        choices=_plan.STATES,
        default="device",
        help="where the optimizer states of parameters kept on the GPU live (default: %(default)s)",
    )
    p.add_argument(
        "--host-memory",
        default=None,
        help="host RAM to check that training fits in, e.g. 128GiB, or 'auto' for this machine's "
        "(default: not checked)",
    )
    p.add_argument(
        "--host-budget",
        default=None,
        help="host RAM for the streamed units, e.g. 32GiB: the rest on disk, as "
        "offload(host_budget=..., disk=...) places them (default: all in host RAM)",
    )
    p.add_argument("--disk-gbps", type=float, default=c.disk_gbps, help=f"disk sequential read GB/s {gb}")
    p.add_argument(
        "--disk-write-gbps", type=float, default=c.disk_write_gbps, help=f"disk sequential write GB/s {gb}"
    )
    p.add_argument(
        "--optimizer-on-disk",
        action="store_true",
        help="the streamed units' optimizer states on disk, their gradients in the host budget, "
        "as offload(optimizer_on_disk=True) (needs --host-budget)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="plan greedy decoding with a ramtorch.HostCache holding this many tokens: the cache "
        "bytes, what the budget keeps on the GPU (HostCache(device_bytes=...)), the bytes a step "
        "moves and its time",
    )
    p.add_argument("--batch", type=int, default=1, help="--context: sequences decoded together")
    p.add_argument("--page-tokens", type=int, default=256, help="--context: HostCache's page_tokens")
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="show the stages that offload(devices=[...]) cuts the model into over this many devices",
    )
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    a = ap.parse_args(argv)
    try:
        ceilings = _plan.Ceilings(
            a.h2d_gbps,
            a.d2h_gbps,
            a.tflops,
            a.efficiency,
            a.host_gbps,
            a.disk_gbps,
            a.disk_write_gbps,
            a.links,
        )
        model = _plan.build_meta_model(a.model)
        pred = _plan.predict(
            model,
            a.budget,
            a.tokens,
            ceilings,
            unit=a.unit,
            max_inflight=a.max_inflight,
            precision=a.precision,
            states=a.states,
            host_memory=a.host_memory,
            host_budget=a.host_budget,
            optimizer_on_disk=a.optimizer_on_disk,
            devices=a.devices,
        )
        kv = None
        if a.context is not None:
            kv = _plan.plan_kv_cache(pred, model, a.context, a.batch, a.page_tokens, ceilings)
    except (ValueError, TypeError, RuntimeError, OSError, ImportError) as e:
        print(f"ramtorch plan: {e}", file=sys.stderr)
        return 2
    if a.json:
        out = pred.as_dict()
        if kv is not None:
            out["kv_cache"] = dataclasses.asdict(kv)
        print(json.dumps(out, indent=1))
    else:
        print(pred.summary())
        if kv is not None:
            print(_plan.kv_summary(kv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
