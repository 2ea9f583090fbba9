"""One model over several devices (``offload(model, devices=[...], micro_batches=n)``).

Without GPUs, the stages run on the host device (``"cpu"`` may repeat in ``devices``: every stage
streams through the host engine with a streamer of its own), which runs the split, the hand-off
between stages, the stage passes and the relay's threads and turns as on GPUs. What the host
cannot show, two devices computing at once, follows from the issue order, which is checked here
against the schedule (:func:`relay`, a pure function tested exhaustively). The GPU test at the end
checks two real devices against one (skipped with fewer than two GPUs)."""

from __future__ import annotations

import copy
import itertools

import pytest
import ramtorch
import ramtorch.optim
import torch
from conftest import Net, tiny_llama_config
from ramtorch import _offload
from ramtorch._stream.pipeline import combine, relay, split_batch, split_stages
from torch import nn

# -- the split and the schedule --------------------------------------------------------------------


def _cuts(n: int, stages: int) -> list[list[int]]:
    """Every cut of ``n`` units into ``stages`` contiguous non-empty stages (stage of each unit)."""
    out = []
    for ends in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *ends, n]
        out.append([s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])])
    return out


def test_split_stages_is_the_best_contiguous_cut_for_every_small_case():
    for n in range(1, 7):
        for costs in itertools.product([0, 1, 2, 5], repeat=n):
            for stages in range(1, n + 1):
                got = split_stages(list(costs), stages)
                assert got in _cuts(n, stages), (costs, stages, got)

                def largest(cut: list[int], costs=costs, stages=stages) -> int:
                    return max(sum(c for c, s in zip(costs, cut) if s == k) for k in range(stages))

                best = min(largest(c) for c in _cuts(n, stages))
                assert largest(got) == best, (costs, stages, got)


def test_split_stages_balances_blocks_and_refuses_too_few_units():
    assert split_stages([4, 4, 4, 4], 2) == [0, 0, 1, 1]
    assert split_stages([10] + [1] * 10, 2) == [0] + [1] * 10
    assert split_stages([1, 8, 8, 8, 8, 1], 2) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="3 units cannot fill 4 stages"):
        split_stages([1, 1, 1], 4)


def test_relay_every_task_once_at_its_tick_for_every_small_case():
    for stages in range(1, 6):
        for micro in range(1, 7):
            ticks = relay(stages, micro)
            assert len(ticks) == stages + micro - 1
            seen = [task for tick in ticks for task in tick]
            assert sorted(seen) == [(s, t) for s in range(stages) for t in range(micro)]
            for k, tick in enumerate(ticks):
                assert all(s + t == k for s, t in tick)
                assert len({s for s, _ in tick}) == len(tick)  # a stage runs one micro-batch a tick
                assert [s for s, _ in tick] == sorted((s for s, _ in tick), reverse=True)  # oldest first


def _expected_issue(stage_units: list[list[str]], micro: int) -> list[tuple[int, int, str]]:
    """The order the host should issue unit forwards in: the relay's ticks, the tasks of a tick
    taking turns one unit each (deepest stage first)."""
    out = []
    for tick in relay(len(stage_units), micro):
        queues = [(s, t, list(stage_units[s])) for s, t in tick]
        while any(q for _, _, q in queues):
            for s, t, q in queues:
                if q:
                    out.append((s, t, q.pop(0)))
    return out


