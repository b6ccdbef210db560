"""Built-in model specs."""

from __future__ import annotations

from flintgen.spec import Spec

# Flint: hidden 2048, 32 q / 4 kv heads of 128 (GQA 8), 16-token pages in the
# HND [blocks, kv_heads, 16, 2*128] bf16 cache, sinks, window 128 on the
# sliding layers (alternating with full-attention layers), q/k RMSNorm, NeoX
# RoPE, NVFP4 weights. The layer count (24, sliding first) is this preset's
# assumption: only which layer kinds exist reaches a kernel.
FLINT = Spec(
    name="flint",
    hidden_size=2048,
    num_q_heads=32,
    num_kv_heads=4,
    head_dim=128,
    page_size=16,
    kv_cache_dtype="bf16",
    kv_layout="HND",
    weight_format="nvfp4",
    qkv_bias=False,
    sinks=True,
    sliding_window=128,
    layer_types=("sliding", "full") * 12,
    qk_norm=True,
    rope_style="neox",
    rope_theta=150000.0,
    rope_scaling="none",
    rms_eps=1e-6,
    max_tokens=8,
    tp_size=1,
    max_batch=256,
)

# Sibling models, matching their published config.json (shipped in
# examples/hf_configs/; tests/test_presets.py maps those files and compares).
# Weight format bf16 (what the checkpoints' attention weights are); page 16.
GPT_OSS_20B = Spec(
    name="gpt-oss-20b", hidden_size=2880, num_q_heads=64, num_kv_heads=8, head_dim=64, page_size=16,
    weight_format="bf16", qkv_bias=True, sinks=True, sliding_window=128, layer_types=("sliding", "full") * 12,
    qk_norm=False, rope_style="neox", rope_theta=150000.0, rope_scaling="yarn",
    rope_scaling_params={"factor": 32.0, "original_max_position_embeddings": 4096.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": 0.0},
    rms_eps=1e-5, max_tokens=8, tp_size=1, max_batch=256,
)
QWEN3_8B = Spec(
    name="qwen3-8b", hidden_size=4096, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
    weight_format="bf16", qkv_bias=False, sinks=False, sliding_window=None, layer_types=("full",) * 36,
    qk_norm=True, rope_style="neox", rope_theta=1000000.0, rope_scaling="none", rms_eps=1e-6,
    max_tokens=8, tp_size=1, max_batch=256,
)
LLAMA_31_8B = Spec(
    name="llama-3.1-8b", hidden_size=4096, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
    weight_format="bf16", qkv_bias=False, sinks=False, sliding_window=None, layer_types=("full",) * 32,
    qk_norm=False, rope_style="neox", rope_theta=500000.0, rope_scaling="llama3",
    rope_scaling_params={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192.0},
    rms_eps=1e-5, max_tokens=8, tp_size=1, max_batch=256,
)

PRESETS: dict[str, Spec] = {s.name: s for s in (FLINT, GPT_OSS_20B, QWEN3_8B, LLAMA_31_8B)}


def get_preset(name: str) -> Spec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown preset {name!r}: available presets are {sorted(PRESETS)}. "
            "Pass one of them, or a spec file with --spec."
        ) from None
