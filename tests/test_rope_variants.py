"""RoPE variants against transformers: partial rotary (rotary_dim), NeoX and
interleaved (GPT-J / GLM-4) pairing, per-layer-type (theta, scaling) (Gemma 3),
linear and longrope scaling (Phi-3 / Phi-3.5 / Phi-4-mini) beside default,
llama3 and YaRN; the config.json parsing of each; the spec fields' validation
and canonical form.

The tables are compared in two ways: the inverse frequencies and attention
factor exactly (fp32, bit for bit) with what transformers' rotary embedding
holds after its forward, and the table's cos / sin (fp64 angles) with that
forward's fp32 output, within fp32's own angle error p * 2^-24 * |f|.

Longrope factor lists below are synthetic (48 per-frequency numbers of the
right shape: real checkpoints' lists are not shipped here); the formulas do not
depend on their values.
"""

import json
import math

import pytest
import torch

from flintgen import Spec
from flintgen.hf import rope_fields_from_hf_config, spec_from_hf_config
from flintgen.presets import PRESETS, FLINT
from flintgen.references.qkv import qk_norm_rope_ref, rope_ref
from flintgen.rope_tables import inv_freq_and_factor, rope_table

transformers = pytest.importorskip("transformers")

SHORT48 = [round(1.0 + 0.0125 * i, 4) for i in range(48)]
LONG48 = [round(1.08 ** i, 4) for i in range(48)]

PHI4_MINI = {  # microsoft/Phi-4-mini-instruct (factor lists synthetic)
    "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "short_factor": SHORT48, "long_factor": LONG48},
}
PHI35_MINI = {  # microsoft/Phi-3.5-mini-instruct / Phi-3-mini-128k (head_dim 96, whole head rotates)
    "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
    "num_hidden_layers": 32, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": 262143,
    "rope_scaling": {"type": "longrope", "short_factor": SHORT48, "long_factor": LONG48},
}
GEMMA3_4B = {  # google/gemma-3-4b-it text config, the older keys
    "model_type": "gemma3_text", "hidden_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "num_hidden_layers": 12, "max_position_embeddings": 131072, "sliding_window": 1024,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rms_norm_eps": 1e-6,
}
GLM4_9B = {  # THUDM/GLM-4-9B-0414 (partial_rotary_factor 0.5 also the config class's default)
    "model_type": "glm4", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
    "head_dim": 128, "num_hidden_layers": 40, "max_position_embeddings": 32768, "partial_rotary_factor": 0.5,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "attention_bias": True,
}
GLM45_AIR = {  # zai-org/GLM-4.5-Air attention shape
    "model_type": "glm4_moe", "hidden_size": 4096, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "num_hidden_layers": 46, "max_position_embeddings": 131072, "partial_rotary_factor": 0.5,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "attention_bias": True,
}

BASE_HASHES = {  # spec_hash of the presets before rotary_dim / sliding_rope_* existed (branch base 765ef16)
    "flint": "83cc05424e6a3d2f", "gpt-oss-20b": "7961b4bd7d5d9168", "qwen3-8b": "369be6805be5ed56",
    "llama-3.1-8b": "4a0cedb7c9d91502",
}


def _quiet(fn, *a, **k):
    from transformers.utils import logging

    v = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return fn(*a, **k)
    finally:
        logging.set_verbosity(v)


def _hf_config(cls_name, cfg):
    raw = {k: v for k, v in cfg.items() if k != "model_type"}
    return _quiet(getattr(transformers, cls_name), **json.loads(json.dumps(raw)))


