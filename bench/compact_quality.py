"""Quality of ``precision="compact"`` (8-bit moments, bf16 weight + bf16 compensation) against the
default fp32-master AdamW, on the demo's byte-level transformer LM (``examples/demo.py``) with bf16
weights, on the CPU (``--workload minilm``: a MiniLM-shaped BERT fine-tuned on a synthetic
classification task instead; ``--workload minilm-mlm``: the same model trained as a masked LM on
text from a fixed Markov chain, whose loss falls smoothly; ``--device cuda`` runs the model on a
GPU, the optimizer's updates staying on the host).

Both runs start from the same initial weights and see the same batches (same seeds); the only
difference is the optimizer's state format. The byte LM's corpus is this checkout's own source
files (``demo.load_corpus``), which change from commit to commit: compare the two formats within
one run, not runs of different commits (each byte LM record names its corpus by size and
SHA-256), or fix the corpus with ``--corpus-rev REV`` (the same files as ``load_corpus`` would
read from a checkout of ``REV``, from git). Reported: the training loss of every step, the mean of
the last 50 steps, and the loss on 16 held-out batches at the end. Writes a JSON list of records
(one per optimizer) and an SVG plot of both curves::

    python bench/compact_quality.py --steps 500 --out bench/results/2026-12-01-compact-quality

This is a benchmark (it reports numbers); ``tests/test_optim_compact.py`` holds the assertions.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import demo  # noqa: E402  (examples/demo.py: the corpus, batches and model)
import ramtorch  # noqa: E402
import ramtorch.optim  # noqa: E402

LAST = 50  # steps averaged for the final training loss
EVAL_BATCHES = 16

OPTIMIZERS = {
    "fp32-master": "ramtorch.optim.AdamW(fp32 master, speculative)",
    "compact": "ramtorch.optim.AdamW(8-bit moments, bf16+compensation, speculative)",
}


def train(
    opt: torch.optim.Optimizer,
    steps: int,
    lr_at: Callable[[int], float],
    step_loss: Callable[[], torch.Tensor],
) -> tuple[list[float], float]:
    """``steps`` optimizer steps, each on ``step_loss()`` at learning rate ``lr_at(step)``;
    returns every step's loss and the seconds the steps took (their updates landed)."""
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = step_loss()
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ramtorch.synchronize()
    return losses, time.perf_counter() - t0


