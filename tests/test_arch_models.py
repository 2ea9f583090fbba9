"""``ramtorch.offload`` on the architectures of the benchmark matrix (BENCH.md ``arch:<name>``), at
tiny size on the CPU, against the same model unstreamed: forward outputs, gradients of one
backward, gradients accumulated over two backwards without ``zero_grad`` (which must equal the
gradient of the two micro-batches as one batch under a summed loss), and two AdamW steps.

Models: decoders (Llama, Qwen2 with q/k/v biases and an untied head, Mistral, Gemma with its tied
embedding, GPT-NeoX, Phi), a BERT encoder, a T5 encoder-decoder, a ViT and a ResNet; and beyond the
matrix GPT-2 (Conv1D), Mixtral (experts in one 3-D parameter), Switch Transformers (experts as
modules: one that no token reaches has no gradient), ALBERT (one layer's weights run three times a
pass) and wav2vec2 (convolutions, one under weight_norm). All in ``eval()`` (no dropout; BatchNorm
on its running statistics, so that samples are independent and accumulation over micro-batches is
exact)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from conftest import tiny_llama_config
from torch import nn

transformers = pytest.importorskip("transformers")

#: Relative and absolute tolerance of fp32 results computed in another order.
TOL = 2e-5

_DEC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _decoder(cls: str, cfg: str, **kw: object) -> Callable[[], nn.Module]:
    return lambda: getattr(transformers, cls)(getattr(transformers, cfg)(**{**_DEC, **kw}))


#: Each architecture: a function building the tiny model, and the kind of input it takes.
MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "llama": (lambda: transformers.LlamaForCausalLM(tiny_llama_config()), "ids"),
    "qwen2": (
        _decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2, tie_word_embeddings=False),
        "ids",
    ),
    "mistral": (
        _decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, sliding_window=None),
        "ids",
    ),
    "gemma": (_decoder("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=4, head_dim=16), "ids"),
    "gpt-neox": (_decoder("GPTNeoXForCausalLM", "GPTNeoXConfig"), "ids"),
    "phi": (_decoder("PhiForCausalLM", "PhiConfig"), "ids"),
    "bert": (
        lambda: transformers.BertModel(
            transformers.BertConfig(**{**_DEC, "max_position_embeddings": 64}), add_pooling_layer=False
        ),
        "ids",
    ),
    "t5": (
        lambda: transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=64,
                d_model=32,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                d_kv=8,
                feed_forward_proj="gated-gelu",
            )
        ),
        "seq2seq",
    ),
    "vit": (
        lambda: transformers.ViTModel(
            transformers.ViTConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                image_size=16,
                patch_size=4,
            ),
            add_pooling_layer=False,
        ),
        "image",
    ),
    "resnet": (
        lambda: transformers.ResNetModel(
            transformers.ResNetConfig(
                embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck"
            )
        ),
        "image",
    ),
    # Beyond the matrix: layouts of their own.
    # GPT-2's projections are transformers' Conv1D (a weight stored transposed).
    "gpt2": (
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        ),
        "ids",
    ),
    # Experts held as one 3-D parameter per layer; each token routed to one of them.
    "mixtral": (
        _decoder(
            "MixtralForCausalLM",
            "MixtralConfig",
            intermediate_size=32,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=1,
            sliding_window=None,
        ),
        "ids",
    ),
    # Experts as modules of their own: an expert no token reaches has no gradient (None).
    "switch": (
        lambda: transformers.SwitchTransformersForConditionalGeneration(
            transformers.SwitchTransformersConfig(
                vocab_size=64,
                d_model=32,
                d_kv=8,
                d_ff=64,
                expert_capacity=64,
                num_layers=2,
                num_decoder_layers=2,
                num_sparse_encoder_layers=1,
                num_sparse_decoder_layers=1,
                num_heads=4,
                num_experts=8,
                router_jitter_noise=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
                eos_token_id=1,
            )
        ),
        "seq2seq",
    ),
    # One layer's weights shared by every layer: the same module runs three times a pass.
    "albert": (
        lambda: transformers.AlbertModel(
            transformers.AlbertConfig(
                vocab_size=64,
                embedding_size=16,
                hidden_size=32,
                num_hidden_layers=3,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
            ),
            add_pooling_layer=False,
        ),
        "ids",
    ),
    # A convolutional feature extractor, and a positional convolution under weight_norm.
    "wav2vec2": (
        lambda: transformers.Wav2Vec2Model(
            transformers.Wav2Vec2Config(
                vocab_size=64,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                conv_dim=(8, 8),
                conv_stride=(5, 2),
                conv_kernel=(10, 3),
                num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4,
                mask_time_prob=0.0,
            )
        ),
        "audio",
    ),
}


def inputs(kind: str, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """Keyword inputs of ``batch`` samples."""
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g)}
    if kind == "audio":
        return {"input_values": torch.randn(batch, 400, generator=g)}
    ids = torch.randint(0, 64, (batch, 6), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(0, 64, (batch, 5), generator=g)}
    return {"input_ids": ids}


def output(out: object) -> torch.Tensor:
    """The tensor a model's output leads with (logits, last hidden state or feature map)."""
    for name in ("logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if t is not None:
            return t
    raise AssertionError(f"no output tensor in {type(out).__name__}")


def loss_of(model: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss summed over the samples (so that micro-batches add up to their concatenation) that
    reaches every weight in the output's path: squared outputs against a fixed random direction."""
    y = output(model(**x))
    w = torch.randn(y.shape[1:], generator=torch.Generator().manual_seed(7))
    return (y * w).square().sum()


def pair(name: str) -> tuple[nn.Module, nn.Module]:
    """The plain model and an offloaded copy with the same weights."""
    torch.manual_seed(0)
    ref = MODELS[name][0]().float().eval()
    ours = ramtorch.offload(copy.deepcopy(ref), device="cpu")
    return ref, ours


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, scale: float = 1.0) -> None:
    tol = TOL * scale
    torch.testing.assert_close(a.detach(), b.detach(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def assert_grads(ref: nn.Module, ours: nn.Module, when: str) -> None:
    checked = 0
    for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, f"{when}: {name} has a gradient the plain model has not"
            continue
        assert q.grad is not None, f"{when}: {name} has no gradient"
        assert_close(p.grad, q.grad, f"{when}: gradient of {name}", scale=10)
        checked += 1
    assert checked > 0, f"{when}: no gradient to compare"


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_backward_and_accumulation_match_the_plain_model(name):
    ref, ours = pair(name)
    kind = MODELS[name][1]
    x1, x2 = inputs(kind, 2, 1), inputs(kind, 3, 2)

    with torch.no_grad():
        assert_close(output(ref(**x1)), output(ours(**x1)), "forward")

    loss_of(ref, x1).backward()
    loss_of(ours, x1).backward()
    assert_grads(ref, ours, "one backward")

    # A second backward adds into the gradients of the first; the plain model computes the same
    # gradient as one batch of both micro-batches under the summed loss.
    loss_of(ours, x2).backward()
    ref.zero_grad(set_to_none=True)
    both = {k: torch.cat([x1[k], x2[k]]) for k in x1}
    loss_of(ref, both).backward()
    assert_grads(ref, ours, "accumulated backward")


@pytest.mark.parametrize("name", list(MODELS))
def test_adamw_steps_match_torch(name):
    ref, ours = pair(name)
    kind = MODELS[name][1]
    lr, steps = 1e-2, 2
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    opt = ropt.AdamW(ours.parameters(), lr=lr, weight_decay=0.01)
    largest: dict[str, float] = {}  # per parameter, the largest reference gradient seen
    for step in range(steps):
        x = inputs(kind, 2, 10 + step)
        for model, o in ((ref, opt_ref), (ours, opt)):
            (loss_of(model, x) / 100).backward()
            if model is ref:
                for pname, p in ref.named_parameters():
                    g = 0.0 if p.grad is None else float(p.grad.abs().max())
                    largest[pname] = max(largest.get(pname, 0.0), g)
            o.step()
            o.zero_grad(set_to_none=True)
    top = max(largest.values())
    for (pname, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
        if largest[pname] <= 1e-6 * top:
            # A gradient that is zero in exact arithmetic (an attention key's bias: softmax ignores
            # what it adds to a query's scores) is rounding, which AdamW divides by its own scale:
            # each step then moves the parameter by a noise-driven fraction of the learning rate,
            # whatever computed the rounding. Such a parameter is checked to have moved no more.
            assert (q.detach() - p.detach()).abs().max() <= steps * lr, f"{pname} moved too far"
            continue
        assert_close(p, q, f"{pname} after two steps", scale=10)
    x = inputs(kind, 2, 99)
    with torch.no_grad():
        assert_close(output(ref(**x)), output(ours(**x)), "forward after two steps", scale=10)