@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (2, 4), (3, 3), (3, 1)])
def test_issue_order_follows_the_relay(stages, micro):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)])
    ramtorch.offload(model, devices=["cpu"] * stages, micro_batches=micro)
    pipe = model._ramtorch_pipeline
    stage_units = [[u.name for u in st.units] for st in pipe.streamers]
    assert [len(x) for x in stage_units] == [6 // stages] * stages
    pipe.issued = []
    with torch.no_grad():
        model(torch.randn(2 * micro, 6))
    assert pipe.issued == _expected_issue(stage_units, micro)
    if stages > 1 and micro > 1:
        # The host alternates between stages: micro-batch 1's stage 0 runs between micro-batch 0's
        # units of stage 1 (not after them, as a relay of whole stages would).
        first = [k for k, (s, t, _) in enumerate(pipe.issued) if (s, t) == (1, 0)]
        other = [k for k, (s, t, _) in enumerate(pipe.issued) if (s, t) == (0, 1)]
        assert first[0] < other[0] < first[-1]


# -- results equal plain torch and one device -----------------------------------------------------------


def _train(model: nn.Module, opt_cls, xs: list[torch.Tensor]) -> tuple[list, list, dict]:
    opt = opt_cls(model.parameters(), lr=1e-2)
    outs, grads = [], []
    for x in xs:
        y = model(x)
        outs.append(y.detach().clone())
        y.square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return outs, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("opt_cls", [ramtorch.optim.AdamW, torch.optim.AdamW], ids=["ramtorch", "torch"])
def test_two_stages_train_bitwise_as_plain_torch_and_one_device(opt_cls):
    torch.manual_seed(0)
    plain = Net(d=16, layers=4)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 8, generator=g) for _ in range(3)]
    ref = _train(copy.deepcopy(plain), opt_cls, xs)
    one = _train(ramtorch.offload(copy.deepcopy(plain), device="cpu"), opt_cls, xs)
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"])
    stages = [[u.name for u in st.units] for st in model._ramtorch_pipeline.streamers]
    assert stages == [["inp", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "out"]]
    two = _train(model, opt_cls, xs)
    for got in (one, two):
        for a, b in zip(got[0], ref[0]):
            assert torch.equal(a, b)
        for ga, gb in zip(got[1], ref[1]):
            assert all(torch.equal(a, b) for a, b in zip(ga, gb))
        assert all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])


@pytest.mark.parametrize("opt_cls", [ramtorch.optim.AdamW, torch.optim.AdamW], ids=["ramtorch", "torch"])
def test_micro_batches_train_as_plain_torch(opt_cls):
    torch.manual_seed(0)
    plain = Net(d=16, layers=4)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 8, generator=g) for _ in range(3)]
    ref = _train(copy.deepcopy(plain), opt_cls, xs)
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"], micro_batches=3)
    got = _train(model, opt_cls, xs)
    for a, b in zip(got[0], ref[0]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    for ga, gb in zip(got[1], ref[1]):
        assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(ga, gb))
    assert all(torch.allclose(got[2][k], ref[2][k], atol=1e-5, rtol=1e-4) for k in ref[2])


@pytest.mark.parametrize("recompute", [False, True])
def test_budget_per_device_and_recompute_over_stages(recompute):
    torch.manual_seed(0)
    plain = Net(d=32, layers=6)
    unit = max(sum(p.numel() * 4 for p in b.parameters()) for b in plain.blocks)
    # Per device: two slots of a block and the small units resident, whatever the other stage holds.
    budget = 2 * unit + unit // 2
    model = ramtorch.offload(
        copy.deepcopy(plain),
        gpu_budget=budget,
        devices=["cpu", "cpu"],
        micro_batches=2,
        recompute=recompute,
    )
    stats = ramtorch.stats(model)["stages"]
    assert all(st["gpu_budget"] == budget and st["gpu_bytes"] <= budget for st in stats)
    assert [st["resident_units"] for st in stats] == [["inp"], ["out"]]
    assert [(st["streamed_units"], st["slot_count"]) for st in stats] == [(3, 2), (3, 2)]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g) for _ in range(2)]
    got = _train(model, ramtorch.optim.AdamW, xs)
    ref = _train(copy.deepcopy(plain), ramtorch.optim.AdamW, xs)
    # Before any step, only the micro-batches' products round unlike the whole batch's (a CPU's
    # matmul may block rows of 2 and of 4 differently: 2e-7 here on an AVX-512 host).
    assert torch.allclose(got[0][0], ref[0][0], atol=1e-6, rtol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(got[1][0], ref[1][0]))
    # After a step the outputs come from weights that agree as closely as the states below do.
    for a, b in zip(got[0][1:], ref[0][1:]):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)
    # (AdamW divides by the gradient's running scale: where a gradient is near zero, the rounding
    # of the micro-batches' sum moves the step by up to a fraction of the learning rate, 1e-2, and
    # the next gradients with it.)
    assert all(torch.allclose(got[2][k], ref[2][k], atol=1e-3) for k in ref[2])


