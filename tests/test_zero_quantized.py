"""ZeRO-1 and ZeRO-2 (gloo, CPU) on QLoRA: frozen torchao int8 base weights with trainable peft LoRA
adapters, offloaded. Two ranks, each with half of the global batch, train like one process on the
global batch, with the quantized weights in private or shared host memory."""

from __future__ import annotations

import datetime
import io
import os
import warnings

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import exit_rank, free_port
from torch import nn

pytest.importorskip("torchao")
pytest.importorskip("peft")

STEPS = 3
WORLD = 2


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def qlora() -> nn.Module:
    """Int8 weight-only base (the input projection stays plain, frozen too) with LoRA adapters on
    the blocks' linears, initialised at random so the adapters change the output from the start."""
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    m = Net()
    quantize_(
        m, Int8WeightOnlyConfig(), filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "inp"
    )
    cfg = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["lin"], lora_dropout=0.0, init_lora_weights=False
    )
    return peft.get_peft_model(m, cfg)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]


def frozen(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Copies of the frozen weights, quantized ones by their inner tensors."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            names = p.__tensor_flatten__()[0] if hasattr(p, "__tensor_flatten__") else []
            out[name] = [getattr(p, n).detach().clone() for n in names] or [p.detach().clone()]
    return out


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    """Trains on each rank's share of every global batch; each rank's loss is its share of the
    global mean, so the averaged gradients are those of the global batch. Returns the losses."""
    losses = []
    for x, y in batches():
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = F.cross_entropy(model(xs), ys, reduction="sum") / x.shape[0]
        (loss * world).backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses


def reference() -> dict:
    """One process training the same offloaded QLoRA model on the global batch."""
    model = ramtorch.offload(qlora(), device="cpu")
    before = frozen(model)
    opt = ropt.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses = train(model, opt, 0, 1)
    ramtorch.synchronize()
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "lora": lora, "before": before, "after": frozen(model)}


def worker(rank: int, world: int, port: int, out: str, stage: int, share: bool, budget: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        # With a budget every unit fits and stays resident: its parameters are ordinary tensors
        # of the compute device (here the CPU), shared by share_parameters one by one.
        model = ramtorch.offload(qlora(), device="cpu", gpu_budget=budget)
        before = frozen(model)
        if share:
            from ramtorch.distributed import share_parameters

            share_parameters(model)
        opt = ropt.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        opt.shard(stage=stage)
        losses = train(model, opt, rank, world)
        ramtorch.synchronize()
        result = {
            "losses": losses,
            "lora": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            "before": before,
            "after": frozen(model),
            "owned": sum(1 for p in model.parameters() if opt.state.get(p)),
            "types": {n: type(p).__name__ for n, p in model.named_parameters()},
            "resident": [u.resident for u in model._ramtorch_streamer.units],
        }
        if share:
            # The quantized weights' inner tensors are shared: what one rank writes, the other
            # reads. And the state dict still saves (each tensor its own storage).
            torch.save(model.state_dict(), io.BytesIO())
            w = model.base_model.model.blocks[1].lin.base_layer.weight
            dist.barrier()
            if rank == 0:
                w.qdata.neg_()
                w.scale.mul_(2)
            dist.barrier()
            result["seen"] = [w.qdata.clone(), w.scale.clone()]
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # rank 0 hosts the rendezvous store: nobody tears down while it is in use
    finally:
        dist.destroy_process_group()
    exit_rank()


@pytest.mark.parametrize(
    ("stage", "share", "budget"), [(1, False, None), (2, False, None), (2, True, None), (1, True, "1GiB")]
)
def test_zero_qlora_equals_one_process_on_the_global_batch(tmp_path, stage, share, budget):
    out = str(tmp_path / "q")
    mp.spawn(worker, args=(WORLD, free_port(), out, stage, share, budget), nprocs=WORLD, join=True)
    ref = reference()
    results = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    assert len(ref["lora"]) == 6  # A and B of the three blocks' linears
    for res in results:
        assert res["lora"].keys() == ref["lora"].keys()
        for name, a in ref["lora"].items():
            torch.testing.assert_close(res["lora"][name], a, rtol=1e-5, atol=1e-6, msg=name)
        # The quantized weights stayed quantized, and the frozen weights are as they were.
        assert sum(t == "Int8Tensor" for t in res["types"].values()) == 4, res["types"]
        assert res["after"].keys() == ref["before"].keys()
        for name, ts in ref["before"].items():
            for a, b, c in zip(ts, res["before"][name], res["after"][name]):
                assert torch.equal(a, b) and torch.equal(a, c), name
    # Each rank's loss is its share of the global batch's: they add up to the one process's.
    for s in range(STEPS):
        torch.testing.assert_close(
            sum(r["losses"][s] for r in results), ref["losses"][s], rtol=1e-5, atol=1e-6
        )
    owned = [r["owned"] for r in results]
    assert sum(owned) == len(ref["lora"]) and all(n > 0 for n in owned)  # states are partitioned
    assert all(all(r["resident"]) == (budget is not None) for r in results)
    if share:
        qdata, scale = ref["before"]["base_model.model.blocks.1.lin.base_layer.weight"][:2]
        for r in results:
            assert torch.equal(r["seen"][0], -qdata) and torch.equal(r["seen"][1], 2 * scale)


def refusing_worker(rank: int, world: int, port: int, out: str) -> None:
    """share_parameters on models it must refuse, then on one it can share: every rank raises the
    same error, naming the parameter, and the ranks stay in step."""
    from ramtorch.distributed import share_parameters
    from test_quantized import Opaque

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        errors = []
        opaque = qlora()
        lin = opaque.base_model.model.blocks[2].lin.base_layer
        lin.weight = nn.Parameter(Opaque(lin.weight.dequantize()), requires_grad=False)
        trainable = qlora()
        trainable.base_model.model.blocks[0].lin.base_layer.weight.requires_grad_(True)
        differs = qlora()
        if rank == 1:  # launched without quantizing one layer
            lin = differs.base_model.model.out
            lin.weight = nn.Parameter(lin.weight.dequantize(), requires_grad=False)
        for model in (opaque, trainable, differs):
            try:
                share_parameters(model)
                errors.append("no error")
            except (TypeError, ValueError) as e:
                errors.append(f"{type(e).__name__}: {e}")
        share_parameters(qlora())
        torch.save(errors, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()


def test_share_parameters_refuses_subclasses_it_cannot_share_by_name(tmp_path):
    out = str(tmp_path / "e")
    mp.spawn(refusing_worker, args=(WORLD, free_port(), out), nprocs=WORLD, join=True)
    for r in range(WORLD):
        opaque, trainable, differs = torch.load(f"{out}.{r}")
        assert opaque.startswith("TypeError: ramtorch.distributed.share_parameters: parameter ")
        assert "blocks.2.lin.base_layer.weight" in opaque and "Opaque" in opaque, opaque
        assert trainable.startswith("ValueError: ramtorch.distributed.share_parameters: parameter ")
        assert "blocks.0.lin.base_layer.weight" in trainable and "requires grad" in trainable, trainable
        assert differs.startswith("ValueError: share_parameters: the model of rank 1 differs"), differs
        assert "out.weight" in differs and "Int8Tensor of" in differs and "plain tensor" in differs, differs
