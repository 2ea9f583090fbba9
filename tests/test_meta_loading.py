"""A model built without weights (on the meta device, or with accelerate's ``init_empty_weights``),
offloaded, then filled by ``ramtorch.load``: its parameters are allocated in host RAM (zeros until
loaded), its non-persistent buffers (rotary ``inv_freq``) computed as the model computes them, and
its logits equal those of the same checkpoint loaded by transformers. A parameter no load has
written is an error naming it."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import ramtorch
import torch
from torch import nn

transformers = pytest.importorskip("transformers")


def llama_config(tied: bool = False) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )


def saved_llama(path: Path, tied: bool = False) -> transformers.LlamaForCausalLM:
    """A random tiny Llama written by transformers' save_pretrained into ``path``, and read back by
    transformers' from_pretrained (the reference)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(tied)).save_pretrained(path)
    return transformers.LlamaForCausalLM.from_pretrained(path).eval()


def empty_llama(how: str, tied: bool = False) -> transformers.LlamaForCausalLM:
    if how == "meta":
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(llama_config(tied)).eval()
    from accelerate import init_empty_weights

    with init_empty_weights():
        return transformers.LlamaForCausalLM(llama_config(tied)).eval()


@pytest.mark.parametrize("budget", [None, 600_000])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("how", ["meta", "accelerate"])
def test_meta_model_offloaded_then_loaded_gives_the_transformers_logits(tmp_path, how, tied, budget):
    ref = saved_llama(tmp_path, tied)
    model = empty_llama(how, tied)
    assert model.lm_head.weight.is_meta
    ramtorch.offload(model, gpu_budget=budget, device="cpu")
    assert not any(t.is_meta for t in model.state_dict().values())
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())  # zeros, never garbage
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    out = ramtorch.load(model, tmp_path)
    assert out["missing"] == [] and out["unexpected"] == []
    assert out["bytes"] == sum(p.numel() * p.element_size() for p in ref.parameters())
    inv = model.model.rotary_emb.inv_freq
    torch.testing.assert_close(inv, ref.model.rotary_emb.inv_freq, rtol=0, atol=0)
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_parameter_left_unloaded_is_an_error_naming_it(tmp_path):
    saved_llama(tmp_path)
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    part = tmp_path / "part"
    part.mkdir()
    save_file(sd, part / "model.safetensors")
    model = ramtorch.offload(empty_llama("meta"), device="cpu")
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=re.escape("model.layers.1.mlp.up_proj.weight")):
            ramtorch.load(model, part, strict=strict)
    # Set by the user instead: then it is not an error (a missing key, with strict=False).
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.normal_()
    with pytest.warns(UserWarning, match="up_proj"):
        ramtorch.load(model, part, strict=False)


def test_load_into_a_meta_model_that_was_not_offloaded_is_refused(tmp_path):
    saved_llama(tmp_path)
    model = empty_llama("meta")
    with pytest.raises(RuntimeError, match="meta device"):
        ramtorch.load(model, tmp_path)


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.register_buffer("scale", torch.full((8,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x * self.scale


def test_non_persistent_buffer_of_a_plain_meta_model_is_named_in_a_warning(tmp_path):
    torch.manual_seed(0)
    ref = WithTable()
    ramtorch.save_pretrained(ref, tmp_path)
    with torch.device("meta"):
        model = WithTable()
    with pytest.warns(UserWarning, match=r"\['scale'\]"):
        ramtorch.offload(model, device="cpu")
    assert torch.count_nonzero(model.scale) == 0
    ramtorch.load(model, tmp_path)
    model.scale.fill_(2.0)  # what the warning asks for
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


def readme_flow() -> str:
    """The README's typical-flow snippet."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    m = re.search(r"A typical flow(?:(?!```).)*```python\n(.*?)```", text, re.S)
    assert m is not None, "README: no typical-flow snippet"
    return textwrap.dedent(m.group(1))


def test_readme_typical_flow_runs(tmp_path, monkeypatch):
    ref = saved_llama(tmp_path / "checkpoint")
    monkeypatch.chdir(tmp_path)
    scope = {"config": llama_config(), "LlamaForCausalLM": transformers.LlamaForCausalLM}
    exec(readme_flow(), scope)
    model = scope["model"]
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_readme_load_then_quantize_flow_runs(tmp_path, monkeypatch):
    quant = pytest.importorskip("torchao.quantization")
    ref = saved_llama(tmp_path / "checkpoint", tied=True)
    quant.quantize_(ref, quant.Int8WeightOnlyConfig())
    text = (Path(__file__).parents[1] / "README.md").read_text()
    m = re.search(r"From a checkpoint of plain weights(?:(?!```).)*```python\n(.*?)```", text, re.S)
    assert m is not None, "README: no load-then-quantize snippet"
    monkeypatch.chdir(tmp_path)
    scope = {"config": llama_config(tied=True), "LlamaForCausalLM": transformers.LlamaForCausalLM}
    exec("import torch, ramtorch\n" + textwrap.dedent(m.group(1)), scope)
    model = scope["model"]
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    stats = model._ramtorch_streamer.stats()
    # The three layers' int8 bytes stream: fewer than one layer's in fp32 (the slot size offload planned).
    assert stats["streamed_units"] == 4 and stats["streamed_bytes_per_pass"] < stats["slot_bytes"]


def test_meta_parameters_of_self_streaming_layers_are_refused():
    """Layers that stream themselves (as ramtorch.nn's do) keep their own memory: not allocated."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1]._ramtorch_streams_itself = True
    with pytest.raises(ValueError, match=r"\['1\.weight', '1\.bias'\]"):
        ramtorch.offload(model, device="cpu")
