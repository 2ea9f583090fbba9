"""GPU: weights edited between passes (through ``param.data``, PEFT's merge) are what the next pass
computes with, while the GPU still runs the previous pass's kernels; each pass streams its units
once."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import ramtorch
import torch
from conftest import Net
from ramtorch import _engine
from torch import nn

pytestmark = pytest.mark.gpu


def _x(seed: int) -> torch.Tensor:
    return torch.randn(64, 8, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("budget", [None, "resident"])
def test_data_edits_between_passes_are_seen_on_the_gpu(budget: str | None) -> None:
    torch.manual_seed(0)
    plain = Net(d=512, layers=6).cuda()
    block = sum(p.numel() * 4 for p in plain.blocks[0].parameters())
    gpu_budget = None if budget is None else int(4.5 * block)
    streamed = ramtorch.offload(copy.deepcopy(plain).cpu(), gpu_budget=gpu_budget, device="cuda")
    with torch.no_grad():
        for k in range(6):
            # No synchronisation: the edit lands while the last pass's kernels may still run.
            out = streamed(_x(k))
            torch.testing.assert_close(out, plain(_x(k)), rtol=1e-5, atol=1e-5)
            for m in (plain, streamed):
                for p in m.parameters():
                    p.data.mul_(0.9)
                w = m.blocks[k % 6].up.weight
                w.data = torch.full_like(w.data, k / 100)  # a new tensor where the weight lives


def _peft_pair(peft: Any, base: nn.Module, config: Any) -> tuple[nn.Module, nn.Module]:
    """``base`` under ``config``: resident on the GPU, and offloaded to it with the same weights."""
    torch.manual_seed(1)
    plain = peft.get_peft_model(copy.deepcopy(base), config).cuda()
    torch.manual_seed(1)
    streamed = peft.get_peft_model(copy.deepcopy(base), config)
    streamed.load_state_dict(plain.state_dict())
    ramtorch.offload(streamed, device="cuda")
    return plain, streamed


def test_peft_merge_and_unload_on_the_gpu() -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = Net(d=256, layers=4)
    config = peft.LoraConfig(target_modules=["up", "down"], r=8, init_lora_weights=False)
    plain, streamed = _peft_pair(peft, base, config)
    with torch.no_grad():
        for k in range(2):
            torch.testing.assert_close(streamed(_x(k)), plain(_x(k)), rtol=1e-5, atol=1e-5)
        plain_merged, streamed_merged = plain.merge_and_unload(), streamed.merge_and_unload()
        for k in range(2, 4):
            torch.testing.assert_close(streamed_merged(_x(k)), plain_merged(_x(k)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tuner", ["dora", "ia3"])
def test_peft_tuners_train_and_merge_on_the_gpu(tuner: str) -> None:
    """DoRA's magnitudes and IA3's scales stay on the GPU while the base weights stream; their
    merges combine them with the base weight, which lives in host RAM (DoRA divides by its norm,
    IA3 multiplies): merging runs with the layer's own parameters there
    (``_AdaptersOnBaseDevice``) and puts them back after."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = Net(d=256, layers=4)
    if tuner == "ia3":
        config = peft.IA3Config(
            target_modules=["up", "down"], feedforward_modules=["down"], init_ia3_weights=False
        )
    else:
        config = peft.LoraConfig(target_modules=["up", "down"], r=2, init_lora_weights=False, use_dora=True)
    plain, streamed = _peft_pair(peft, base, config)
    train = [p for p in streamed.parameters() if p.requires_grad]
    assert any(p.is_cuda for p in train)
    opts = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (plain, streamed)
    ]
    for k in range(3):
        for m, opt in zip((plain, streamed), opts):
            m(_x(k)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    devices = [p.device for p in train]
    with torch.no_grad():
        torch.testing.assert_close(streamed(_x(3)), plain(_x(3)), rtol=1e-4, atol=1e-5)
        for m in (plain, streamed):
            m.base_model.merge_adapter()
        torch.testing.assert_close(streamed(_x(4)), plain(_x(4)), rtol=1e-4, atol=1e-5)
        for m in (plain, streamed):
            m.base_model.unmerge_adapter()
        assert [p.device for p in train] == devices
        torch.testing.assert_close(streamed(_x(5)), plain(_x(5)), rtol=1e-4, atol=1e-5)
        plain_merged, streamed_merged = plain.merge_and_unload(), streamed.merge_and_unload()
        torch.testing.assert_close(streamed_merged(_x(6)), plain_merged(_x(6)), rtol=1e-4, atol=1e-5)


def test_each_inference_pass_streams_its_units_once() -> None:
    torch.manual_seed(0)
    model = ramtorch.offload(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]), device="cuda")
    per_pass = sum(p.numel() * p.element_size() for p in model.parameters() if _engine.is_streamed(p))
    assert per_pass == 8 * 1024 * 1024 * 4  # the weights (the biases stay on the device)
    x = torch.randn(16, 1024, device="cuda")
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        before = ramtorch.stats()["devices"]["cuda:0"]["h2d_bytes"]
        for _ in range(4):
            model(x)
        torch.cuda.synchronize()
        assert ramtorch.stats()["devices"]["cuda:0"]["h2d_bytes"] - before == 4 * per_pass


