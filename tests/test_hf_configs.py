"""The shipped Hugging Face configs (examples/hf_configs/): each published
config.json maps to the spec its model's code implies, the README's served-
models table is what tools/served_models.py generates from them, and every
config's kernels build for sm_90a (``compile``).

What each model type's code fixes beyond config.json (flintgen.hf.MODEL_TYPES)
is asserted here per config, and its quirks on hand-made variants; whether the
mapped spec computes the model's attention is tests/test_hf_models.py
(transformers' own attention as the oracle).
"""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest

from flintgen import spec_from_hf_config
from flintgen.kernels import KERNELS
from flintgen.kernels.base import Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = os.path.join(ROOT, "examples", "hf_configs")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import served_models  # noqa: E402

T132 = Target("sm_90a", 132)
CONFIGS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(CFG, "*.json")))

# config -> (q heads, kv heads, head_dim, bias, q/k norm, sinks, softcap, norm offset, window, sliding layers
#            of all, rope style, rotary dims, theta, scaling, sliding theta) as each model's code has them
EXPECTED = {
    "gemma-2-9b": (16, 8, 256, False, False, False, True, 1, 4096, (21, 42), "neox", 256, 1e4, "none", None),
    "gemma-3-1b-it": (4, 1, 256, False, True, False, False, 1, 512, (22, 26), "neox", 256, 1e6, "none", 1e4),
    "gemma-3-4b-it": (8, 4, 256, False, True, False, False, 1, 1024, (29, 34), "neox", 256, 1e6, "linear", 1e4),
    "glm-4-9b-0414": (32, 2, 128, True, False, False, False, 0, None, (0, 40), "interleaved", 64, 1e4, "none", None),
    "glm-4.5-air": (96, 8, 128, True, False, False, False, 0, None, (0, 46), "neox", 64, 1e6, "none", None),
    "gpt-oss-20b": (64, 8, 64, True, False, True, False, 0, 128, (12, 24), "neox", 64, 150000.0, "yarn", None),
    "llama-3.1-8b": (32, 8, 128, False, False, False, False, 0, None, (0, 32), "neox", 128, 500000.0, "llama3", None),
    "mistral-7b-v0.1": (32, 8, 128, False, False, False, False, 0, 4096, (32, 32), "neox", 128, 1e4, "none", None),
    "mixtral-8x7b-v0.1": (32, 8, 128, False, False, False, False, 0, None, (0, 32), "neox", 128, 1e6, "none", None),
    "phi-3-mini-4k-instruct": (32, 32, 96, False, False, False, False, 0, 2047, (32, 32), "neox", 96, 1e4, "none",
                               None),
    # sliding_window 262144 >= max_position_embeddings 131072: full attention
    "phi-4-mini-instruct": (24, 8, 128, False, False, False, False, 0, None, (0, 32), "neox", 96, 1e4, "longrope",
                            None),
    "qwen1.5-moe-a2.7b": (16, 16, 128, True, False, False, False, 0, None, (0, 24), "neox", 128, 1e6, "none", None),
    "qwen2.5-7b-instruct": (28, 4, 128, True, False, False, False, 0, None, (0, 28), "neox", 128, 1e6, "none", None),
    "qwen3-30b-a3b": (32, 4, 128, False, True, False, False, 0, None, (0, 48), "neox", 128, 1e6, "none", None),
    "qwen3-8b": (32, 8, 128, False, True, False, False, 0, None, (0, 36), "neox", 128, 1e6, "none", None),
}


def _spec(name, **kw):
    return spec_from_hf_config(os.path.join(CFG, f"{name}.json"), name=name, **kw)


def _raw(name):
    with open(os.path.join(CFG, f"{name}.json")) as f:
        return json.load(f)


def test_every_shipped_config_is_asserted():
    assert CONFIGS == sorted(EXPECTED)
    types = {_raw(n)["model_type"] for n in CONFIGS}
    from flintgen import hf
    assert types == set(hf.MODEL_TYPES) | set(hf.TEXT_CONFIG_TYPES), "a mapped model type has no shipped config"