def test_micro_batches_forward_is_bitwise_the_micro_batches_forwards():
    torch.manual_seed(0)
    plain = Net(d=16, layers=4)
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu", "cpu"], micro_batches=2)
    x = torch.randn(7, 8)
    with torch.no_grad():
        got = model(x)
        want = torch.cat([plain(x[:4]), plain(x[4:])])
    assert torch.equal(got, want)


def test_llama_micro_batches_loss_logits_and_gradients():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4))
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"], micro_batches=2)
    stages = [[u.name for u in st.units] for st in model._ramtorch_pipeline.streamers]
    assert stages[0][0] == "model.embed_tokens" and stages[-1][-1] == "lm_head"
    ids = torch.randint(0, plain.config.vocab_size, (4, 12))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    ref = plain(input_ids=ids, labels=ids, use_cache=False)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5, rtol=1e-4)
    assert torch.allclose(out.loss, ref.loss, atol=1e-6, rtol=1e-5)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name
    with pytest.raises(ValueError, match="DynamicCache that differs between micro-batches.*use_cache=False"):
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)


def test_generate_over_two_stages_equals_plain():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4)).eval()
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"])
    ids = torch.randint(0, plain.config.vocab_size, (2, 5))
    mask = torch.ones_like(ids)
    want = plain.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("error", [ArithmeticError, KeyboardInterrupt])
@pytest.mark.parametrize("micro", [1, 2])
def test_error_in_one_micro_batch_reaches_the_caller_and_the_model_runs_again(error, micro):
    # A KeyboardInterrupt skips the units' forward hooks (torch runs them on Exceptions only): the
    # unit it cut short is undone on its own thread, and the next pass begins as after Ctrl-C.
    class Fails(nn.Linear):
        armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed and bool((x > 1e3).any()):
                raise error("a micro-batch's own error")
            return super().forward(x)

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Fails(4, 4), nn.Linear(4, 4))
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"], micro_batches=micro)
    model[2].armed = True
    x = torch.randn(4, 4)
    bad = x.clone()
    bad[3] = 1e6  # the last micro-batch fails in stage 1, while the one before ran ahead
    with pytest.raises(error, match="own error"):
        model(bad).sum().backward()
    y = model(x)
    assert torch.allclose(y, plain(x), atol=1e-6)
    y.sum().backward()
    plain(x).sum().backward()
    assert all(
        torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), plain.parameters())
    )


def test_relays_from_two_threads_give_each_its_own_results():
    import threading

    torch.manual_seed(0)
    plains = [Net(d=16, layers=4), Net(d=16, layers=4)]
    models = [ramtorch.offload(copy.deepcopy(p), devices=["cpu", "cpu"], micro_batches=2) for p in plains]
    xs = [torch.randn(4, 8), torch.randn(4, 8)]
    got: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            with torch.no_grad():
                for _ in range(5):
                    got[k].append(models[k](xs[k]))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in range(2):
        with torch.no_grad():
            want = torch.cat([plains[k](xs[k][:2]), plains[k](xs[k][2:])])
        assert all(torch.equal(y, want) for y in got[k])


