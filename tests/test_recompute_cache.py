"""``offload(..., recompute=True)`` on transformers models that fill a key/value cache during a
training pass (``use_cache`` is on by default, in training mode too): the recomputation in
backward must not write the cache a second time (keys appended twice; attention over keys its mask
does not cover; an encoder-decoder's cross-attention read back from the cache instead of
recomputed). Against the plain model: outputs, gradients, and the cache the pass returns. A cache
that already holds the layer's tokens when a recomputed pass begins is refused with a message."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import ramtorch
import torch
from test_arch_models import _decoder
from torch import nn

transformers = pytest.importorskip("transformers")

TOL = 2e-5

#: A decoder with no mask of its own (the doubled keys fell inside the causal window and went
#: unnoticed but for the cache), one with a sliding window, one with ALiBi, and an encoder-decoder.
MODELS: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "qwen3": (_decoder("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=8), False),
    "starcoder2": (
        _decoder("Starcoder2ForCausalLM", "Starcoder2Config", num_key_value_heads=2, sliding_window=3),
        False,
    ),
    "bloom": (
        lambda: transformers.BloomForCausalLM(
            transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
        ),
        False,
    ),
    "bart": (
        lambda: transformers.BartForConditionalGeneration(
            transformers.BartConfig(
                vocab_size=64,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=2,
            )
        ),
        True,
    ),
}


def _inputs(seq2seq: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = {"input_ids": torch.randint(3, 64, (2, 6), generator=g)}
    if seq2seq:
        x["decoder_input_ids"] = torch.randint(3, 64, (2, 5), generator=g)
    return x


def _pair(name: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = MODELS[name][0]().float().eval()
    ours = ramtorch.offload(copy.deepcopy(ref), device="cpu", recompute=True)
    return ref, ours


def _layers(cache: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values in a cache (an encoder-decoder's self- and cross-attention)."""
    out = []
    parts = (getattr(cache, "self_attention_cache", cache), getattr(cache, "cross_attention_cache", None))
    for part in parts:
        if part is not None:
            out += [(layer.keys, layer.values) for layer in part.layers]
    return out


def _assert_grads(ref: nn.Module, ours: nn.Module) -> None:
    checked = 0
    for (pname, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), pname
        if p.grad is not None:
            torch.testing.assert_close(
                q.grad, p.grad, rtol=10 * TOL, atol=10 * TOL, msg=f"gradient of {pname}"
            )
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_a_recomputed_pass_fills_the_cache_once_and_trains_as_the_plain_model(name):
    ref, ours = _pair(name)
    x = _inputs(MODELS[name][1], 1)
    outs = []
    for model in (ref, ours):
        out = model(**x)
        out.logits.square().sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[1].logits.detach(), outs[0].logits.detach(), rtol=TOL, atol=TOL)
    _assert_grads(ref, ours)
    # The pass returns the cache the plain model returns: each layer's keys and values once.
    want, got = _layers(outs[0].past_key_values), _layers(outs[1].past_key_values)
    assert len(got) == len(want) > 0
    for (k0, v0), (k1, v1) in zip(want, got):
        assert k1.shape == k0.shape and v1.shape == v0.shape
        torch.testing.assert_close(k1.detach(), k0.detach(), rtol=TOL, atol=TOL)
        torch.testing.assert_close(v1.detach(), v0.detach(), rtol=TOL, atol=TOL)


def test_a_second_recomputed_pass_from_the_cache_is_refused_with_a_message():
    ref, ours = _pair("qwen3")
    x = _inputs(False, 2)
    with torch.no_grad():
        past = ours(**x).past_key_values  # without grad nothing is recomputed: the cache fills
    assert past.get_seq_length() == 6
    nxt = {"input_ids": torch.randint(3, 64, (2, 1)), "past_key_values": past}
    with pytest.raises(RuntimeError, match="already holds 6 tokens"):
        ours(**nxt).logits.sum().backward()
    # The plain model continues from the cache; so does the offloaded one without grad.
    with torch.no_grad():
        past_ref = ref(**x).past_key_values
        want = ref(input_ids=nxt["input_ids"], past_key_values=past_ref).logits
        got = ours(**_inputs(False, 2)).past_key_values
        got = ours(input_ids=nxt["input_ids"], past_key_values=got).logits
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_passes_without_a_cache_are_unchanged():
    ref, ours = _pair("starcoder2")
    x = _inputs(False, 3)
    for model in (ref, ours):
        model(**x, use_cache=False).logits.square().sum().backward()
    _assert_grads(ref, ours)
