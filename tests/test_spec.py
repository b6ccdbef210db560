import json
import subprocess
import sys

import pytest

from flintgen import Spec, get_preset
from flintgen.kernels import KERNELS
from flintgen.kernels.base import Target
from flintgen.presets import FLINT


def test_flint_preset_fields():
    s = get_preset("flint")
    assert (s.hidden_size, s.num_q_heads, s.num_kv_heads, s.head_dim, s.page_size) == (2048, 32, 4, 128, 16)
    assert s.gqa == 8 and s.sinks and s.qk_norm and s.rope_style == "neox"
    assert s.weight_format == "nvfp4" and s.kv_layout == "HND" and s.rms_eps == 1e-6
    assert s.sliding_window == 128 and s.has_sliding and s.has_full
    assert s.max_batch == 256


def test_tp_per_rank_heads():
    s = FLINT.replace(tp_size=2)
    assert (s.q_heads_per_rank, s.kv_heads_per_rank) == (16, 2)
    s8 = FLINT.replace(tp_size=8)  # 4 kv heads over 8 ranks: replicated
    assert (s8.q_heads_per_rank, s8.kv_heads_per_rank) == (4, 1)
    assert s.qkv_out_features == (16 + 4) * 128


def test_hash_is_canonical_and_order_free():
    a = Spec.from_dict(json.loads(FLINT.canonical_json()))
    d = FLINT.to_dict()
    b = Spec.from_dict(dict(reversed(list(d.items()))))
    assert a == b == FLINT and hash(a) == hash(FLINT)
    assert a.spec_hash == b.spec_hash == FLINT.spec_hash
    assert FLINT.replace(rms_eps=1e-5).spec_hash != FLINT.spec_hash


def test_hash_same_in_another_process():
    code = "from flintgen import get_preset; print(get_preset('flint').spec_hash)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == FLINT.spec_hash


def test_from_files(tmp_path):
    t = tmp_path / "s.toml"
    t.write_text('preset = "flint"\nhidden_size = 4096\nweight_format = "bf16"\n')
    s = Spec.from_file(t)
    assert s.hidden_size == 4096 and s.weight_format == "bf16" and s.num_q_heads == 32
    j = tmp_path / "s.json"
    j.write_text(FLINT.canonical_json())
    assert Spec.from_file(j) == FLINT
    with pytest.raises(ValueError, match="unsupported extension"):
        Spec.from_file(tmp_path / "s.yaml")


@pytest.mark.parametrize("changes, exc, match", [
    ({"head_dim": 80}, ValueError, r"'head_dim' = 80 .*\[64, 96, 128, 256\]"),
    ({"page_size": 8}, ValueError, r"'page_size' = 8 .*\[16, 32, 64\]"),
    ({"num_q_heads": 30}, ValueError, r"'num_q_heads' = 30 .*multiple of num_kv_heads = 4"),
    ({"hidden_size": 2050}, ValueError, r"'hidden_size' = 2050 .*multiple of 16"),
    ({"hidden_size": 0}, ValueError, r"'hidden_size' = 0 .*>= 1"),
    ({"hidden_size": 2048.0}, TypeError, r"'hidden_size' must be an int"),
    ({"weight_format": "int4"}, ValueError, r"'weight_format' = 'int4'.*\['bf16', 'nvfp4'\]"),
    ({"kv_cache_dtype": "fp8"}, ValueError, r"'kv_cache_dtype' = 'fp8'"),
    ({"kv_layout": "NHD"}, ValueError, r"'kv_layout' = 'NHD'"),
    ({"max_tokens": 300}, ValueError, r"'max_tokens' = 300 .*1\.\.256 \(rms_norm 1\.\.256, qkv 1\.\.64\)"),
    ({"hidden_size": 2**40}, ValueError, r"'hidden_size' = 1099511627776 .*64\.\.32768"),
    ({"tp_size": 3}, ValueError, r"'tp_size' = 3"),
    ({"sinks": 1}, TypeError, r"'sinks' must be a bool"),
    ({"attn_logit_softcap": 1}, TypeError, r"'attn_logit_softcap' must be a bool, got int 1: write "
                                           r"attn_logit_softcap = true or attn_logit_softcap = false"),
    ({"attn_logit_softcap": 50.0}, TypeError, r"'attn_logit_softcap' must be a bool, got float 50.0"),
    ({"attn_logit_softcap": "true"}, TypeError, r"'attn_logit_softcap' must be a bool, got str 'true'"),
    ({"rope_style": "gptj"}, ValueError, r"'rope_style' = 'gptj'"),
    ({"rope_scaling": "dynamic"}, ValueError, r"'rope_scaling' = 'dynamic'.*'linear'.*'longrope'"),
    ({"rms_eps": -1.0}, ValueError, r"'rms_eps' = -1.0"),
    ({"rope_theta": float("nan")}, ValueError, r"'rope_theta'"),
    ({"layer_types": ("sliding", "local")}, ValueError, r"'layer_types\[1\]' = 'local'"),
    ({"layer_types": ()}, ValueError, r"'layer_types'"),
    ({"sliding_window": None}, ValueError, r"'sliding_window' = None .*'sliding' layers"),
    ({"layer_types": ("full",)}, ValueError, r"'sliding_window' = 128 .*no layer"),
    ({"max_batch": 5000}, ValueError, r"'max_batch' = 5000"),
    ({"softmax_scale": 0.0}, ValueError, r"'softmax_scale' = 0.0"),
])
def test_invalid_values_rejected(changes, exc, match):
    with pytest.raises(exc, match=match):
        FLINT.replace(**changes)