def test_a_thread_acting_for_another_shares_its_forward_lock():
    import threading

    from ramtorch import _engine

    lock = _engine.ForwardLock()
    main = threading.current_thread()
    lock.acquire("main")
    seen = []

    def delegate() -> None:
        with _engine.acting_for(main):
            seen.append(_engine.acting_thread() is main)
            seen.append(lock.mine())
            if lock.mine():  # (else the acquire would wait for the main thread, which joins this one)
                lock.acquire("delegate")  # the caller's lock: taken at once
                lock.release("delegate")
        seen.append(_engine.acting_thread() is threading.current_thread())

    t = threading.Thread(target=delegate)
    t.start()
    t.join()
    assert seen == [True, True, True] and lock.mine()  # (the main thread's token is still held)
    lock.release("main")
    assert not lock.mine()


@pytest.mark.parametrize("micro", [1, 2])
def test_relay_of_several_calls_is_one_relay_with_each_call_s_results(micro):
    torch.manual_seed(0)
    plain = Net(d=16, layers=4)
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"], micro_batches=micro)
    pipe = model._ramtorch_pipeline
    xs = [torch.randn(4, 8) for _ in range(3)]
    pipe.issued = []
    with torch.no_grad():
        outs = ramtorch.relay(model, [xs[0], (xs[1],), ((), {"x": xs[2]})])
        assert len(outs) == 3
        for x, y in zip(xs, outs):
            want = plain(x) if micro == 1 else torch.cat([plain(x[:2]), plain(x[2:])])
            assert torch.equal(y, want)
    stage_units = [[u.name for u in st.units] for st in pipe.streamers]
    assert pipe.issued == _expected_issue(stage_units, 3 * micro)  # the calls' micro-batches in one relay


def test_relay_of_calls_with_gradients():
    torch.manual_seed(0)
    plain = Net(d=16, layers=4)
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"], micro_batches=2)
    xs = [torch.randn(4, 8) for _ in range(2)]
    outs = ramtorch.relay(model, [(x,) for x in xs])
    sum(y.square().mean() for y in outs).backward()
    sum(plain(x).square().mean() for x in xs).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    last = model._ramtorch_pipeline.streamers[-1]
    assert len(last.bwd_itin) >= 2 * len(last.units)  # a call's micro-batches one after the other


def test_relay_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="not offloaded over several devices"):
        ramtorch.relay(ramtorch.offload(Net(d=8, layers=2), device="cpu"), [torch.randn(2, 8)])
    model = ramtorch.offload(Net(d=8, layers=2), devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="calls must be a list"):
        ramtorch.relay(model, torch.randn(2, 8))
    with pytest.raises(TypeError, match="call 1 is a str"):
        ramtorch.relay(model, [torch.randn(2, 8), "x"])


def test_grad_mode_and_autocast_reach_the_micro_batches():
    torch.manual_seed(0)
    plain = Net(d=16, layers=2)
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"], micro_batches=2)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert not model(x).requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        want = torch.cat([plain(x[:2]), plain(x[2:])])
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


def test_compiled_pipeline_runs_eagerly_with_the_same_results():
    torch.manual_seed(0)
    plain = Net(d=16, layers=2)
    model = torch.compile(ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"], micro_batches=2))
    x = torch.randn(4, 8)
    y = model(x)
    assert torch.equal(y, torch.cat([plain(x[:2]), plain(x[2:])]))
    y.sum().backward()
    plain(x).sum().backward()
    assert all(
        torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), plain.parameters())
    )


# -- what is refused, by name --------------------------------------------------------------------------


def test_bad_arguments_are_named():
    net = Net(d=8, layers=2)
    with pytest.raises(ValueError, match="device= or devices="):
        ramtorch.offload(net, device="cpu", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"devices=\[\] names no device"):
        ramtorch.offload(net, devices=[])
    with pytest.raises(TypeError, match="devices must be a list"):
        ramtorch.offload(net, devices="cpu")
    with pytest.raises(ValueError, match="'tpu:0' is not a device"):
        ramtorch.offload(net, devices=["cpu", "tpu:0"])
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        ramtorch.offload(net, devices=["cpu", "cpu"], micro_batches=0)
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        ramtorch.offload(net, devices=["cpu", "cpu"], micro_batches=True)
    with pytest.raises(ValueError, match="micro_batches=2 needs devices"):
        ramtorch.offload(net, micro_batches=2)
    with pytest.raises(ValueError, match="does not support links, compress"):
        ramtorch.offload(net, devices=["cpu", "cpu"], links=2, compress="fp8")
    with pytest.raises(ValueError, match='gpu_budget="auto"'):
        ramtorch.offload(net, devices=["cpu", "cpu"], gpu_budget="auto")
    with pytest.raises(ValueError, match="4 units cannot fill 5 stages"):
        ramtorch.offload(net, devices=["cpu"] * 5)
    assert getattr(net, "_ramtorch_streamer", None) is None  # nothing was changed