@pytest.mark.parametrize("name", CONFIGS)
def test_mapping(name):
    s = _spec(name)
    got = (s.num_q_heads, s.num_kv_heads, s.head_dim, s.qkv_bias, s.qk_norm, s.sinks, s.attn_logit_softcap,
           s.norm_weight_offset, s.sliding_window, (s.layer_types.count("sliding"), len(s.layer_types)),
           s.rope_style, s.rope_dim, s.rope_theta, s.rope_scaling, s.sliding_rope_theta)
    assert got == EXPECTED[name]
    assert s.softmax_scale is None        # every shipped query_pre_attn_scalar equals head_dim


def test_readme_table_is_generated():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert served_models.readme_table(text) == served_models.table(), \
        "README.md's served-models table is stale: run python tools/served_models.py --write"


# ------------------------------------------------------------------ model-type quirks on hand-made variants
def test_query_pre_attn_scalar_sets_the_scale():
    cfg = dict(_raw("gemma-2-9b"), num_attention_heads=32, num_key_value_heads=16, hidden_size=4608, head_dim=128,
               query_pre_attn_scalar=144)                  # Gemma-2-27B
    assert spec_from_hf_config(cfg).softmax_scale == pytest.approx(144 ** -0.5, rel=1e-15)
    assert spec_from_hf_config(dict(cfg, query_pre_attn_scalar=128)).softmax_scale is None  # = head_dim


def test_final_logit_softcapping_is_not_attention_softcap():
    cfg = dict(_raw("gemma-2-9b"), attn_logit_softcapping=None)
    assert spec_from_hf_config(cfg).attn_logit_softcap is False


def test_bias_from_the_model_type():
    q2 = {k: v for k, v in _raw("qwen2.5-7b-instruct").items() if k != "attention_bias"}
    assert spec_from_hf_config(dict(q2, attention_bias=False)).qkv_bias is True   # Qwen2Attention: bias=True always
    moe = _raw("qwen1.5-moe-a2.7b")
    assert spec_from_hf_config(dict(moe, qkv_bias=False)).qkv_bias is False      # its key: qkv_bias (default True)
    glm = {k: v for k, v in _raw("glm-4-9b-0414").items() if k != "attention_bias"}
    assert spec_from_hf_config(glm).qkv_bias is True                               # Glm4Config default
    assert spec_from_hf_config(dict(_raw("mistral-7b-v0.1"), attention_bias=True)).qkv_bias is False


def test_qk_norm_switch_of_glm4_moe():
    assert spec_from_hf_config(dict(_raw("glm-4.5-air"), use_qk_norm=True)).qk_norm is True


@pytest.mark.parametrize("name, changes, sliding", [
    ("qwen2.5-7b-instruct", dict(use_sliding_window=True, sliding_window=4096, max_window_layers=20), range(20, 28)),
    ("qwen1.5-moe-a2.7b", dict(use_sliding_window=True, sliding_window=4096, max_window_layers=21),
     range(0, 21, 2)),
    ("qwen3-30b-a3b", dict(use_sliding_window=True, sliding_window=4096), range(48)),
    ("gemma-3-1b-it", dict(sliding_window_pattern=2), range(0, 26, 2)),
    ("mixtral-8x7b-v0.1", dict(sliding_window=4096), range(32)),
    ("llama-3.1-8b", dict(sliding_window=4096), ()),                  # Llama has no sliding attention
])
def test_layer_kind_rules(name, changes, sliding):
    s = spec_from_hf_config(dict(_raw(name), **changes))
    assert [i for i, t in enumerate(s.layer_types) if t == "sliding"] == list(sliding)


def test_explicit_layer_types_win():
    cfg = dict(_raw("gemma-2-9b"), num_hidden_layers=3, layer_types=["full_attention"] * 2 + ["sliding_attention"])
    assert spec_from_hf_config(cfg).layer_types == ("full", "full", "sliding")


