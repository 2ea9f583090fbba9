"""Generation with transformers' causal LMs under ramtorch.offload: same tokens and scores as the
resident model (greedy), with a budget that keeps part of the model resident, and with the KV cache
in host RAM on a GPU."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import ramtorch
import torch
from conftest import greedy

transformers = pytest.importorskip("transformers")


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=128,
        initializer_range=0.2,  # a random model that does not repeat one token forever
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("budget", [None, 600_000])
def test_greedy_generation_matches_the_resident_model(budget):
    ref = tiny_llama()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, gpu_budget=budget, device="cpu")
    ids = torch.randint(0, 97, (3, 9))
    seq_ref, scores_ref = greedy(ref, ids)
    seq, scores = greedy(ours, ids)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(scores, scores_ref, rtol=1e-5, atol=1e-5)
    assert len(set(seq[0, 9:].tolist())) > 1  # the check is not vacuous
    s = ours._ramtorch_streamer.stats()
    assert s["prefetch_hits"] > 0  # decode steps follow the learned itinerary


def _transformers_version() -> tuple[int, int]:
    return tuple(int(x) for x in transformers.__version__.split(".")[:2])  # type: ignore[return-value]


@pytest.mark.gpu
def test_generation_with_weights_and_kv_cache_in_host_ram():
    """Same tokens as the resident model with the KV cache in host RAM, where transformers' cache
    is sound (5.20 on); before, ramtorch refuses it with a clear error."""
    ref = tiny_llama().to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    ref.cuda()
    ramtorch.offload(ours, device="cuda")
    ids = torch.randint(0, 97, (2, 9), device="cuda")
    seq_ref, _ = greedy(ref, ids)
    if _transformers_version() < (5, 20):
        with pytest.raises(RuntimeError, match="stream race"):
            greedy(ours, ids, cache_implementation="offloaded")
        return
    seq, _ = greedy(ours, ids, cache_implementation="offloaded")
    assert torch.equal(seq, seq_ref)


class _FakeOffloadedCache:
    offloading = True
    prefetch_stream = None


class _TakesCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, past_key_values: object = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("version, refused", [("4.57.6", True), ("5.17.0", True), ("5.20.0", False)])
def test_a_kv_cache_in_host_ram_that_streaming_would_corrupt_is_refused(monkeypatch, version, refused):
    """transformers before 5.20 prefetches host-RAM KV cache layers without waiting for earlier
    copies back to the host: under streaming that corrupts the cache silently, so it is refused."""
    # transformers may have replaced its module object in sys.modules, where ramtorch looks
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    model = ramtorch.offload(_TakesCache(), device="cpu")
    x = torch.randn(2, 4)
    if refused:
        with pytest.raises(RuntimeError, match=r"transformers .* 5\.20"):
            model(x, past_key_values=_FakeOffloadedCache())
    else:
        model(x, past_key_values=_FakeOffloadedCache())
    model(x, past_key_values=object())  # any other cache, or none, is left alone
    model(x)


_BITWISE = """
import copy, torch, transformers, ramtorch
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
    num_attention_heads=16, num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256)
ref = transformers.LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
ours = copy.deepcopy(ref)
ref.cuda()
per_layer = sum(p.numel() * 2 for p in ref.model.layers[0].parameters())
fixed = sum(p.numel() * 2 for n, p in ref.named_parameters() if ".layers." not in n)
ramtorch.offload(ours, gpu_budget=fixed + 4 * per_layer, device="cuda", progress=False)
st = ours._ramtorch_streamer.stats()
assert st["streamed_units"] >= 3, st
ids = torch.randint(3, 4096, (4, 100), device="cuda")

@torch.no_grad()
def forced(model, tokens):
    out = model(ids, past_key_values=transformers.DynamicCache(), use_cache=True)
    rows = [out.logits[:, -1]]
    for k in range(tokens.shape[1]):
        out = model(tokens[:, k : k + 1], past_key_values=out.past_key_values, use_cache=True)
        rows.append(out.logits[:, -1])
    return torch.stack(rows).cpu()

tokens = torch.randint(3, 4096, (4, 12), device="cuda")
want = forced(ref, tokens)
for _ in range(2):
    got = forced(ours, tokens)
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())
print("bitwise equal")
"""


@pytest.mark.gpu
def test_streamed_logits_are_bitwise_the_resident_models_with_deterministic_kernels():
    """With deterministic kernels, an offloaded model that streams part of its layers computes
    exactly the resident model's logits, prefill and decode steps (the same inputs: teacher
    forcing). Without them, cuBLAS and attention kernels may round differently from run to run."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    r = subprocess.run([sys.executable, "-c", _BITWISE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bitwise equal" in r.stdout


