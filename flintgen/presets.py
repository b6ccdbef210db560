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

PRESETS: dict[str, Spec] = {"flint": FLINT}


def get_preset(name: str) -> Spec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown preset {name!r}: available presets are {sorted(PRESETS)}. "
            "Pass one of them, or a spec file with --spec."
        ) from None
