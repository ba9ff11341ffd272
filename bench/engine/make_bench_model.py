"""Write a random Llama (config + safetensors weights, no tokenizer) sized for the engine benchmark.

No hub download and a fixed seed, so every run writes the same model. The default
(12 layers, hidden 512, 8 query / 4 KV heads of 64) is the model of issue 17:
big enough that a 2k-token prefill costs real time on CPU. The lookup test uses
the same shape at 32 layers, and a narrow one (hidden 128) is enough there, since a
lookup's cost depends on layers and chunks, not on the width.

Usage: ``python make_bench_model.py OUT_DIR [--layers N] [--hidden N]``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["ModelShape", "make_bench_model"]


@dataclass(frozen=True)
class ModelShape:
    """The few numbers that set a prefill's cost and a blob's size."""

    layers: int = 12
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def make_bench_model(out_dir: str, shape: ModelShape = ModelShape(), *, seed: int = 0) -> str:
    """Save the model under ``out_dir`` (bf16) and return it."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=ModelShape.layers)
    ap.add_argument("--hidden", type=int, default=ModelShape.hidden)
    args = ap.parse_args()
    heads = max(2, args.hidden // 64)
    make_bench_model(args.out_dir, ModelShape(args.layers, args.hidden, heads, max(1, heads // 2)))


if __name__ == "__main__":
    main()
