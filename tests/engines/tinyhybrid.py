"""Tiny hybrid models with real random weights, for engine tests on a CPU.

Runs in the vLLM venv (tests/engines/venv.py), which has transformers:

    python tinyhybrid.py KIND DIR      write model KIND into DIR (once; reused after)

Two kinds, each with two layers that vLLM puts in two KV cache groups:

- ``gemma3``: a text-only Gemma3ForCausalLM, layers [sliding_attention,
  full_attention], a window of 64 tokens, heads of 64: groups (sliding
  window, full attention); float32, blocks of 32 tokens.
- ``qwen3next``: a Qwen3NextForCausalLM, layers [linear_attention,
  full_attention]: groups (GDN state, full attention). vLLM's CPU GDN kernel
  runs in bfloat16 and takes key and value heads of 64; its Qwen3Next wants
  a mixture-of-experts layer (the second layer is one). Four KV heads make a
  64-token attention block (64 KiB) larger than the GDN state (34.25 KiB), so
  vLLM keeps 64-token blocks, which keep a load of the state bit-exact with
  the CPU kernel; the state's page is smaller than an attention block's.

Hidden size 128, a vocabulary of 512, weights drawn with a wide initializer
so that what the model attends to changes its output. No tokenizer: tests
pass prompt token ids (tinyllama.py says why the weights are real).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 512
SEED = 1234
STAMP = "tinyhybrid.json"  # written last: a directory without it is rebuilt
# per kind: the engine's block size and dtype, and vLLM's KV cache group kinds
ENGINE = {
    "gemma3": {"block_size": 32, "dtype": "float32", "groups": ["sliding", "full"]},
    "qwen3next": {"block_size": 64, "dtype": "bfloat16", "groups": ["mamba", "full"]},
}


def config(kind: str) -> dict[str, object]:
    """What the model is; a directory written with another config is rebuilt."""
    common: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "initializer_range": 0.2,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if kind == "gemma3":
        return {
            **common,
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 64,
            "pad_token_id": 0,
            "torch_dtype": "float32",
        }
    if kind == "qwen3next":
        return {
            **common,
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],  # the second layer is the mixture of experts
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "norm_topk_prob": True,
            "torch_dtype": "float32",  # weights; the engine runs it in bfloat16
        }
    raise ValueError(f"no tiny hybrid model {kind!r}: {sorted(ENGINE)}")


def ready(kind: str, where: Path) -> bool:
    stamp = where / STAMP
    return stamp.is_file() and json.loads(stamp.read_text()) == config(kind)


def write(kind: str, where: Path) -> Path:
    """Model ``kind`` in ``where``, written unless it is already there."""
    if ready(kind, where):
        return where
    import torch
    import transformers

    torch.manual_seed(SEED)
    fields = config(kind)
    if kind == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields))
    else:
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**fields))
    where.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(where), safe_serialization=True)
    (where / STAMP).write_text(json.dumps(fields))
    return where


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(write(sys.argv[1], Path(sys.argv[2])))