def run(precision: str, args: argparse.Namespace, data: torch.Tensor) -> dict[str, object]:
    """Trains one model with ``precision``; returns its record."""
    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    model = demo.ByteLM(args.d_model, args.layers, args.heads, args.seq, device).to(torch.bfloat16)
    ramtorch.offload(model, device=device)
    opt = ramtorch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), precision=precision
    )
    gen = torch.Generator().manual_seed(args.seed)
    warmup = max(1, min(30, args.steps // 10))

    def step_loss() -> torch.Tensor:
        x, y = demo.get_batch(data, args.batch, args.seq, device, gen)
        return F.cross_entropy(model(x).float().view(-1, demo.VOCAB), y.reshape(-1))

    losses, seconds = train(opt, args.steps, lambda k: demo.lr_at(k, args.steps, args.lr, warmup), step_loss)
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        held_out = []
        for _ in range(EVAL_BATCHES):
            x, y = demo.get_batch(data, args.batch, args.seq, device, eval_gen)
            held_out.append(F.cross_entropy(model(x).float().view(-1, demo.VOCAB), y.reshape(-1)).item())
    state_bytes = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for k, t in st.items()
        if k != "step" and isinstance(t, torch.Tensor)
    )
    params = sum(p.numel() for p in model.parameters())
    return {
        "workload": "demo-bytelm",
        "phase": "quality",
        "system": "ramtorch",
        "device": "cpu",
        "optimizer": OPTIMIZERS[precision],
        "precision": precision,
        "params": params,
        "weights": "bfloat16",
        "steps": args.steps,
        "final_train_loss": sum(losses[-LAST:]) / min(LAST, len(losses)),
        "held_out_loss": sum(held_out) / len(held_out),
        "optimizer_state_bytes_per_param": state_bytes / params,
        "seconds": seconds,
        "losses": losses,
    }


def minilm_config(**overrides: object) -> object:
    """The shape of MiniLM-L6 (``transformers.BertConfig``): 6 layers, hidden 384, 12 heads, FFN
    1536, vocabulary 30522."""
    from transformers import BertConfig

    kw: dict = dict(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
    )
    return BertConfig(**{**kw, **overrides})


#: ``--pretrain-steps``: the weights each seed's pretraining ended with (both optimizers start
#: from them), so that it runs once a seed and process.
_PRETRAINED: dict[tuple[int, int], dict[str, torch.Tensor]] = {}


def pretrained_minilm(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The starting weights of ``--pretrain-steps``: the randomly initialised model of ``--seed``
    trained that many steps with torch's AdamW (fp32, lr 1e-4 after a warm-up of a tenth) on
    another rule of the same kind (the weighting of seed 8 instead of 7), then cast to bf16. Meant
    to start the fine-tune from features that already tell the tokens apart, so that its loss
    would not sit near ln 2 and then drop at a step that varies from run to run. At seed 0 it did
    not help: both optimizers sat near 0.68 for 450 of 500 steps and one of them broke away in the
    last 50 (``BENCHMARKS.md``)."""
    from transformers import BertForSequenceClassification

    key = (args.seed, args.pretrain_steps)
    if key in _PRETRAINED:
        return _PRETRAINED[key]
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification(minilm_config(num_labels=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    rule = torch.randn(args.task_vocab, generator=torch.Generator().manual_seed(8))
    gen = torch.Generator().manual_seed(args.seed + 1000)
    warmup = max(1, args.pretrain_steps // 10)
    t0 = time.perf_counter()
    for step in range(args.pretrain_steps):
        for group in opt.param_groups:
            group["lr"] = 1e-4 * min(1.0, (step + 1) / warmup)
        ids = torch.randint(0, args.task_vocab, (args.batch, args.seq), generator=gen)
        loss = F.cross_entropy(model(input_ids=ids).logits, (rule[ids].sum(1) > 0).long())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    took = time.perf_counter() - t0
    print(f"pretrained {args.pretrain_steps} steps in {took:.0f} s (last loss {loss.item():.4f})", flush=True)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    _PRETRAINED[key] = state
    return state


def run_minilm(precision: str, args: argparse.Namespace) -> dict[str, object]:
    """A MiniLM-shaped BERT (``transformers.BertConfig``: 6 layers, hidden 384, 12 heads, FFN
    1536, vocabulary 30522; random initialisation, or ``--pretrain-steps`` of pretraining:
    :func:`pretrained_minilm`) with bf16 weights, fine-tuned for sequence classification on a
    synthetic task: a sequence of token ids drawn from the first ``--task-vocab`` is labelled by
    the sign of a fixed random weighting of its tokens (a bag-of-words rule the model can learn
    from scratch: the fewer ids, the more often each one's embedding is trained). The learning
    rate (``--minilm-lr``) warms up linearly over the first tenth of the steps. Returns its
    record."""
    from transformers import BertForSequenceClassification

    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification(minilm_config(num_labels=2)).to(torch.bfloat16)
    if args.pretrain_steps:
        model.load_state_dict(pretrained_minilm(args))
    ramtorch.offload(model, device=device)
    opt = ramtorch.optim.AdamW(model.parameters(), lr=args.minilm_lr, weight_decay=0.01, precision=precision)
    rule = torch.randn(args.task_vocab, generator=torch.Generator().manual_seed(7))
    warmup = max(1, args.steps // 10)

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, args.task_vocab, (args.batch, args.seq), generator=gen)
        return ids, (rule[ids].sum(1) > 0).long()

    gen = torch.Generator().manual_seed(args.seed)

    def step_loss() -> torch.Tensor:
        ids, y = batch(gen)
        return F.cross_entropy(model(input_ids=ids).logits.float(), y)

    losses, seconds = train(opt, args.steps, lambda k: args.minilm_lr * min(1.0, (k + 1) / warmup), step_loss)
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    held_out, correct, total = [], 0, 0
    with torch.no_grad():
        for _ in range(EVAL_BATCHES):
            ids, y = batch(eval_gen)
            logits = model(input_ids=ids).logits.float()
            held_out.append(F.cross_entropy(logits, y).item())
            correct += int((logits.argmax(1) == y).sum())
            total += y.numel()
    return {
        **minilm_record(
            "minilm-synthetic-classification", precision, args, device, model, losses, held_out, seconds
        ),
        "pretrain_steps": args.pretrain_steps,
        "held_out_accuracy": correct / total,
    }


def warmup_cosine(args: argparse.Namespace) -> Callable[[int], float]:
    """The learning rate of step ``k`` for the MiniLM workloads that train from scratch: linear
    warm-up to ``--minilm-lr`` over the first tenth of the steps, then a cosine to a tenth of it."""
    warmup = max(1, args.steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.minilm_lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.minilm_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    return lr_at


def minilm_record(
    workload: str,
    precision: str,
    args: argparse.Namespace,
    device: torch.device,
    model: torch.nn.Module,
    losses: list[float],
    held_out: list[float],
    seconds: float,
) -> dict[str, object]:
    """The record of one run of a MiniLM-shaped workload on ``device``."""
    return {
        "workload": workload,
        "phase": "quality",
        "system": "ramtorch",
        "device": str(device),
        "optimizer": OPTIMIZERS[precision],
        "precision": precision,
        "params": sum(p.numel() for p in model.parameters()),
        "weights": "bfloat16",
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "task_vocab": args.task_vocab,
        "lr": args.minilm_lr,
        "final_train_loss": sum(losses[-LAST:]) / min(LAST, len(losses)),
        "held_out_loss": sum(held_out) / len(held_out),
        "seconds": seconds,
        "losses": losses,
    }


#: ``--workload minilm-mlm``: token ids of the chain's text start here (clear of BERT's special
#: tokens), and masked positions read BERT's ``[MASK]``.
_MLM_FIRST_ID = 1000
_MLM_MASK_ID = 103


def markov_chain(vocab: int) -> torch.Tensor:
    """The fixed text source of ``--workload minilm-mlm``: a (vocab, vocab) matrix of transition
    probabilities, each row a softmax of Gaussian logits of standard deviation 3 (peaked: a few
    likely successors per token), from seed 7."""
    g = torch.Generator().manual_seed(7)
    return torch.softmax(3.0 * torch.randn(vocab, vocab, generator=g), dim=1)


def mlm_batch(
    chain: torch.Tensor, batch: int, seq: int, mask_prob: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` sequences of ``seq`` tokens from ``chain`` (the first drawn uniformly), with
    ``mask_prob`` of the positions replaced by ``[MASK]``: (input ids, labels: the original id at
    masked positions, -100 elsewhere)."""
    vocab = chain.shape[0]
    ids = torch.empty(batch, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(1, seq):
        ids[:, t] = torch.multinomial(chain[ids[:, t - 1]], 1, generator=gen).squeeze(1)
    ids += _MLM_FIRST_ID
    masked = torch.rand(batch, seq, generator=gen) < mask_prob
    return ids.masked_fill(masked, _MLM_MASK_ID), ids.masked_fill(~masked, -100)


def run_minilm_mlm(precision: str, args: argparse.Namespace) -> dict[str, object]:
    """A MiniLM-shaped BERT (:func:`minilm_config`, random initialisation, bf16 weights) trained as
    a masked LM (``transformers.BertForMaskedLM``, its tied decoder) on text from
    :func:`markov_chain` over ``--task-vocab`` ids, ``--mask-prob`` of the positions masked. The
    learning rate (``--minilm-lr``) warms up linearly over the first tenth of the steps and then
    decays along a cosine to a tenth of its peak. Unlike the classification task, whose loss sits
    near ln 2 until a drop at a step that varies from run to run, this loss falls smoothly: the
    final losses of two optimizers can be compared. Returns its record."""
    from transformers import BertForMaskedLM

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = BertForMaskedLM(minilm_config()).to(torch.bfloat16)
    ramtorch.offload(model, device=device)
    opt = ramtorch.optim.AdamW(model.parameters(), lr=args.minilm_lr, weight_decay=0.01, precision=precision)
    chain = markov_chain(args.task_vocab)
    lr_at = warmup_cosine(args)

    def loss_of(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids.to(device)).logits.float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.to(device).view(-1))

    gen = torch.Generator().manual_seed(args.seed)
    losses, seconds = train(
        opt, args.steps, lr_at, lambda: loss_of(*mlm_batch(chain, args.batch, args.seq, args.mask_prob, gen))
    )
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        held_out = [
            loss_of(*mlm_batch(chain, args.batch, args.seq, args.mask_prob, eval_gen)).item()
            for _ in range(4 * EVAL_BATCHES)
        ]
    return {
        **minilm_record("minilm-markov-mlm", precision, args, device, model, losses, held_out, seconds),
        "mask_prob": args.mask_prob,
    }


def run_minilm_distill(
    precision: str, args: argparse.Namespace, rounding_seed: int | None = None
) -> dict[str, object]:
    """A MiniLM-shaped BERT (:func:`minilm_config`, random initialisation of ``--seed``, bf16
    weights) trained to reproduce another one's last hidden states (a teacher of the same shape,
    random initialisation of seed ``--seed`` + 1000, float32, frozen): mean squared error over
    every position of sequences of ``--seq`` ids drawn uniformly from the first ``--task-vocab``.
    A regression onto a fixed continuous target, which the student approaches gradually (it
    learns the teacher's token-wise map first and its attention after), rather than a rule
    learned at a step that varies from run to run. Learning rate (``--minilm-lr``): linear
    warm-up over the first tenth, then a cosine to a tenth of the peak. Returns its record."""
    from transformers import BertModel

    device = torch.device(args.device)
    torch.manual_seed(args.seed + 1000)
    teacher = BertModel(minilm_config(), add_pooling_layer=False).eval().to(device)
    torch.manual_seed(args.seed)
    model = BertModel(minilm_config(), add_pooling_layer=False).to(torch.bfloat16)
    ramtorch.offload(model, device=device)
    opt = ramtorch.optim.AdamW(model.parameters(), lr=args.minilm_lr, weight_decay=0.01, precision=precision)
    if rounding_seed is not None:
        opt._seed = rounding_seed  # the key of the stochastic rounding's random words
    lr_at = warmup_cosine(args)

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(device)
        with torch.no_grad():
            target = teacher(input_ids=ids).last_hidden_state
        return F.mse_loss(model(input_ids=ids).last_hidden_state.float(), target)

    def batch(gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, args.task_vocab, (args.batch, args.seq), generator=gen)

    gen = torch.Generator().manual_seed(args.seed)
    losses, seconds = train(opt, args.steps, lr_at, lambda: loss_of(batch(gen)))
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        held_out = [loss_of(batch(eval_gen)).item() for _ in range(EVAL_BATCHES)]
    r = minilm_record("minilm-distill", precision, args, device, model, losses, held_out, seconds)
    if rounding_seed is not None:
        r["rounding_seed"] = rounding_seed
    return r


def svg(records: list[dict[str, object]], title: str) -> str:
    """A line plot of each record's losses (a 20-step moving average), hand-written SVG."""
    w, h, pad = 720, 420, 60
    curves = []
    for r in records:
        ls = r["losses"]
        assert isinstance(ls, list)
        k = 20
        curves.append(
            [sum(ls[max(0, i - k + 1) : i + 1]) / (i - max(0, i - k + 1) + 1) for i in range(len(ls))]
        )
    n = max(len(c) for c in curves)
    lo = min(min(c) for c in curves)
    hi = max(max(c) for c in curves)
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)

    def xy(i: int, v: float) -> str:
        x = pad + (w - 2 * pad) * i / max(1, n - 1)
        y = h - pad - (h - 2 * pad) * (v - lo) / (hi - lo)
        return f"{x:.1f},{y:.1f}"

    colors = ["#1f77b4", "#d62728", "#2ca02c"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="24" text-anchor="middle" font-size="14">{title}</text>',
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
        f'<text x="{w / 2}" y="{h - 20}" text-anchor="middle">step</text>',
        f'<text x="16" y="{h / 2}" text-anchor="middle" transform="rotate(-90 16 {h / 2})">'
        "training loss (20-step mean)</text>",
    ]
    for t in range(5):
        v = lo + (hi - lo) * t / 4
        y = h - pad - (h - 2 * pad) * t / 4
        out.append(f'<text x="{pad - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.2f}</text>')
        i = round((n - 1) * t / 4)
        x = pad + (w - 2 * pad) * t / 4
        out.append(f'<text x="{x:.1f}" y="{h - pad + 16}" text-anchor="middle">{i}</text>')
    for c, color in zip(curves, colors):
        pts = " ".join(xy(i, v) for i, v in enumerate(c))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>')
    for k, (r, color) in enumerate(zip(records, colors)):
        y = pad + 10 + 18 * k
        label = (
            f"{r['precision']}{' (other rounding)' if 'rounding_seed' in r else ''}: "
            f"last {LAST} steps {r['final_train_loss']:.4f}, held out {r['held_out_loss']:.4f}"
        )
        x0 = w - pad - 330
        out.append(f'<line x1="{x0}" y1="{y}" x2="{x0 + 20}" y2="{y}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{w - pad - 305}" y="{y + 4}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def corpus_at(rev: str) -> torch.Tensor:
    """``demo.load_corpus``'s corpus as a checkout of ``rev`` would give it: the same files (text
    suffixes, no hidden or build directories), in ``os.walk``'s order (a directory's files, then
    its subdirectories, each sorted by name), with the same headers; read from ``git archive``."""
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev], capture_output=True, check=False
    )
    if tar.returncode != 0:
        raise SystemExit(f"--corpus-rev {rev!r}: git archive failed: {tar.stderr.decode().strip()}")
    files: list[tuple[tuple[tuple[int, str], ...], str, bytes]] = []
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        for m in t.getmembers():
            parts = m.name.split("/")
            *dirs, name = parts
            if not m.isfile() or Path(name).suffix not in demo.TEXT_SUFFIXES or name.startswith("."):
                continue
            if any(d.startswith(".") or d in demo.SKIP_DIRS for d in dirs):
                continue
            f = t.extractfile(m)
            if f is None:
                continue
            key = tuple((1, d) for d in dirs) + ((0, name),)
            files.append((key, m.name, f.read()))
    files.sort(key=lambda x: x[0])
    corpus = b"".join(f"\n# ==== {path} ====\n".encode() + data for _, path, data in files)
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8).clone()