def _spec(cfg, **over):
    """The flintgen spec of a config dict through the RoPE parser (model types not in hf.MODEL_TYPES yet)."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layer_types = over.pop("layer_types", ("full",))
    fields, problems = rope_fields_from_hf_config(cfg, hd, layer_types)
    assert not problems, problems
    window = over.pop("sliding_window", 4096 if "sliding" in layer_types else None)
    return Spec(name=cfg["model_type"], hidden_size=cfg["hidden_size"], num_q_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg["num_key_value_heads"], head_dim=hd, weight_format="bf16", sinks=False,
                qk_norm=False, layer_types=layer_types, sliding_window=window, **fields, **over)


def _check_forward(table, emb_fn, positions, inv_check=None):
    """table rows vs transformers' rotary embedding for a one-token step at each
    position: ``emb_fn(x, position_ids)`` -> (cos, sin, inv_freq, attention
    scaling) after its forward. Tight against fp64 angles of its inv_freq, and
    against its fp32 cos / sin within fp32's own angle error."""
    x = torch.zeros(1, dtype=torch.float32)
    r = table.shape[1]
    for p in positions:
        cos, sin, inv, attn = emb_fn(x, torch.tensor([[p]]))
        cos, sin = cos.reshape(-1), sin.reshape(-1)
        assert cos.shape[0] == r and inv.shape[0] == r // 2, (cos.shape, r)
        ang = p * inv.double()
        assert torch.allclose(table[p].double(), torch.cat([ang.cos(), ang.sin()]) * attn, atol=1e-6, rtol=0), p
        tol = 2e-6 + 4 * p * 2.0 ** -24 * float(inv.max())
        assert torch.allclose(table[p, : r // 2].double(), cos[: r // 2].double(), atol=tol, rtol=0), p
        assert torch.allclose(table[p, r // 2:].double(), sin[: r // 2].double(), atol=tol, rtol=0), p
        assert torch.equal(cos[: r // 2], cos[r // 2:])  # transformers' cat(freqs, freqs)
        if inv_check is not None:
            inv_check(p, inv)


# ------------------------------------------------------------------ scalings vs ROPE_INIT_FUNCTIONS
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
             "beta_slow": 1.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                    "mscale_all_dim": 0.707},
}


@pytest.mark.parametrize("prf", [1.0, 0.5, 0.75])
@pytest.mark.parametrize("name", sorted(SCALINGS) + ["default", "longrope"])
def test_inv_freq_matches_rope_init_functions(name, prf):
    """Each scaling's fp32 inverse frequencies and attention factor, bit for bit,
    whole-head and partial rotary (transformers' dim = int(head_dim * prf))."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0, "partial_rotary_factor": prf}
    r = int(128 * prf)
    if name == "longrope":
        cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": SHORT48[: r // 2] + [1.0] * (r // 2 - 48),
                               "long_factor": (LONG48 * 2)[: r // 2], "original_max_position_embeddings": 4096}
    elif name != "default":
        cfg["rope_scaling"] = dict(SCALINGS[name])
    spec = _spec(cfg)
    assert spec.rope_dim == r and (spec.rotary_dim is None) == (prf == 1.0)
    config = _hf_config("LlamaConfig", cfg)
    kind = cfg.get("rope_scaling", {}).get("rope_type", "default")
    for seq_len in ([None, 4096, 4097, 100000] if kind == "longrope" else [None]):
        if kind == "default":  # transformers 5 keeps it on the model classes; Phi-3's reads partial_rotary_factor
            from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

            inv_ref, a_ref = Phi3RotaryEmbedding.compute_default_rope_parameters(config)
        else:
            inv_ref, a_ref = _quiet(ROPE_INIT_FUNCTIONS[kind], config, "cpu", seq_len=seq_len)
        inv, a = inv_freq_and_factor(spec, seq_len=seq_len)
        assert inv.shape == (r // 2,) and torch.equal(inv, inv_ref.float()), (seq_len, (inv - inv_ref).abs().max())
        assert a == pytest.approx(a_ref, rel=1e-12)
    t = rope_table(spec, 6000)
    assert t.shape == (6000, r) and t.dtype == torch.float32


def test_linear_table_vs_llama_rotary_embedding():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 16384, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    spec = _spec(cfg)
    assert spec.rope_scaling == "linear" and spec.rope_scaling_params == (("factor", 4.0),)
    emb = LlamaRotaryEmbedding(_hf_config("LlamaConfig", cfg))
    _check_forward(rope_table(spec, 16384), lambda x, p: (*emb(x, p), emb.inv_freq, emb.attention_scaling),
                   [0, 1, 777, 4095, 16383])
    assert torch.equal(inv_freq_and_factor(spec)[0], emb.inv_freq)


# ------------------------------------------------------------------ longrope (Phi-3 / Phi-3.5 / Phi-4-mini)
@pytest.mark.parametrize("cfg", [PHI4_MINI, PHI35_MINI], ids=["phi4-mini", "phi3.5-mini"])
def test_longrope_vs_phi3_rotary_embedding(cfg):
    """Row p = what Phi3RotaryEmbedding computes for a decode step of one token
    at position p: short factors up to original_max_position_embeddings - 1,
    long factors from it on (its seq_len = p + 1 > 4096 test); the attention
    factor sqrt(1 + ln 32 / ln 4096) from max_position_embeddings / original."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    spec = _spec(cfg)
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert spec.rope_dim == int(hd * cfg.get("partial_rotary_factor", 1.0)) == 96
    assert spec.rope_scaling == "longrope" and spec.rope_style == "neox"
    params = dict(spec.rope_scaling_params)
    assert params["factor"] == 32.0 and params["original_max_position_embeddings"] == 4096.0
    assert params["short_factor"] == tuple(SHORT48) and params["long_factor"] == tuple(LONG48)
    config = _hf_config("Phi3Config", cfg)
    emb = Phi3RotaryEmbedding(config)
    a = inv_freq_and_factor(spec)[1]
    assert a == pytest.approx(emb.attention_scaling, rel=1e-12)
    assert a == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    short = inv_freq_and_factor(spec, seq_len=4096)[0]
    long = inv_freq_and_factor(spec, seq_len=4097)[0]
    assert not torch.equal(short, long)

    def inv_check(p, inv):
        assert torch.equal(inv, long if p >= 4096 else short), p

    positions = [0, 1, 100, 2047, 4094, 4095, 4096, 4097, 5000, 32767, 70001, 131071]
    table = rope_table(spec, 131072)
    _check_forward(table, lambda x, p: (*emb(x, p), emb.inv_freq.clone(), emb.attention_scaling), positions,
                   inv_check)
    # the one-factor-set tables (a caller reproducing transformers' per-forward choice)
    ts, tl = rope_table(spec, 8192, longrope="short"), rope_table(spec, 8192, longrope="long")
    assert torch.equal(ts[:4096], table[:4096]) and torch.equal(tl[4096:], table[4096:8192])
    assert not torch.allclose(tl[:4096], table[:4096])


def test_longrope_prefill_differs_as_documented():
    """transformers picks one factor set per forward (max position + 1 > 4096):
    a long prompt's early positions use the long factors; the per-position
    table keeps the short ones there, and the 'long' table matches it."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    spec = _spec(PHI4_MINI)
    emb = Phi3RotaryEmbedding(_hf_config("Phi3Config", PHI4_MINI))
    cos, _ = emb(torch.zeros(1), torch.arange(5000)[None])
    cos = cos[0, :, :48].double()
    assert torch.allclose(rope_table(spec, 5000, longrope="long")[:, :48].double(), cos, atol=1e-3)
    assert not torch.allclose(rope_table(spec, 5000)[:, :48].double(), cos, atol=1e-3)


def test_phi3_transformers5_form_and_su_alias():
    """The same spec from config.json's older keys (type 'su' too), transformers-5's
    flat rope_parameters (partial_rotary_factor and original length inside), and
    spec_from_hf_config (phi3 is a known model type)."""
    a = _spec(PHI4_MINI)
    d5 = json.loads(json.dumps(_hf_config("Phi3Config", PHI4_MINI).to_dict()))
    assert "full_attention" not in d5["rope_parameters"]
    assert _spec(dict(d5, model_type="phi3")) == a
    su = dict(PHI4_MINI, rope_scaling=dict(PHI4_MINI["rope_scaling"], type="su"))
    assert _spec(su) == a
    s = spec_from_hf_config(PHI4_MINI, name="phi4-mini")
    assert (s.rotary_dim, s.rope_scaling, s.rope_theta) == (96, "longrope", 10000.0)
    # its sliding_window 262144 is past max_position_embeddings 131072: full attention
    assert s.rope_scaling_params == a.rope_scaling_params and s.layer_types == ("full",) * 32


# ------------------------------------------------------------------ Gemma 3: (theta, scaling) per layer type
@pytest.mark.parametrize("form", ["older_keys", "transformers5"])
def test_gemma3_two_ropes(form):
    """Sliding layers: theta 10k unscaled; full layers: theta 1M, linear x8 --
    from the older keys and from transformers-5's rope_parameters keyed by
    layer type; each table vs Gemma3RotaryEmbedding for its layer type."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = _hf_config("Gemma3TextConfig", GEMMA3_4B)
    cfg = GEMMA3_4B if form == "older_keys" else dict(json.loads(json.dumps(config.to_dict())), model_type="gemma3_text")
    if form == "transformers5":
        assert set(cfg["rope_parameters"]) == {"full_attention", "sliding_attention"}
        assert "rope_scaling" not in cfg or cfg["rope_scaling"] is None
    layer_types = tuple("full" if t == "full_attention" else "sliding" for t in config.layer_types)
    spec = _spec(cfg, layer_types=layer_types, sliding_window=1024)
    assert (spec.rope_theta, spec.rope_scaling, spec.rope_scaling_params) == (1e6, "linear", (("factor", 8.0),))
    assert (spec.sliding_rope_theta, spec.sliding_rope_scaling, spec.sliding_rope_scaling_params) == (1e4, "none", ())
    assert spec.rope_for("sliding") == (1e4, "none", ()) and spec.rotary_dim is None
    emb = Gemma3RotaryEmbedding(config)
    for ours, theirs in (("full", "full_attention"), ("sliding", "sliding_attention")):
        table = rope_table(spec, 40000, layer_type=ours)
        assert table.shape == (40000, 256)
        inv = getattr(emb, f"{theirs}_inv_freq")
        assert torch.equal(inv_freq_and_factor(spec, ours)[0], inv)
        attn = getattr(emb, f"{theirs}_attention_scaling")
        _check_forward(table, lambda x, p: (*emb(x, p, theirs), inv, attn), [0, 1, 1023, 1024, 8191, 39999])
    assert not torch.allclose(rope_table(spec, 64, layer_type="full"), rope_table(spec, 64, layer_type="sliding"))


def test_gemma3_round_trip_and_hash():
    config = _hf_config("Gemma3TextConfig", GEMMA3_4B)
    layer_types = tuple("full" if t == "full_attention" else "sliding" for t in config.layer_types)
    spec = _spec(GEMMA3_4B, layer_types=layer_types, sliding_window=1024)
    d = json.loads(spec.canonical_json())
    assert d["sliding_rope_theta"] == 1e4 and "sliding_rope_scaling" not in d  # default 'none' left out
    back = Spec.from_dict(d)
    assert back == spec and back.spec_hash == spec.spec_hash
    assert spec.replace(sliding_rope_theta=None).spec_hash != spec.spec_hash


# ------------------------------------------------------------------ GLM-4: partial + interleaved / NeoX
@pytest.mark.parametrize("cfg, cls, mod, style", [
    (GLM4_9B, "Glm4Config", "glm4", "interleaved"),
    (GLM45_AIR, "Glm4MoeConfig", "glm4_moe", "neox"),
], ids=["glm4", "glm4_moe"])
def test_glm_partial_rotary(cfg, cls, mod, style):
    """GLM-4 rotates the first half of each head (64 of 128 dims): interleaved
    pairs for glm4, NeoX for glm4_moe. The table vs the model's rotary
    embedding; the fp64 / fp32 references vs the model's apply_rotary_pos_emb
    on the same cos / sin; the last 64 dims pass through."""
    import importlib

    m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
    spec = _spec(cfg)
    assert (spec.rotary_dim, spec.rope_dim, spec.rope_style) == (64, 64, style)
    # without partial_rotary_factor in config.json: the config class's default 0.5
    assert _spec({k: v for k, v in cfg.items() if k != "partial_rotary_factor"}) == spec
    config = _hf_config(cls, cfg)
    emb = getattr(m, [n for n in dir(m) if n.endswith("RotaryEmbedding")][0])(config)
    table = rope_table(spec, 32768)
    assert table.shape == (32768, 64)
    assert torch.equal(inv_freq_and_factor(spec)[0], emb.inv_freq)
    _check_forward(table, lambda x, p: (*emb(x, p), emb.inv_freq, emb.attention_scaling), [0, 5, 4095, 32767])

    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 3, 1000, 32767, 12345])
    q = torch.randn(len(pos), 4, 128, generator=g, dtype=torch.float64)
    k = torch.randn(len(pos), 2, 128, generator=g, dtype=torch.float64)
    cs = table[pos].double()
    cos = torch.cat([cs[:, :32], cs[:, :32]], -1)[None]   # transformers' [B, S, R] cat(freqs, freqs)
    sin = torch.cat([cs[:, 32:], cs[:, 32:]], -1)[None]
    q_hf, k_hf = m.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_hf, k_hf = q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)
    q_ref, k_ref = rope_ref(q, table, pos, style), rope_ref(k, table, pos, style)
    assert torch.allclose(q_ref, q_hf, atol=1e-14, rtol=0) and torch.allclose(k_ref, k_hf, atol=1e-14, rtol=0)
    assert torch.equal(q_ref[..., 64:], q[..., 64:])
    other = "neox" if style == "interleaved" else "interleaved"
    assert not torch.allclose(rope_ref(q, table, pos, other), q_hf, atol=1e-3)
    # the fp32 reference of the QKV step (kernel rows -> norm + rope), bf16 rows in
    pre = q.reshape(len(pos), -1).bfloat16()
    out, mag = qk_norm_rope_ref(pre, 128, cos_sin=table, positions=pos, rope_style=style)
    want = rope_ref(pre.double().view(len(pos), 4, 128), table, pos, style).reshape(len(pos), -1)
    assert out.dtype == torch.float32 and torch.allclose(out.double(), want, atol=2e-6, rtol=0)
    assert torch.equal(mag.view(len(pos), 4, 128)[..., 64:], pre.float().view(len(pos), 4, 128)[..., 64:].abs())


def test_qk_norm_rope_ref_whole_head_neox_unchanged():
    """rotary_dim = head_dim, NeoX: the reference is the pre-change formula."""
    g = torch.Generator().manual_seed(1)
    pre = torch.randn(3, 2 * 128, generator=g).bfloat16()
    table = rope_table(FLINT, 100)
    pos = torch.tensor([0, 7, 99])
    out, _ = qk_norm_rope_ref(pre, 128, cos_sin=table, positions=pos)
    x = pre.float().view(3, 2, 128)
    c, s = table[pos][:, None, :64], table[pos][:, None, 64:]
    x1, x2 = x[..., :64], x[..., 64:]
    assert torch.equal(out, torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(3, 256))


# ------------------------------------------------------------------ config.json refusals
_LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
          "rope_theta": 1e4, "max_position_embeddings": 8192}