def test_unknown_field_and_preset():
    with pytest.raises(ValueError, match=r"unknown spec field\(s\) \['hiden_size'\]"):
        Spec.from_dict({"preset": "flint", "hiden_size": 1})
    with pytest.raises(ValueError, match="unknown preset 'flnt'.*'flint'"):
        get_preset("flnt")


def test_runtime_values_do_not_change_kernel_identity():
    """eps, scale, window length and RoPE theta are kernel arguments."""
    from flintgen import cache

    t = Target("sm_90a", 132)
    other = FLINT.replace(rms_eps=1e-5, softmax_scale=0.1, rope_theta=10000.0)

    def keys(spec):
        out = []
        for k in KERNELS.values():
            if k.needed(spec):
                for v in k.variants(spec, t):
                    out.append(cache.make_entry(v, k.template, dict(k.render_params(spec, v)), t, "/x").key)
        return sorted(out)

    assert keys(FLINT) == keys(other)


def test_attn_logit_softcap_field():
    """Off by default (every preset), and then left out of the canonical JSON
    (hashes of specs without capping unchanged); on, in it and the hash;
    round-trips through JSON and TOML."""
    from flintgen.presets import PRESETS

    assert not FLINT.attn_logit_softcap and not any(p.attn_logit_softcap for p in PRESETS.values())
    assert "attn_logit_softcap" not in FLINT.canonical_json()
    soft = FLINT.replace(attn_logit_softcap=True)
    assert '"attn_logit_softcap":true' in soft.canonical_json()
    assert soft.spec_hash != FLINT.spec_hash and soft != FLINT
    assert Spec.from_dict(json.loads(soft.canonical_json())) == soft
    assert Spec.from_dict(json.loads(soft.canonical_json())).spec_hash == soft.spec_hash
    d = FLINT.to_dict()
    assert "attn_logit_softcap" not in d
    assert Spec.from_dict(d) == FLINT   # a spec written before the field: no capping
    assert Spec.from_dict(dict(d, attn_logit_softcap=False)).spec_hash == FLINT.spec_hash


def test_attn_logit_softcap_from_toml(tmp_path):
    t = tmp_path / "s.toml"
    t.write_text('preset = "flint"\nattn_logit_softcap = true\n')
    assert Spec.from_file(t) == FLINT.replace(attn_logit_softcap=True)
    t.write_text('preset = "flint"\nattn_logit_softcap = 50.0\n')
    with pytest.raises(TypeError, match=r"spec file .*s.toml.*'attn_logit_softcap' must be a bool, got float 50.0"):
        Spec.from_file(t)


def test_softcap_presence_changes_only_decode_attention():
    """The presence is a code path (decode attention's binaries differ); the
    cap itself is a kernel argument, not in the spec."""
    from flintgen import cache

    t = Target("sm_90a", 132)
    soft = FLINT.replace(attn_logit_softcap=True)

    def keys(spec):
        return {k.name: sorted(cache.make_entry(v, k.template, dict(k.render_params(spec, v)), t, "/x").key
                               for v in k.variants(spec, t)) for k in KERNELS.values() if k.needed(spec)}

    a, b = keys(FLINT), keys(soft)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]) == (name != "decode_attention"), name
        if name == "decode_attention":
            assert not set(a[name]) & set(b[name])


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "fp8"])
def test_kv_cache_dtype_other_fp8_refused_by_name(value):
    with pytest.raises(ValueError, match=rf"'kv_cache_dtype' = '{value}' .*\['bf16', 'fp8_e4m3'\] .*e5m2 and int8 "
                                         r"caches are not implemented.*Use kv_cache_dtype = 'fp8_e4m3'"):
        FLINT.replace(kv_cache_dtype=value)


def test_fp8_kv_spec_selects_fp8_variants():
    from flintgen.kernels import KERNELS
    from flintgen.kernels.base import Target

    s, t = FLINT.replace(kv_cache_dtype="fp8_e4m3"), Target("sm_90a", 132)
    assert [v["kv_dtype"] for v in KERNELS["qkv"].variants(s, t)] == ["fp8_e4m3"]   # the QKV step writes e4m3
    # decode attention reads e4m3 pages (tests/test_decode_attention_fp8.py).
    assert all(v["kv_fp8"] for v in KERNELS["decode_attention"].variants(s, t))