def test_gemma3_text_config_defaults():
    """gemma-3-4b-it's text_config lists only what differs from Gemma3TextConfig."""
    s = _spec("gemma-3-4b-it")
    assert (s.hidden_size, s.rms_eps, s.sliding_window) == (2560, 1e-6, 1024)
    assert s.rope_scaling_params == (("factor", 8.0),)


@pytest.mark.parametrize("cfg, match", [
    ({"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "rope_theta": 1e4},
     r"model_type 'deepseek_v3': its multi-head latent attention \(MLA\) is not implemented \(supported: \["),
    ({"model_type": "bloom", "hidden_size": 1024, "num_attention_heads": 16, "rope_theta": 1e4},
     r"model_type 'bloom': sinks, q/k norm, bias and layer kinds are unknown .*'gemma3'"),
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     r"model_type 'gemma3' keeps its language model in text_config, which is None"),
    (dict(json.load(open(os.path.join(CFG, "gemma-3-1b-it.json"))), use_bidirectional_attention=True),
     r"use_bidirectional_attention: true .*not supported"),
    (dict(json.load(open(os.path.join(CFG, "gemma-2-9b.json"))), query_pre_attn_scalar=0),
     r"query_pre_attn_scalar: 0 is not a number > 0"),
    (dict(json.load(open(os.path.join(CFG, "mistral-7b-v0.1.json"))), sliding_window=0.5),
     r"sliding_window: 0.5 is not a positive int"),
])
def test_refusals(cfg, match):
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config(cfg)


def test_kv_cache_dtype_is_the_callers():
    """config.json does not say the serving cache's dtype: bf16 unless asked;
    fp8_e4m3 passes through, other values are refused by the spec, by name."""
    path = os.path.join(CFG, "qwen3-8b.json")
    assert spec_from_hf_config(path).kv_cache_dtype == "bf16"
    s = spec_from_hf_config(path, kv_cache_dtype="fp8_e4m3")
    assert s.kv_cache_dtype == "fp8_e4m3" and s.replace(kv_cache_dtype="bf16") == spec_from_hf_config(path)
    with pytest.raises(ValueError, match=r"maps to a spec flintgen does not support: .*'kv_cache_dtype' = "
                                         r"'fp8_e5m2'.*Use kv_cache_dtype = 'fp8_e4m3'"):
        spec_from_hf_config(path, kv_cache_dtype="fp8_e5m2")


# ------------------------------------------------------------------ every config builds
@pytest.mark.parametrize("name", CONFIGS)
def test_variants_exist(name):
    s = _spec(name)
    for k, kd in KERNELS.items():
        if kd.needed(s):
            assert kd.variants(s, T132), (name, k)


def _build_plan(name):
    """(kdef, spec, variant): the QKV GEMV, both rms_norm variants and, per
    layer kind, decode attention's variants for batch 1 and max_batch (the
    rest of each config's decode variants differ only in launch constants the
    grid, tests/test_decode_attention_grid.py, compiles)."""
    from flintgen.kernels.decode_attention import _configs, _variant

    s = _spec(name)
    plan = [(KERNELS["qkv"], s, v) for v in KERNELS["qkv"].variants(s, T132)]
    plan += [(KERNELS["rms_norm"], s, v) for v in KERNELS["rms_norm"].variants(s, T132)]
    da = KERNELS["decode_attention"]
    for sliding in sorted({t == "sliding" for t in s.layer_types}):
        cfgs = _configs(s, T132, sliding)
        for b in sorted({1, max(cfgs)}):
            plan.append((da, s, _variant(s, sliding, cfgs[b])))
    return plan


@pytest.mark.compile
@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds(name):
    from decode_attention_cases import check_compiled
    from flintgen.runtime import load_variant

    for kd, s, v in _build_plan(name):
        load_variant(kd, s, v, T132)
        check_compiled(kd, s, v, T132)
