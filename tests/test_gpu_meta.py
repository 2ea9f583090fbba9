"""On the GPU: a transformers model built on the meta device, offloaded with part of it resident,
filled by ``ramtorch.load``, gives the logits of the same checkpoint loaded by transformers; its
``save_pretrained`` output loads back in transformers."""

from __future__ import annotations

import pytest
import ramtorch
import torch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu


def config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=211,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


@pytest.mark.parametrize("budget", [None, 2_500_000])
def test_meta_llama_loaded_on_the_gpu_matches_transformers(tmp_path, budget):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config()).save_pretrained(tmp_path / "ckpt")
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt").eval().cuda()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config()).eval()
    ramtorch.offload(model, gpu_budget=budget, device="cuda")
    ramtorch.load(model, tmp_path / "ckpt")
    ids = torch.randint(0, 211, (2, 13), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    ramtorch.save_pretrained(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval().cuda()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