def test_repeated_or_mixed_cuda_devices_are_refused(monkeypatch):
    # Devices as this machine would have them with GPUs: the check runs on the names.
    monkeypatch.setattr(_offload._engine, "normalize_device", lambda d: torch.device(d))
    net = Net(d=8, layers=2)
    with pytest.raises(ValueError, match="name cuda:1 twice"):
        ramtorch.offload(net, devices=["cuda:0", "cuda:1", "cuda:1"])
    with pytest.raises(ValueError, match="mix the CPU and CUDA"):
        ramtorch.offload(net, devices=["cuda:0", "cpu"])


def test_batches_that_cannot_be_split_are_named():
    model = ramtorch.offload(Net(d=8, layers=2), devices=["cpu", "cpu"], micro_batches=3)
    with pytest.raises(ValueError, match="batch .2 on dim 0.* cannot be split into 3"):
        model(torch.randn(2, 8))

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) + bias)

    two = ramtorch.offload(Two(), devices=["cpu", "cpu"], micro_batches=2)
    with pytest.raises(ValueError, match=r"argument bias has shape \(3, 4\) while the batch is 4"):
        two(torch.randn(4, 4), bias=torch.randn(3, 4))
    y = two(torch.randn(4, 4), bias=torch.randn(1, 4))  # a dim 0 of 1 is broadcast
    assert y.shape == (4, 4)


def test_outputs_that_cannot_be_joined_are_named():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)).reshape(-1)

    model = ramtorch.offload(Flat(), devices=["cpu", "cpu"], micro_batches=2)
    with pytest.raises(ValueError, match=r"shape \(8,\) for a micro-batch of 2"):
        model(torch.randn(4, 4))


def test_tied_weights_across_stages_are_refused():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    with pytest.raises(ValueError, match="'emb.weight' is used by modules of stages \\[0, 1\\]"):
        ramtorch.offload(Tied(), devices=["cpu", "cpu"])


def test_a_tensor_handed_to_every_unit_of_a_stage_crosses_once():
    from ramtorch._stream.pipeline import to_device

    meta = torch.device("meta")  # (another device than the CPU's, on any machine)
    table, x = torch.randn(3, 4), torch.randn(2, 4)
    moved: dict = {}
    a = to_device(((x,), {"table": table}), meta, moved)
    b = to_device(((x,), {"table": table}), meta, moved)
    assert a[1]["table"].device == meta and b[1]["table"] is a[1]["table"] and b[0][0] is a[0][0]
    table.add_(1)  # written: moved again
    c = to_device({"table": table}, meta, moved)
    assert c["table"] is not a[1]["table"]
    assert to_device({"table": table}, meta)["table"] is not c["table"]  # no cache: every time


def test_split_batch_and_combine():
    x, y = torch.arange(10).reshape(5, 2), torch.ones(1, 3)
    parts, sizes = split_batch((x,), {"y": y, "n": 3}, 2)
    assert sizes == [3, 2]
    assert torch.equal(parts[0][0][0], x[:3]) and parts[1][1]["y"] is y and parts[1][1]["n"] == 3
    joined = combine(
        [{"a": torch.ones(3), "l": torch.tensor(1.0)}, {"a": torch.zeros(2), "l": torch.tensor(4.0)}], sizes
    )
    assert torch.equal(joined["a"], torch.tensor([1.0, 1, 1, 0, 0]))
    assert torch.allclose(joined["l"], torch.tensor((3 * 1.0 + 2 * 4.0) / 5))


