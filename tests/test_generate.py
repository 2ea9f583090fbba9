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


def greedy(model: torch.nn.Module, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=16,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kw,
    )
    return out.sequences, torch.stack(out.scores)


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
