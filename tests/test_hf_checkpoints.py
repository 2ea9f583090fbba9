"""transformers checkpoints through ``ramtorch.load`` and ``ramtorch.save_pretrained``: keys mapped
as ``from_pretrained`` maps them (base-model prefix added or stripped, legacy names, ignored keys),
missing and unexpected keys reported, and a saved folder that ``from_pretrained`` builds the same
model from. Every result is compared with the plain model loaded by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ramtorch
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402


def bert_config() -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=101,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )


def base_checkpoint(path: Path) -> None:
    """A random tiny BERT base model (keys without the ``bert.`` prefix), as transformers saves it."""
    torch.manual_seed(0)
    transformers.BertModel(bert_config()).save_pretrained(path)


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, 9), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def classifier_like(ref: torch.nn.Module) -> transformers.BertForSequenceClassification:
    """A classification model whose new head has ``ref``'s initial values (the base has zeros)."""
    model = transformers.BertForSequenceClassification(bert_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.classifier.load_state_dict(ref.classifier.state_dict())
    return model


def test_base_checkpoint_into_a_classification_model(tmp_path, renaming):
    base_checkpoint(tmp_path)
    ref = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()
    model = ramtorch.offload(classifier_like(ref), device="cpu")
    with pytest.raises(RuntimeError, match=r"classifier\.weight"):
        ramtorch.load(model, tmp_path)  # strict: the new head is missing
    with pytest.warns(
        UserWarning, match=r"missing from the checkpoint: \['classifier\.weight', 'classifier\.bias'\]"
    ):
        out = ramtorch.load(model, tmp_path, strict=False)
    assert out["missing"] == ["classifier.weight", "classifier.bias"]
    assert out["unexpected"] == []
    assert out["bytes"] > 0
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs()).logits, ref(**inputs()).logits, rtol=1e-5, atol=1e-5)


def test_classification_checkpoint_into_a_base_model(tmp_path, renaming):
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(bert_config()).save_pretrained(tmp_path)
    ref = transformers.BertModel.from_pretrained(tmp_path).eval()
    model = transformers.BertModel(bert_config()).eval()
    ramtorch.offload(model, device="cpu")
    with pytest.raises(
        RuntimeError, match=r"unexpected in the checkpoint: \['classifier\.bias', 'classifier\.weight'\]"
    ):
        ramtorch.load(model, tmp_path)
    with pytest.warns(UserWarning, match="classifier"):
        out = ramtorch.load(model, tmp_path, strict=False)
    assert out["missing"] == [] and out["unexpected"] == ["classifier.bias", "classifier.weight"]
    with torch.no_grad():
        torch.testing.assert_close(
            model(**inputs()).last_hidden_state, ref(**inputs()).last_hidden_state, rtol=1e-5, atol=1e-5
        )


@pytest.fixture(params=["transformers", "own"])
def renaming(request, monkeypatch):
    """Keys renamed by transformers' own helpers, or by ramtorch's (releases without them)."""
    if request.param == "own":
        from ramtorch.io import _keys

        monkeypatch.setattr(_keys, "_hf_renamer", lambda model, targets: None)
    return request.param


def test_legacy_key_names_and_position_ids(tmp_path, renaming):
    """A checkpoint of the older layout: ``LayerNorm.gamma``/``beta`` and a saved ``position_ids``."""
    base_checkpoint(tmp_path / "new")
    sd = load_file(tmp_path / "new" / "model.safetensors")
    old = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in sd.items()
    }
    old["embeddings.position_ids"] = torch.arange(64).unsqueeze(0)
    assert any(k.endswith("LayerNorm.gamma") for k in old)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    save_file(old, legacy / "model.safetensors", metadata={"format": "pt"})
    (legacy / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
    ref = transformers.BertModel.from_pretrained(legacy).eval()
    model = ramtorch.offload(transformers.BertModel(bert_config()).eval(), device="cpu")
    out = ramtorch.load(model, legacy)  # strict: every key matched or ignored
    assert out["missing"] == [] and out["unexpected"] == []
    with torch.no_grad():
        torch.testing.assert_close(
            model(**inputs()).last_hidden_state, ref(**inputs()).last_hidden_state, rtol=1e-5, atol=1e-5
        )


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_theta=5000.0,  # not the default: the written config must carry it
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.max_new_tokens = 7
    return model


@pytest.mark.parametrize("shard", ["5GB", "100KB"])
def test_save_pretrained_output_loads_in_transformers(tmp_path, shard):
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        want = model(ids).logits
    ramtorch.offload(model, device="cpu")
    written = ramtorch.save_pretrained(model, tmp_path, max_shard_size=shard)
    assert "config.json" in written and "generation_config.json" in written
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is transformers.LlamaForCausalLM
    assert back.config.rope_parameters["rope_theta"] == 5000.0
    assert back.generation_config.max_new_tokens == 7
    assert back.lm_head.weight is back.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_save_pretrained_of_a_classifier_keeps_its_labels(tmp_path):
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(bert_config()).eval()
    with torch.no_grad():
        want = model(**inputs()).logits
    ramtorch.offload(model, device="cpu")
    written = ramtorch.save_pretrained(model, tmp_path)
    assert "generation_config.json" not in written
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(back) is transformers.BertForSequenceClassification and back.num_labels == 3
    with torch.no_grad():
        torch.testing.assert_close(back(**inputs()).logits, want, rtol=1e-5, atol=1e-5)


def test_base_checkpoint_into_a_meta_built_classification_model(tmp_path):
    """Built on the meta device: position_ids computed again, the new head must be set by the user."""
    base_checkpoint(tmp_path)
    ref = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.device("meta"):
        model = transformers.BertForSequenceClassification(bert_config()).eval()
    ramtorch.offload(model, device="cpu")
    with pytest.raises(RuntimeError, match=r"\['classifier\.weight', 'classifier\.bias'\]"):
        ramtorch.load(model, tmp_path, strict=False)  # the head would stay zeros
    with torch.no_grad():
        model.classifier.weight.copy_(ref.classifier.weight)
        model.classifier.bias.copy_(ref.classifier.bias)
    with pytest.warns(UserWarning, match="classifier"):
        ramtorch.load(model, tmp_path, strict=False)
    assert torch.equal(model.bert.embeddings.position_ids, ref.bert.embeddings.position_ids)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs()).logits, ref(**inputs()).logits, rtol=1e-5, atol=1e-5)
