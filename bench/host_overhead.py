"""Host time of an offloaded pass on the CPU, where the kernels of a tiny model take little and
the streaming's own Python work shows: a small Llama with torchao int8 weight-only decoder
projections and rank-4 LoRA adapters (``--base bf16``: no quantization), offloaded to the CPU
device; prints the median forward and forward+backward times.

    python bench/host_overhead.py --base int8 --layers 8 --reps 40 [--hidden 256]

Run two checkouts interleaved (``PYTHONPATH=<checkout>/python``) to compare them: absolute times
depend on the machine and its load, the difference between the two does not."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", choices=["int8", "bf16"], default="int8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument(
        "--hidden",
        type=int,
        default=64,
        help="width (FFN twice it); from 256 the rank-4 adapters are light and stay on the device",
    )
    a = ap.parse_args()

    import peft
    import ramtorch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if a.base == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(
            model,
            Int8WeightOnlyConfig(),
            filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and ".layers." in fqn,
        )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    ramtorch.offload(model, device="cpu")
    ids = torch.randint(0, 100, (1, 8))

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    def forward_backward() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
        for _ in range(5):
            fn()
        times = []
        for _ in range(a.reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        print(f"{a.base} base, {a.layers} layers, {name}: {sorted(times)[a.reps // 2] * 1e3:.1f} ms (median)")


if __name__ == "__main__":
    main()