@pytest.mark.parametrize("changes, layer_types, words", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ("full",),
     ["rope_scaling.rope_type 'dynamic'", "'linear'", "'longrope'", "'yarn'"]),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, ("full",),
     ["rope_scaling.rope_type 'proportional' (in rope_parameters)"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                          "sliding_attention": {"rope_type": "default"}}}, ("sliding", "full"),
     ["rope_scaling.rope_type 'dynamic' (in rope_parameters['full_attention'])"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": None}},
     ("sliding", "full"), ["rope_parameters['sliding_attention']: null"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, ("sliding", "full"),
     ["no 'sliding_attention' entry"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "partial_rotary_factor": 0.5},
                          "sliding_attention": {"rope_type": "default"}}}, ("sliding", "full"),
     ["partial_rotary_factor: differs"]),
    ({"partial_rotary_factor": 1.5}, ("full",), ["partial_rotary_factor: 1.5"]),
    ({"rope_scaling": "linear"}, ("full",), ["rope_scaling: 'linear' is not an object"]),
])
def test_unsupported_rope_configs_are_named(changes, layer_types, words):
    _, problems = rope_fields_from_hf_config(dict(_LLAMA, **changes), 128, layer_types)
    msg = "; ".join(problems)
    for w in words:
        assert w in msg, (w, msg)


