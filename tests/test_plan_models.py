"""``python -m ramtorch plan`` on the kinds of models people plan for: decoder-only, encoder-only,
encoder-decoder and vision transformers, from a ``config.json`` (tiny configs written here: no
network); its ``--help`` shows the defaults, which are the ceilings BENCHMARKS.md measured."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from ramtorch.__main__ import main
from ramtorch.plan import Ceilings, build_meta_model, format_seconds

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent

TINY = {
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=128, vocab_size=100
    ),
    "t5": lambda: transformers.T5Config(
        d_model=64, d_ff=128, num_layers=3, num_heads=2, d_kv=32, vocab_size=100
    ),
    "vit": lambda: transformers.ViTConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
        num_labels=10,
        architectures=["ViTForImageClassification"],
    ),
    # A sentence-embedding checkpoint's config (MiniLM): a bare encoder, no language-model head.
    "minilm": lambda: transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=100,
        architectures=["BertModel"],
    ),
}


def _config(tmp_path: Path, kind: str) -> str:
    path = tmp_path / kind / "config.json"
    path.parent.mkdir()
    TINY[kind]().to_json_file(str(path))
    return str(path)


@pytest.mark.parametrize(
    "kind, cls, block",
    [
        ("llama", "LlamaForCausalLM", r"model\.layers\.0"),
        ("t5", "T5ForConditionalGeneration", r"decoder\.block\.0"),
        ("vit", "ViTForImageClassification", r"vit\.(encoder\.layer|layers)\.0"),
        ("minilm", "BertModel", r"encoder\.layers?\.0"),
    ],
)
def test_plan_builds_the_model_the_config_describes(tmp_path, capsys, kind, cls, block):
    path = _config(tmp_path, kind)
    model = build_meta_model(path)
    assert type(model).__name__ == cls
    assert all(p.is_meta for p in model.parameters())
    assert main(["plan", "--model", path, "--tokens", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = [u["name"] for u in out["units"]]
    assert any(re.fullmatch(block, n) for n in names), names
    # Every parameter of the model is planned once: in a unit, or resident as shared.
    assert sum(u["params"] for u in out["units"]) <= sum(p.numel() for p in model.parameters())
    assert out["forward_seconds"] > 0


def test_encoder_only_config_gets_no_language_model_head(tmp_path, capsys):
    path = _config(tmp_path, "minilm")
    assert main(["plan", "--model", path, "--json"]) == 0
    names = [u["name"] for u in json.loads(capsys.readouterr().out)["units"]]
    assert not any(n.startswith("cls") for n in names), names


def test_summary_of_a_small_model_shows_its_times(tmp_path, capsys):
    assert main(["plan", "--model", _config(tmp_path, "minilm"), "--tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "predicted forward" in out
    assert " 0.0 ms" not in out and "0.0 MiB" not in out


def test_format_seconds():
    assert format_seconds(2.5) == "2.50 s"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(0.000456) == "456 µs"
    assert format_seconds(3e-7) == "0.300 µs"
    assert format_seconds(0.0) == "0 µs"


def test_a_config_transformers_cannot_build_is_one_clear_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no-such-model-type", "hidden_size": 8}))
    assert main(["plan", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ramtorch plan: ") and str(path) in err
    assert "Traceback" not in err and len(err) < 600, err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    c = Ceilings()
    for value in (c.h2d_gbps, c.d2h_gbps, c.tflops, c.efficiency, c.host_gbps, 4096):
        assert re.search(rf"default: {re.escape(str(value))}[,)]", out), (value, out)
    assert "default: stream everything" in out


def test_defaults_are_the_ceilings_benchmarks_measured():
    text = " ".join((ROOT / "BENCHMARKS.md").read_text().split())
    m = re.search(
        r"The ceilings are its defaults: ([\d.]+) GB/s H2D/D2H, ([\d.]+) TFLOP/s at ([\d.]+) efficiency, "
        r"and for the step ([\d.]+) GB/s",
        text,
    )
    assert m is not None, "BENCHMARKS.md no longer states the planner's defaults"
    h2d, tflops, eff, host = map(float, m.groups())
    c = Ceilings()
    assert (c.h2d_gbps, c.d2h_gbps, c.tflops, c.efficiency, c.host_gbps) == (h2d, h2d, tflops, eff, host)


def test_an_encoder_decoder_streams_both_stacks_block_by_block_by_default(tmp_path, capsys):
    path = _config(tmp_path, "t5")
    for extra in ([], ["--unit", "T5Block"]):
        assert main(["plan", "--model", path, "--json", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        names = [u["name"] for u in out["units"]]
        assert {"encoder.block.0", "decoder.block.0"} <= set(names), names
        assert not any(".SelfAttention" in n or ".DenseReluDense" in n for n in names), names
        assert not any("--unit" in n for n in out["notes"]), out["notes"]