def test_last_stage_runs_the_micro_batches_backwards_one_after_the_other():
    # GPipe's order: the last stage's backward runs micro-batch by micro-batch (newest first), so
    # the first micro-batch's gradient reaches the stage before while the last stage runs the
    # next; each run of the last stage's units is on its backward itinerary, and prefetched.
    torch.manual_seed(0)
    plain = Net(d=16, layers=4)
    for micro in (2, 3):
        model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"], micro_batches=micro)
        x = torch.randn(6, 8)
        for _ in range(3):
            model(x).square().mean().backward()
        last = model._ramtorch_pipeline.streamers[-1]
        assert [last.by_uid[k].name for k in last.bwd_itin] == ["out", "blocks.3", "blocks.2"] * micro
        assert last.counters["prefetch_hits"] > 0
        for p in model.parameters():
            p.grad = None
        model(x).square().mean().backward()
        plain.zero_grad()
        plain(x).square().mean().backward()
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5)


# -- reporting ------------------------------------------------------------------------------------------


def test_stats_show_each_stage():
    model = ramtorch.offload(Net(d=8, layers=4), devices=["cpu", "cpu"], micro_batches=2)
    model(torch.randn(4, 8))
    s = ramtorch.stats(model)
    assert s["pipeline_devices"] == ["cpu", "cpu"] and s["micro_batches"] == 2
    assert [st["pipeline_stage"] for st in s["stages"]] == [0, 1]
    assert [st["itinerary"] for st in s["stages"]] == [
        ["inp", "blocks.0", "blocks.1"],
        ["blocks.2", "blocks.3", "out"],
    ]
    assert [st["passes"] for st in s["stages"]] == [2, 2]  # one pass a micro-batch


def test_weights_unchanged_covers_every_stage():
    torch.manual_seed(0)
    plain = Net(d=16, layers=4)
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cpu", "cpu"], micro_batches=2)
    x = torch.randn(4, 8)
    with torch.no_grad(), ramtorch.weights_unchanged(model):
        assert all(st.unchanged == 1 for st in model._ramtorch_pipeline.streamers)
        for _ in range(2):
            assert torch.equal(model(x), torch.cat([plain(x[:2]), plain(x[2:])]))
    assert all(st.unchanged == 0 for st in model._ramtorch_pipeline.streamers)


def test_plan_shows_the_stages_offload_cuts(capsys):
    from ramtorch.__main__ import main
    from ramtorch.plan import predict

    with torch.device("meta"):
        meta = Net(d=8, layers=4)
    pred = predict(meta, None, 16, devices=2)
    model = ramtorch.offload(Net(d=8, layers=4), devices=["cpu", "cpu"])
    assert pred.stages == [[u.name for u in st.units] for st in model._ramtorch_pipeline.streamers]
    assert pred.stage_bytes == [sum(u.nbytes for u in st.units) for st in model._ramtorch_pipeline.streamers]
    assert "pipeline over 2 devices" in pred.summary() and "stage 1: 3 units" in pred.summary()
    assert predict(meta, None, 16).stages == []
    with pytest.raises(ValueError, match="devices must be a positive int"):
        predict(meta, None, 16, devices=0)
    assert main(["plan", "--model", "conftest:Net", "--devices", "3"]) == 0
    out = capsys.readouterr().out
    assert "pipeline over 3 devices" in out and "stage 2:" in out


