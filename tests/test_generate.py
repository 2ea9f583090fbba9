"""Generation with transformers' causal LMs under ramtorch.offload: same tokens and scores as the
resident model (greedy), with a budget that keeps part of the model resident, and with the KV cache
in host RAM on a GPU."""

from __future__ import annotations

import copy

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


@pytest.mark.gpu
def test_generation_with_weights_and_kv_cache_in_host_ram():
    ref = tiny_llama().to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    ref.cuda()
    ramtorch.offload(ours, device="cuda")
    ids = torch.randint(0, 97, (2, 9), device="cuda")
    seq_ref, _ = greedy(ref, ids)
    seq, _ = greedy(ours, ids, cache_implementation="offloaded")
    assert torch.equal(seq, seq_ref)


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