def main(argv: list[str] | None = None) -> int:
    """Runs both optimizers, writes ``<out>.json`` and ``<out>.svg``; status 1 if the final losses
    differ by more than 1%."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    workloads = ["bytelm", "minilm", "minilm-mlm", "minilm-distill"]
    p.add_argument("--workload", choices=workloads, default="bytelm")
    p.add_argument("--task-vocab", type=int, default=2000, help="minilm: the ids its sequences draw from")
    p.add_argument("--minilm-lr", type=float, default=1e-4, help="minilm: the peak learning rate")
    p.add_argument(
        "--pretrain-steps", type=int, default=0, help="minilm: steps of pretraining on another rule first"
    )
    p.add_argument("--mask-prob", type=float, default=0.15, help="minilm-mlm: the share of positions masked")
    p.add_argument(
        "--device",
        default="cpu",
        help="minilm-mlm, minilm-distill: the compute device (the updates stay on the host)",
    )
    p.add_argument(
        "--rounding-seed",
        type=int,
        default=None,
        help="minilm-distill: run compact a second time with its stochastic rounding keyed by this seed "
        "(a third record: how far two compact runs that differ only in their random words end apart)",
    )
    p.add_argument(
        "--corpus-rev",
        default=None,
        help="bytelm: read the corpus from this git revision of the repository instead of the working "
        "tree (so that runs of different commits train on the same text)",
    )
    p.add_argument("--out", type=Path, required=True, help="output path without suffix")
    p.add_argument("--commit", default=None, help="the library's commit (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    if args.workload != "bytelm":
        data = torch.empty(0)
    elif args.corpus_rev is not None:
        data = corpus_at(args.corpus_rev)
    else:
        data = demo.load_corpus(ROOT)[0]
    commit = (
        args.commit
        or subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    command = "python bench/compact_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    records = []

    def keep(r: dict[str, object], label: str) -> None:
        """Adds the run's provenance to its record, prints its losses, keeps it."""
        r.update(commit=commit, command=command, threads=torch.get_num_threads())
        if args.workload == "bytelm":
            digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]
            r.update(corpus_bytes=data.numel(), corpus_sha256=digest, corpus_rev=args.corpus_rev)
        print(
            f"{label}: last {LAST} steps {r['final_train_loss']:.4f}, held out {r['held_out_loss']:.4f}, "
            f"{r['seconds']:.0f} s",
            flush=True,
        )
        records.append(r)

    for precision in OPTIMIZERS:
        if args.workload == "bytelm":
            r = run(precision, args, data)
        elif args.workload == "minilm":
            r = run_minilm(precision, args)
        elif args.workload == "minilm-mlm":
            r = run_minilm_mlm(precision, args)
        else:
            r = run_minilm_distill(precision, args)
        keep(r, precision)
    if args.rounding_seed is not None and args.workload == "minilm-distill":
        keep(
            run_minilm_distill("compact", args, args.rounding_seed),
            f"compact, rounding seed {args.rounding_seed}",
        )
    ref, new = records[:2]
    for key in ("final_train_loss", "held_out_loss"):
        rel = (float(new[key]) - float(ref[key])) / float(ref[key])  # type: ignore[arg-type]
        new[f"{key}_rel_diff"] = rel
        print(f"{key}: compact vs fp32-master {rel * 100:+.2f}%")
        for other in records[2:]:
            rel = (float(other[key]) - float(ref[key])) / float(ref[key])  # type: ignore[arg-type]
            other[f"{key}_rel_diff"] = rel
            twin = (float(other[key]) - float(new[key])) / float(new[key])  # type: ignore[arg-type]
            other[f"{key}_rel_diff_to_compact"] = twin
            print(
                f"{key}: compact (other rounding) vs fp32-master {rel * 100:+.2f}%, "
                f"vs compact {twin * 100:+.2f}%"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    what = {
        "bytelm": "byte LM",
        "minilm": "MiniLM-shaped BERT, synthetic classification",
        "minilm-mlm": "MiniLM-shaped BERT, masked LM on a Markov chain",
        "minilm-distill": "MiniLM-shaped BERT distilled from another",
    }[args.workload]
    where = "CPU"
    if args.workload.startswith("minilm-") and args.device != "cpu":
        where = f"{args.device} (updates on the host)"
    title = f"{what}, {ref['params'] / 1e6:.2f} M params, bf16 weights, {where}: AdamW fp32-master vs compact"
    args.out.with_suffix(".svg").write_text(svg(records, title))
    ok = all(abs(float(new[f"{k}_rel_diff"])) <= 0.01 for k in ("final_train_loss",))  # type: ignore[arg-type]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
