"""Build random-weight LoRA adapters for the tiny Llama (no download): PEFT directories that
vLLM loads with ``--enable-lora`` (``/v1/load_lora_adapter`` or ``--lora-modules``).

Runs inside vLLM's virtual environment (it needs torch and safetensors):
``python engines/in_venv/lora.py MODEL_DIR OUT_DIR NAME...``. Each adapter is rank 8 on every
layer's ``q_proj`` and ``v_proj``, seeded by its name (same name, same weights), shaped from
the model's ``config.json``; ``B`` is non-zero, so an adapter really changes the model's output.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

RANK = 8


def build(model: Path, out: Path, name: str) -> Path:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    h = cfg["hidden_size"]
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", h // cfg["num_attention_heads"])
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, width in (("q_proj", h), ("v_proj", kv)):
            base = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(RANK, h, generator=gen) * 0.02
            tensors[f"{base}.lora_B.weight"] = torch.randn(width, RANK, generator=gen) * 0.02
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 16,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": str(model),
        "modules_to_save": None}, indent=2))
    return d


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python engines/in_venv/lora.py MODEL_DIR OUT_DIR NAME...", file=sys.stderr)
        return 2
    model, out = Path(argv[0]), Path(argv[1])
    for name in argv[2:]:
        print(build(model, out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