def test_an_offloaded_transformers_model_reports_its_compute_device():
    """``PreTrainedModel.device`` reads the first parameter, which lives in host RAM once
    offloaded; generate() would move its inputs there. The offloaded model reports the device it
    computes on instead, stays an instance of its class, and gets the class back when detached."""
    from ramtorch._offload import detach_streamer

    model = tiny_llama()
    cls = type(model)
    ramtorch.offload(model, device="cpu")
    assert isinstance(model, cls) and type(model).__name__ == cls.__name__
    streamer = model._ramtorch_streamer
    real = streamer.device
    streamer.device = torch.device("meta")  # stands in for a GPU: what model.device reports
    try:
        assert model.device == torch.device("meta")
    finally:
        streamer.device = real
    assert next(model.parameters()).device.type == "cpu"
    detach_streamer(model)
    assert type(model) is cls
    assert model.device == torch.device("cpu")


# -- passes of one generate() take each other's copies; edits between calls are seen ------------


def _data_mul(m: torch.nn.Module) -> None:
    for layer in m.model.layers[1:3]:
        layer.mlp.up_proj.weight.data.mul_(-1.5)  # in place through .data: no version counter moves


def _data_assign(m: torch.nn.Module) -> None:
    w = m.model.layers[2].self_attn.q_proj.weight
    w.data = w.data.flip(0).contiguous()  # another storage under the same parameter


def _copy(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.down_proj.weight.copy_(layer.mlp.down_proj.weight.roll(1, 0))


def _replace(m: torch.nn.Module) -> None:
    mlp = m.model.layers[1].mlp
    mlp.gate_proj.weight = torch.nn.Parameter(mlp.gate_proj.weight.detach().flip(1).contiguous())


GENERATE_EDITS = {"data_mul": _data_mul, "data_assign": _data_assign, "copy": _copy, "replace": _replace}


@pytest.mark.parametrize("budget", [None, 600_000])
@pytest.mark.parametrize("edit", list(GENERATE_EDITS))
def test_an_edit_between_generate_calls_is_seen(edit, budget):
    """generate() trusts the copies of its own passes, never those of a pass before it: an edit
    between two calls, even one no version counter sees, is what the second call computes with."""
    ref = tiny_llama()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, gpu_budget=budget, device="cpu")
    ids = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    before, _ = greedy(ref, ids)
    assert torch.equal(greedy(ours, ids)[0], before)
    for m in (ref, ours):
        GENERATE_EDITS[edit](m)
    seq_ref, scores_ref = greedy(ref, ids)
    seq, scores = greedy(ours, ids)
    assert not torch.equal(seq_ref, before)  # the edit changes what is generated
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(scores, scores_ref, rtol=1e-5, atol=1e-5)


class _Watch(transformers.LogitsProcessor):
    """Records, after each pass of a generate(), the copies prefetched for the next pass; with
    ``edit``, applies it to the model (between two passes of the same generate)."""

    def __init__(self, model: torch.nn.Module, edit=None) -> None:
        self.model = model
        self.edit = edit
        self.ahead: list[int] = []
        self.calls = 0

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        streamer = getattr(self.model, "_ramtorch_streamer", None)
        if streamer is not None:
            self.ahead.append(len(streamer.ahead))
        if self.edit is not None and self.calls == 4:
            self.edit(self.model)
        return scores


def test_generate_prefetches_across_its_passes_by_default():
    """Inside generate() the end of each pass after the first copies the next pass's first units
    (with no promise from the caller); the prefill does not (a one-token generate has no next
    pass), what is left prefetched when generate() returns is given back, and passes outside
    generate() copy afresh, with nothing prefetched across."""
    ref = tiny_llama()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    streamer = ours._ramtorch_streamer
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        ours(ids)
    assert not streamer.ahead
    hits, wasted = ramtorch.stats(ours)["prefetch_hits"], ramtorch.stats(ours)["prefetch_wasted"]
    watch = _Watch(ours)
    seq, scores = greedy(ours, ids, logits_processor=transformers.LogitsProcessorList([watch]))
    seq_ref, scores_ref = greedy(ref, ids)
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(scores, scores_ref, rtol=1e-5, atol=1e-5)
    assert watch.ahead[0] == 0 and len(watch.ahead) == 16
    assert all(n == streamer.max_inflight for n in watch.ahead[1:]), watch.ahead
    st = ramtorch.stats(ours)
    units = st["streamed_units"]
    # Every unit of the 15 passes after the prefill is found prefetched (the prefill's first units
    # too, copied at its start); only the last pass's look-ahead is given back unused.
    assert st["prefetch_hits"] - hits >= 15 * units
    assert st["prefetch_wasted"] - wasted == streamer.max_inflight
    assert not streamer.ahead and streamer.span is None
    with torch.no_grad():
        ours(ids)
    assert not streamer.ahead