def test_generate_prefetches_across_passes_and_sees_edits_between_calls_on_the_gpu() -> None:
    """On the GPU, with no promise from the caller: the decode passes of a generate() find their
    first units prefetched (copied during the previous pass's last kernels), each decode step
    copies no more than the streamed bytes of one pass, and a ``.data`` edit between two
    generate() calls, made while the GPU may still run the last one's kernels, is seen."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    plain = transformers.LlamaForCausalLM(cfg).eval()
    streamed = copy.deepcopy(plain)
    plain.cuda()
    ramtorch.offload(streamed, device="cuda")
    streamer = streamed._ramtorch_streamer
    ids = torch.randint(0, 512, (2, 12), device="cuda")
    ahead: list[int] = []

    class Watch(transformers.LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            ahead.append(len(streamer.ahead))
            return scores

    def gen(m: nn.Module, n: int, **kw: object) -> torch.Tensor:
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, **kw)  # fmt: skip
        return out

    def h2d() -> int:
        return ramtorch.stats()["devices"]["cuda:0"]["h2d_bytes"]

    for _ in range(2):
        want = gen(plain, 8)
        ahead.clear()
        got = gen(streamed, 8, logits_processor=transformers.LogitsProcessorList([Watch()]))
        assert torch.equal(got, want)
        assert ahead[0] == 0 and all(n > 0 for n in ahead[1:]), ahead
        for m in (plain, streamed):
            for layer in m.model.layers[::2]:
                layer.mlp.up_proj.weight.data.mul_(-1.25)  # no synchronisation before the edit
    per_pass = ramtorch.stats(streamed)["streamed_bytes_per_pass"]

    def copied(n: int) -> int:
        torch.cuda.synchronize()
        before = h2d()
        gen(streamed, n)
        torch.cuda.synchronize()
        return h2d() - before

    # Each call also copies, at its last pass's end, a look-ahead for a next pass that never comes
    # (given back when generate() returns): the same bytes for both calls, so their difference is
    # what the 8 extra decode steps copied, each unit once at most.
    two, ten = copied(2), copied(10)
    assert ten - two <= 8 * per_pass, (two, ten, per_pass)


def test_an_edit_right_after_a_forward_returns_does_not_reach_it_on_the_gpu() -> None:
    """The host queues a pass's copies ahead of the device, and its end waits for those still
    reading host weights: a forward whose units each compute longer than they copy returns with
    the device still on its last units, and an edit of every weight made at once through
    ``.data`` reaches neither the output nor a copy of that pass still queued."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(12)]).cuda()
    for m in plain:
        nn.init.normal_(m.weight, std=2048**-0.5)  # outputs of the order of one at every depth
    streamed = ramtorch.offload(copy.deepcopy(plain).cpu(), device="cuda")
    x = torch.randn(16384, 2048, device="cuda")
    with torch.no_grad():
        want = plain(x)
        for _ in range(2):
            streamed(x)  # the itinerary is learned: the next pass copies ahead along it
        torch.cuda.synchronize()
        out = streamed(x)
        for p in streamed.parameters():  # no synchronisation: the device is still computing
            p.data.zero_()
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(streamed(x), torch.zeros_like(want))


@pytest.mark.parametrize("budget", [None, "resident"])
def test_a_deep_copy_on_the_gpu_is_a_model_of_its_own(budget: str | None) -> None:
    """``copy.deepcopy`` of a model streaming to the GPU, some units resident: the copy computes
    what a copy of the plain model does, on the GPU, and trains apart from the original (an EMA
    model through ``AveragedModel`` follows torch's)."""
    torch.manual_seed(0)
    plain = Net(d=512, layers=6).cuda()
    block = sum(p.numel() * 4 for p in plain.blocks[0].parameters())
    gpu_budget = None if budget is None else int(4.5 * block)
    ours = ramtorch.offload(copy.deepcopy(plain).cpu(), gpu_budget=gpu_budget, device="cuda")
    ema = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    avg_plain = torch.optim.swa_utils.AveragedModel(plain, multi_avg_fn=ema)
    avg_ours = torch.optim.swa_utils.AveragedModel(ours, multi_avg_fn=ema)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, ours)]
    for k in range(3):
        for m, o in zip((plain, ours), opts):
            o.zero_grad()
            m(_x(k)).pow(2).mean().backward()
            o.step()
        avg_plain.update_parameters(plain)
        avg_ours.update_parameters(ours)
    mine, theirs = copy.deepcopy(ours), copy.deepcopy(plain)
    with torch.no_grad():
        torch.testing.assert_close(mine(_x(7)), theirs(_x(7)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(avg_ours(_x(8)), avg_plain(_x(8)), rtol=1e-5, atol=1e-5)
        for p in mine.parameters():
            p.data.mul_(0.5)
        torch.testing.assert_close(ours(_x(9)), plain(_x(9)), rtol=1e-5, atol=1e-5)
