"""Host time of the streaming hooks alone, per forward+backward: ``Streamer.pre_forward``,
``post_forward``, ``_begin_backward_locked`` (and ``weights_backward`` where the weights train),
each wrapped with a timer, on a small Llama with torchao int8 weight-only projections and rank-4
LoRA adapters offloaded to the CPU device (hidden 256: the adapters are light and stay on the
device, as on the 8B shape). Prints the minimum over 7 rounds of 20 steps of each hook's ms a
step. Compare two checkouts by running it with each one's ``python/`` on ``PYTHONPATH``, in turn:
timing the hooks alone is steadier than the step on a loaded machine.

    python bench/host_hooks.py                     # PYTHONPATH=<checkout>/python for each side
"""

from __future__ import annotations

import time

import peft
import ramtorch
import torch
import transformers
from ramtorch._stream import streamer as S
from torch import nn
from torchao.quantization import Int8WeightOnlyConfig, quantize_

acc: dict[str, float] = {}


def wrap(cls: type, name: str) -> None:
    real = getattr(cls, name)

    def timed(*a: object, **k: object) -> object:
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t

    setattr(cls, name, timed)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for n in ("pre_forward", "post_forward", "_begin_backward_locked", "weights_backward"):
        wrap(S.Streamer, n)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    quantize_(
        model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and ".layers." in fqn
    )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    ramtorch.offload(model, device="cpu")
    ids = torch.randint(0, 100, (1, 8))
    for _ in range(5):
        model(input_ids=ids, labels=ids).loss.backward()
    res: dict[str, list[float]] = {}
    for _ in range(7):
        acc.clear()
        for _ in range(20):
            model(input_ids=ids, labels=ids).loss.backward()
        for k, v in acc.items():
            res.setdefault(k, []).append(v / 20 * 1e3)
    print({k: round(min(v), 3) for k, v in res.items()}, "ms/step (min of 7)")


if __name__ == "__main__":
    main()
