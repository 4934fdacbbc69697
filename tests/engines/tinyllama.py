"""A tiny Llama with real random weights, for engine tests on a CPU.

Runs in the vLLM venv (tests/engines/venv.py), which has transformers:

    python tinyllama.py DIR        write the model into DIR (once; reused after)

Two layers, hidden size 128, four heads of 32 (a head size every CPU attention
backend takes), a vocabulary of 512 and weights drawn with a wide initializer
so that what the model attends to changes its output: a cached page with wrong
bytes gives other tokens. The weights are real (saved safetensors), never
dummy ones, because an engine that loads dummy weights produces output that
ignores the KV cache. No tokenizer: tests pass prompt token ids.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 512
MAX_POSITIONS = 4096
SEED = 1234
STAMP = "tinyllama.json"  # written last: a directory without it is rebuilt


def config() -> dict[str, object]:
    """What the model is; a directory written with another config is rebuilt."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": 0.2,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def ready(where: Path) -> bool:
    stamp = where / STAMP
    return stamp.is_file() and json.loads(stamp.read_text()) == config()


def write(where: Path) -> Path:
    """The model in ``where``, written unless it is already there."""
    if ready(where):
        return where
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    fields = config()
    model = LlamaForCausalLM(LlamaConfig(**fields))  # type: ignore[arg-type]
    where.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(where), safe_serialization=True)
    (where / STAMP).write_text(json.dumps(fields))
    return where


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(write(Path(sys.argv[1])))
