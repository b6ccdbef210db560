"""Hugging Face config.json import and RoPE tables."""

import json
import math
import os

import pytest
import torch

from flintgen.hf import spec_from_hf_config
from flintgen.rope_tables import inv_freq_and_factor, rope_table

CFG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_configs")


def _cfg(name):
    with open(os.path.join(CFG, f"{name}.json")) as f:
        return json.load(f)


def test_gpt_oss_mapping():
    s = spec_from_hf_config(_cfg("gpt-oss-20b"), name="gpt-oss-20b")
    assert (s.hidden_size, s.num_q_heads, s.num_kv_heads, s.head_dim) == (2880, 64, 8, 64)
    assert s.qkv_bias and s.sinks and not s.qk_norm and s.sliding_window == 128
    assert s.layer_types == ("sliding", "full") * 12 and s.rope_scaling == "yarn" and s.rms_eps == 1e-5
    s8 = spec_from_hf_config(_cfg("gpt-oss-20b"), tp_size=8)
    assert (s8.q_heads_per_rank, s8.kv_heads_per_rank) == (8, 1)


def test_qwen3_and_llama_mapping():
    q = spec_from_hf_config(_cfg("qwen3-8b"))
    assert (q.hidden_size, q.num_q_heads, q.num_kv_heads, q.head_dim) == (4096, 32, 8, 128)
    assert q.qk_norm and not q.sinks and not q.has_sliding and q.sliding_window is None
    assert q.rope_scaling == "none" and q.rope_theta == 1e6
    ll = spec_from_hf_config(_cfg("llama-3.1-8b"), weight_format="nvfp4", page_size=32)
    assert ll.head_dim == 128 and ll.rope_scaling == "llama3" and not ll.qk_norm and not ll.sinks
    assert ll.weight_format == "nvfp4" and ll.page_size == 32 and ll.num_layers == 32


def test_unmappable_fields_are_named():
    cfg = dict(_cfg("llama-3.1-8b"), model_type="bloom", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    cfg.pop("hidden_size")
    with pytest.raises(ValueError) as e:
        spec_from_hf_config(cfg)
    msg = str(e.value)
    assert "model_type 'bloom'" in msg and "rope_scaling.rope_type 'dynamic'" in msg and "hidden_size: missing" in msg


def test_attn_logit_softcapping_mapping():
    """A non-null attn_logit_softcapping (Gemma 2: 50.0) turns the spec's
    attn_logit_softcap on (the cap is decode attention's softcap argument);
    null or absent leaves it off; anything but a number > 0 is named."""
    base = _cfg("llama-3.1-8b")
    assert not spec_from_hf_config(base).attn_logit_softcap
    assert not spec_from_hf_config(dict(base, attn_logit_softcapping=None)).attn_logit_softcap
    for cap in (50.0, 30, 0.5):
        s = spec_from_hf_config(dict(base, attn_logit_softcapping=cap))
        assert s.attn_logit_softcap and s == spec_from_hf_config(base).replace(attn_logit_softcap=True)
    for bad in (0.0, -50.0, "50", True, float("inf")):
        with pytest.raises(ValueError, match=r"cannot map config to a flintgen spec: attn_logit_softcapping: "
                                             rf"{bad!r} is not a finite number > 0 \(the logit cap\) or null"):
            spec_from_hf_config(dict(base, attn_logit_softcapping=bad))


def test_tp_beyond_kv_heads_rule():
    with pytest.raises(ValueError, match=r"'tp_size' = 3"):
        spec_from_hf_config(_cfg("qwen3-8b"), tp_size=3)
    s = spec_from_hf_config(_cfg("qwen3-8b"), tp_size=16)
    assert s.kv_heads_per_rank == 1 and s.q_heads_per_rank == 2


def test_default_table_closed_form():
    s = spec_from_hf_config(_cfg("qwen3-8b"))
    t = rope_table(s, 1000)
    # inverse frequencies in fp32 (as transformers), angles in fp64
    f = (1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128))).double()
    p = 777
    assert torch.allclose(t[p, :64].double(), torch.cos(p * f), atol=1e-6)
    assert torch.allclose(t[p, 64:].double(), torch.sin(p * f), atol=1e-6)
    assert t.dtype == torch.float32 and t.shape == (1000, 128)


def test_yarn_attention_factor():
    _, a = inv_freq_and_factor(spec_from_hf_config(_cfg("gpt-oss-20b")))
    assert a == pytest.approx(0.1 * math.log(32) + 1)


@pytest.mark.parametrize("name, cls", [("gpt-oss-20b", "GptOssConfig"), ("qwen3-8b", "Qwen3Config"),
                                       ("llama-3.1-8b", "LlamaConfig")])
def test_against_transformers(name, cls):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = _cfg(name)
    config = getattr(transformers, cls)(**raw)
    rtype = (raw.get("rope_scaling") or {}).get("rope_type", "default")
    if rtype == "default":  # transformers 5 keeps the default on each model's rotary class
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        inv_ref, a_ref = Qwen3RotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_ref, a_ref = ROPE_INIT_FUNCTIONS[rtype](config, "cpu")
    spec = spec_from_hf_config(raw)
    inv, a = inv_freq_and_factor(spec)
    assert torch.equal(inv, inv_ref.float()), (inv - inv_ref).abs().max()
    assert a == pytest.approx(a_ref)
    pos = torch.arange(0, 4096, 37)
    t = rope_table(spec, 4096)[pos]
    ang = pos[:, None].double() * inv_ref.double()[None, :]
    assert torch.allclose(t.double(), torch.cat([ang.cos(), ang.sin()], 1) * a_ref, atol=2e-6)


def test_rope_table_errors():
    s = spec_from_hf_config(_cfg("qwen3-8b"))
    with pytest.raises(ValueError, match="max_pos must be a positive int, got 0"):
        rope_table(s, 0)
    with pytest.raises(ValueError, match="rope_style 'none'"):
        rope_table(s.replace(rope_style="none"), 8)
    with pytest.raises(ValueError, match=r"rope_scaling 'llama3' needs rope_scaling_params \['factor'"):
        rope_table(s.replace(rope_scaling="llama3"), 8)