def test_hf_refusal_through_spec_from_hf_config():
    cfg = dict(_LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type 'dynamic': supported are \['default', "
                                         r"'linear', 'llama3', 'longrope', 'yarn'\]"):
        spec_from_hf_config(cfg)
    # odd rotary_dim from the factor: the spec refuses it, naming the field
    with pytest.raises(ValueError, match=r"'rotary_dim' = 25 .*even number in 2\.\.head_dim = 128"):
        spec_from_hf_config(dict(_LLAMA, partial_rotary_factor=0.2))


def test_original_max_position_embeddings_sources():
    """As transformers' standardize_rope_params: the flat rope_scaling's value,
    overridden by a top-level one (Phi-3), defaulting to max_position_embeddings;
    yarn / longrope's factor from max_position_embeddings / original when absent."""
    y = {"rope_type": "yarn", "factor": 4.0}
    f, _ = rope_fields_from_hf_config(dict(_LLAMA, rope_scaling=y), 128)
    assert dict(f["rope_scaling_params"])["original_max_position_embeddings"] == 8192
    f, _ = rope_fields_from_hf_config(dict(_LLAMA, rope_scaling=dict(y, original_max_position_embeddings=2048),
                                           original_max_position_embeddings=1024), 128)
    assert dict(f["rope_scaling_params"])["original_max_position_embeddings"] == 1024
    f, _ = rope_fields_from_hf_config(dict(_LLAMA, rope_scaling={"rope_type": "yarn",
                                                                 "original_max_position_embeddings": 2048}), 128)
    assert dict(f["rope_scaling_params"])["factor"] == 4.0
    f, _ = rope_fields_from_hf_config(dict(_LLAMA, rope_scaling={"rope_type": "default", "factor": 3.0}), 128)
    assert f["rope_scaling"] == "none" and f["rope_scaling_params"] == {}


def test_existing_hf_mappings_unchanged():
    """The shipped configs map to the presets (and their base hashes)."""
    import os

    cfg_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_configs")
    for name in ("gpt-oss-20b", "qwen3-8b", "llama-3.1-8b"):
        s = spec_from_hf_config(os.path.join(cfg_dir, f"{name}.json"), name=name)
        assert s == PRESETS[name] and s.spec_hash == BASE_HASHES[name]
        assert s.rotary_dim is None and s.sliding_rope_theta is None and s.rope_style == "neox"


# ------------------------------------------------------------------ spec fields
def test_preset_hashes_unchanged_by_new_fields():
    for name, h in BASE_HASHES.items():
        s = PRESETS[name]
        assert s.spec_hash == h, name
        d = json.loads(s.canonical_json())
        assert not {"rotary_dim", "sliding_rope_theta", "sliding_rope_scaling", "sliding_rope_scaling_params"} & set(d)


def test_normalized_spellings_hash_equally():
    assert FLINT.replace(rotary_dim=128) == FLINT and FLINT.replace(rotary_dim=128).spec_hash == FLINT.spec_hash
    same = FLINT.replace(sliding_rope_theta=FLINT.rope_theta)
    assert same == FLINT and same.sliding_rope_theta is None and same.spec_hash == FLINT.spec_hash
    assert FLINT.replace(rotary_dim=64).spec_hash != FLINT.spec_hash
    assert FLINT.replace(rope_style="interleaved").spec_hash != FLINT.spec_hash
    # rotary_dim is absolute: changing head_dim keeps it
    assert FLINT.replace(rotary_dim=64).replace(head_dim=256).rope_dim == 64
    assert FLINT.replace(head_dim=256).rope_dim == 256


def test_longrope_params_round_trip(tmp_path):
    spec = FLINT.replace(rope_scaling="longrope", rotary_dim=96, rope_scaling_params={
        "short_factor": SHORT48, "long_factor": LONG48, "factor": 32, "original_max_position_embeddings": 4096})
    assert dict(spec.rope_scaling_params)["short_factor"] == tuple(SHORT48)
    d = json.loads(spec.canonical_json())
    assert d["rotary_dim"] == 96 and d["rope_scaling_params"]["long_factor"] == LONG48
    assert Spec.from_dict(d) == spec and Spec.from_dict(d).spec_hash == spec.spec_hash
    j = tmp_path / "s.json"
    j.write_text(spec.canonical_json())
    assert Spec.from_file(j) == spec
    t = tmp_path / "s.toml"
    t.write_text('preset = "flint"\nrope_scaling = "longrope"\nrotary_dim = 96\nrope_scaling_params = { '
                 f"short_factor = {SHORT48}, long_factor = {LONG48}, factor = 32.0, "
                 "original_max_position_embeddings = 4096 }\n")
    assert Spec.from_file(t) == spec
    hash(spec)


@pytest.mark.parametrize("changes, exc, match", [
    ({"rotary_dim": 63}, ValueError, r"'rotary_dim' = 63 .*even number in 2\.\.head_dim = 128.*partial_rotary_factor"),
    ({"rotary_dim": 0}, ValueError, r"'rotary_dim' = 0 .*>= 1"),
    ({"rotary_dim": 256}, ValueError, r"'rotary_dim' = 256 .*2\.\.head_dim = 128"),
    ({"rotary_dim": 64.0}, TypeError, r"'rotary_dim' must be an int"),
    ({"rotary_dim": 64, "rope_style": "none"}, ValueError, r"'rotary_dim' = 64 .*rope_style is 'none'.*Remove"),
    ({"rope_style": "gptj"}, ValueError, r"'rope_style' = 'gptj' .*\['neox', 'interleaved', 'none'\]"),
    ({"sliding_rope_scaling": "linear"}, ValueError,
     r"'sliding_rope_scaling' = 'linear' .*need sliding_rope_theta.*Set sliding_rope_theta"),
    ({"sliding_rope_theta": 1e4, "sliding_rope_scaling": "ntk"}, ValueError,
     r"'sliding_rope_scaling' = 'ntk' .*\['none', 'linear', 'llama3', 'yarn', 'longrope'\]"),
    ({"sliding_rope_theta": -1.0}, ValueError, r"'sliding_rope_theta' = -1.0 .*> 0"),
    ({"sliding_rope_theta": "1e4"}, TypeError, r"'sliding_rope_theta' must be a number"),
    ({"sliding_rope_theta": 1e4, "layer_types": ("full",), "sliding_window": None}, ValueError,
     r"'sliding_rope_theta' = 10000.0 .*no layer in layer_types is 'sliding'"),
    ({"sliding_rope_theta": 1e4, "rope_style": "none"}, ValueError, r"'sliding_rope_theta' .*rope_style is 'none'"),
    ({"rope_scaling": "longrope", "rope_scaling_params": {"short_factor": [1.0] * 48, "long_factor": [1.0] * 64}},
     ValueError, r"'rope_scaling_params\.short_factor' = '<48 numbers>' .*rotary_dim / 2 = 64"),
    ({"rope_scaling": "yarn", "rope_scaling_params": {"short_factor": [1.0] * 64}}, ValueError,
     r"'rope_scaling_params\.short_factor' .*list-valued parameters are longrope's.*Remove short_factor"),
    ({"rope_scaling_params": {"long_factor": [1.0, "x"]}}, ValueError,
     r"'rope_scaling_params\.long_factor' = \[1\.0, 'x'\] .*list of finite numbers > 0"),
    ({"rope_scaling_params": {"long_factor": 2.0}}, ValueError, r"'rope_scaling_params\.long_factor' = 2\.0 .*list"),
    ({"rope_scaling_params": {"factor": [2.0]}}, ValueError, r"'rope_scaling_params\.factor' = \[2\.0\] .*finite number"),
    ({"rope_scaling_params": [("factor", 1.0), ("factor", 2.0)]}, ValueError,
     r"'rope_scaling_params\.factor' = 2\.0 .*each parameter once"),
    ({"sliding_rope_theta": 1e4, "sliding_rope_scaling_params": {"factor": "x"}}, ValueError,
     r"'sliding_rope_scaling_params\.factor' = 'x'"),
])
def test_new_fields_rejected(changes, exc, match):
    with pytest.raises(exc, match=match):
        FLINT.replace(**changes)


def test_rope_table_errors_new():
    s = FLINT.replace(rope_scaling="longrope", rotary_dim=96,
                      rope_scaling_params={"short_factor": SHORT48, "long_factor": LONG48,
                                           "original_max_position_embeddings": 4096})
    with pytest.raises(ValueError, match=r"rope_scaling 'longrope' needs rope_scaling_params \['factor'\]"):
        rope_table(s, 8)
    assert rope_table(s.replace(rope_scaling_params=dict(s.rope_scaling_params, attention_factor=1.2)), 8).shape == (8, 96)
    with pytest.raises(ValueError, match=r"layer_type 'local' is not supported: supported values are \['full', 'sliding'\]"):
        rope_table(FLINT, 8, layer_type="local")
    with pytest.raises(ValueError, match=r"longrope 'auto' is not supported"):
        rope_table(FLINT, 8, longrope="auto")
    g = FLINT.replace(sliding_rope_theta=1e4, sliding_rope_scaling="linear")
    with pytest.raises(ValueError, match=r"sliding_rope_scaling 'linear' needs sliding_rope_scaling_params \['factor'\]"):
        rope_table(g, 8, layer_type="sliding")
    # no sliding_rope_*: the sliding table is the main one
    assert torch.equal(rope_table(FLINT, 16, layer_type="sliding"), rope_table(FLINT, 16))


def test_qkv_kernel_builds_partial_and_interleaved():
    """Partial rotary and interleaved pairs are variants of their own (the
    epilogue's lane mapping, flintgen.layout.EpilogueLanes); a
    rotary_dim the mapping cannot split is refused, naming it and the fix."""
    from flintgen.kernels import KERNELS
    from flintgen.kernels.base import Target

    k, t = KERNELS["qkv"], Target("sm_90a", 132)
    (base,) = k.variants(FLINT, t)
    assert (base["rope_dim"], base["interleaved"]) == (128, False)
    seen = {base}
    for spec, want in ((FLINT.replace(rotary_dim=64), (64, False)), (FLINT.replace(rope_style="interleaved"), (128, True)),
                       (FLINT.replace(rotary_dim=64, rope_style="interleaved"), (64, True)),
                       (FLINT.replace(rotary_dim=96), (96, False))):
        (v,) = k.variants(spec, t)
        assert (v["rope_dim"], v["interleaved"]) == want and v not in seen
        seen.add(v)
    with pytest.raises(ValueError, match=r"kernel qkv \(spec 'flint'\): qkv: rotary_dim = 2 is not supported with "
                                         r"head_dim 128: .*use a rotary_dim that is, or the unfused path"):
        k.variants(FLINT.replace(rotary_dim=2), t)
    assert k.variants(FLINT.replace(sliding_rope_theta=1e4), t) == k.variants(FLINT, t)


@pytest.mark.parametrize("value, exc", [(1.0, ValueError), (2, ValueError), (-1, ValueError), (True, ValueError)])
def test_norm_weight_offset_rejected(value, exc):
    with pytest.raises(exc, match=r"'norm_weight_offset' = .* 0 \(weights scale as stored\) or 1 .*Gemma"):
        FLINT.replace(norm_weight_offset=value)


def test_norm_weight_offset_field():
    assert "norm_weight_offset" not in FLINT.to_dict()            # omitted at its default: hashes unchanged
    g = FLINT.replace(norm_weight_offset=1)
    assert g.to_dict()["norm_weight_offset"] == 1 and g.spec_hash != FLINT.spec_hash


def test_norm_weight_offset_is_a_variant():
    """norm_weight_offset 1 selects binaries of their own (rms_norm and the
    QKV GEMV's q/k norm add the offset in fp32)."""
    from flintgen.kernels import KERNELS
    from flintgen.kernels.base import Target

    g, t = FLINT.replace(norm_weight_offset=1), Target("sm_90a", 132)
    (v,) = KERNELS["qkv"].variants(g, t)
    assert v["norm_offset"] == 1 and v != KERNELS["qkv"].variants(FLINT, t)[0]
    # without q/k norm the offset changes nothing in the QKV GEMV: the same binary
    nn = FLINT.replace(qk_norm=False)
    assert KERNELS["qkv"].variants(nn.replace(norm_weight_offset=1), t) == KERNELS["qkv"].variants(nn, t)