def test_each_decode_step_copies_each_streamed_unit_once():
    """The bytes a generate() of ``n`` tokens copies: ``n`` passes of the streamed units (the
    prefill's copied at its start, each decode step's prefetched along the last pass), and the
    look-ahead of its last pass, given back unused when it returns. So ``n`` more tokens copy
    exactly ``n`` passes more, whatever the units' sizes (layers, embedding, head, norm)."""
    ours = tiny_llama()
    ramtorch.offload(ours, device="cpu")
    streamer = ours._ramtorch_streamer
    ids = torch.randint(0, 97, (2, 9))

    def moved() -> int:
        # Bytes copied, and bytes a slot still held from an earlier copy of the same unit (the
        # engine then copies nothing: how often depends on the slots other models made it keep).
        dev = ramtorch.stats()["devices"]["cpu"]
        return dev["h2d_bytes"] + dev["reused_bytes"]

    def gen(n: int) -> dict[str, int]:
        before = {**ramtorch.stats(ours), "h2d_bytes": moved()}
        ours.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)  # fmt: skip
        after = {**ramtorch.stats(ours), "h2d_bytes": moved()}
        keys = ("h2d_bytes", "passes", "prefetches", "prefetch_hits", "prefetch_wasted")
        return {k: after[k] - before[k] for k in keys}

    gen(3)  # the itinerary is learned
    st = ramtorch.stats(ours)
    per_pass, units = st["streamed_bytes_per_pass"], st["streamed_units"]
    assert len({u.nbytes for u in streamer.streamed}) > 1  # units of different sizes share the slots
    by_name = {u.name: u for u in streamer.streamed}
    look = sum(by_name[name].nbytes for name in st["itinerary"][: streamer.max_inflight])
    two, ten = gen(2), gen(10)
    for n, got in ((2, two), (10, ten)):
        assert got["passes"] == n
        assert got["h2d_bytes"] == n * per_pass + look, (n, got, per_pass, look)
        assert got["prefetch_wasted"] == streamer.max_inflight, (n, got)
        assert got["prefetch_hits"] == n * units, (n, got)
    assert ten["h2d_bytes"] - two["h2d_bytes"] == 8 * per_pass


@pytest.mark.parametrize("how", ["copy", "data_assign", "replace"])
def test_an_edit_torch_sees_inside_generate_is_seen_by_the_next_pass(how):
    """Between two passes of one generate() (a logits processor, a stopping criterion), edits that
    torch records are seen: a version counter moved (``p.copy_()``, ``p.mul_()`` under no_grad),
    another storage set as ``.data``, a parameter replaced on its module."""
    ref = tiny_llama()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    ids = torch.randint(0, 97, (2, 9))
    edit = GENERATE_EDITS[how]
    unedited, _ = greedy(ref, ids)
    outs = []
    for m in (ref, ours):
        watch = _Watch(m, edit)
        outs.append(greedy(m, ids, logits_processor=transformers.LogitsProcessorList([watch])))
    (seq_ref, scores_ref), (seq, scores) = outs
    assert not torch.equal(seq_ref, unedited)  # the edit inside generate() changed the tokens
    assert torch.equal(seq, seq_ref)
    torch.testing.assert_close(scores, scores_ref, rtol=1e-5, atol=1e-5)


def test_training_steps_between_generate_calls_are_unaffected():
    """A training step (forward with gradients, backward, optimizer step) between two generate()
    calls trains as the plain model does, and the next generate() computes with the new weights."""
    ref = tiny_llama()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    ids = torch.randint(0, 97, (2, 9))
    opts = [torch.optim.SGD(ref.parameters(), lr=0.5), ramtorch.optim.SGD(ours.parameters(), lr=0.5)]
    for _ in range(2):
        outs = [greedy(m, ids) for m in (ref, ours)]
        assert torch.equal(outs[1][0], outs[0][0])
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)
        losses = []
        for m, opt in zip((ref, ours), opts):
            m.train()
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            m.eval()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        assert not ours._ramtorch_streamer.ahead  # nothing prefetched across a training pass
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