def _bench(monkeypatch):
    """``bench/pipeline.py`` as a module (its directory on the path, for ``benchlib``)."""
    import importlib.util
    from pathlib import Path

    here = Path(__file__).resolve().parent.parent / "bench"
    monkeypatch.syspath_prepend(str(here))
    spec = importlib.util.spec_from_file_location("bench_pipeline", here / "pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--micro-batches", "2", "16"], r"--micro-batches \[16\]: each must be between 1 and --batch \(8\)"),
        (["--gpus", "2"], r"--gpus \[2\] must include 1"),
        (["--gpus", "1", "1"], "must be distinct"),
        (["--batch", "0"], "--batch and --seq must be at least 1"),
        (["--reps", "0"], "--reps must be at least 1"),
        (["--layers", "1", "--smoke"], "--layers 1 cannot fill 2 stages"),
        (["--phases", "decode"], "invalid choice: 'decode'"),
        (["--calls", "0"], "--calls must be at least 1"),
    ],
)
def test_bench_arguments_are_checked(monkeypatch, capsys, argv, message):
    bench = _bench(monkeypatch)
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--out", "x.json", *argv])
    assert e.value.code == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_bench_arguments_defaults_and_gpu_count(monkeypatch, capsys):
    bench = _bench(monkeypatch)
    a = bench.parse_args(["--out", "x.json", "--smoke"])
    assert (a.gpus, a.micro_batches, a.batch, a.seq, a.layers) == ([1, 2], [2, 4, 8], 8, 2048, 32)
    assert a.calls == [1, 4]
    assert a.phases == ["forward", "forward_backward", "step"] and a.budget is None
    assert bench.parse_args(["--out", "x", "--smoke", "--budget", "24GiB"]).budget == "24GiB"
    if torch.cuda.device_count() < 2:
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", "x.json"])
        assert "needs 2 CUDA devices" in capsys.readouterr().err


# -- two GPUs -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("micro", [1, 2])
def test_two_gpus_train_as_one(micro):
    torch.manual_seed(0)
    plain = Net(d=64, layers=6)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 8, generator=g).to("cuda:0") for _ in range(3)]
    one = _train(ramtorch.offload(copy.deepcopy(plain), device="cuda:0"), ramtorch.optim.AdamW, xs)
    model = ramtorch.offload(copy.deepcopy(plain), devices=["cuda:0", "cuda:1"], micro_batches=micro)
    assert [st.device.index for st in model._ramtorch_pipeline.streamers] == [0, 1]
    two = _train(model, ramtorch.optim.AdamW, xs)
    assert two[0][0].device == torch.device("cuda:1")  # outputs on the last device
    for a, b in zip(two[0], one[0]):
        assert torch.allclose(a.to(b.device), b, atol=1e-5, rtol=1e-4)
    for ga, gb in zip(two[1], one[1]):
        assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(ga, gb))
    for k in one[2]:
        assert torch.allclose(two[2][k].to(one[2][k].device), one[2][k], atol=1e-5, rtol=1e-4), k


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_llama_relay_and_training_match_one():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4)).to(torch.bfloat16)
    one = ramtorch.offload(copy.deepcopy(plain), device="cuda:0")
    two = ramtorch.offload(copy.deepcopy(plain), devices=["cuda:0", "cuda:1"], micro_batches=2)
    ids = [torch.randint(0, plain.config.vocab_size, (4, 16), device="cuda:0") for _ in range(3)]
    with torch.no_grad():
        want = [one(input_ids=x, use_cache=False).logits for x in ids]
        got = ramtorch.relay(two, [{"input_ids": x, "use_cache": False} for x in ids])
    for g, w in zip(got, want):
        assert g.device == torch.device("cuda:1")
        assert torch.allclose(g.float().cpu(), w.float().cpu(), atol=2e-2, rtol=2e-2)
    opts = [ramtorch.optim.AdamW(m.parameters(), lr=1e-3) for m in (one, two)]
    for x in ids[:2]:
        losses = []
        for m, opt in zip((one, two), opts):
            loss = m(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        assert abs(losses[0] - losses[1]) < 2e-2
    for (name, p), q in zip(two.named_parameters(), one.parameters()):
        assert torch.allclose(p.float().cpu(), q.float().cpu(), atol=2e-2, rtol=2e-2), name
