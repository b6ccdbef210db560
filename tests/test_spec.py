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
    ({"max_tokens": 300}, ValueError, r"'max_tokens' = 300 .*1\.\.256 \(rms_norm 1\.\.256, qkv 1\.\.8\)"),
    ({"hidden_size": 2**40}, ValueError, r"'hidden_size' = 1099511627776 .*64\.\.32768"),
    ({"tp_size": 3}, ValueError, r"'tp_size' = 3"),
    ({"sinks": 1}, TypeError, r"'sinks' must be a bool"),
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
