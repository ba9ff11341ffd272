"""Write a tiny random Llama (config + safetensors weights, no tokenizer) for engine tests.

No hub download: the weights are drawn from a fixed seed, so every run writes the
same model. Usage: ``python make_model.py OUT_DIR``.
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["make_model"]


def make_model(out_dir: str, *, seed: int = 0) -> str:
    """Save the model under ``out_dir`` and return it."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Peaked logits keep greedy choices far from ties, so an FP8 V cannot flip them.
        model.lm_head.weight.mul_(8.0)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


if __name__ == "__main__":
    make_model(sys.argv[1])
