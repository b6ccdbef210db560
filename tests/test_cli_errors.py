"""Every user error on the command line is one ``flintgen: error:`` line on
stderr naming the field, file or variable, the value and the fix, exit status
2, no traceback; internal failures exit 1 and say "rerun with --debug".

``CASES`` is a fuzz table of malformed specs, config files, options and
environment values (well over 75); a few run as real processes too.
"""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from flintgen import knobs as knobs_mod
from flintgen.cli import main
from flintgen.knobs import knobs

HF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_configs")
FIX_WORDS = ("use ", "set ", "pass ", "give ", "fix", "rename", "check", "pick", "pad ", "remove", "write",
             "lower", "point", "see `", "save ", "name a base", "unset", "convert", "mark the", "choose", "list each")

# (id, kind, payload, words the message must contain). kind: toml / json / hf (file contents), args, env.
TOML_FIELDS = [
    ("hidden_str", 'hidden_size = "big"', ["hidden_size", "'big'"]),
    ("hidden_neg", "hidden_size = -1", ["hidden_size", "-1"]),
    ("hidden_zero", "hidden_size = 0", ["hidden_size", "0"]),
    ("hidden_odd", "hidden_size = 2050", ["hidden_size", "2050", "multiple of 16"]),
    ("hidden_huge", f"hidden_size = {2**40}", ["hidden_size", str(2**40), "64..32768"]),
    ("hidden_65536", "hidden_size = 65536", ["hidden_size", "65536"]),
    ("hidden_float", "hidden_size = 2048.0", ["hidden_size", "2048.0"]),
    ("hidden_bool", "hidden_size = true", ["hidden_size", "True"]),
    ("q_heads_zero", "num_q_heads = 0", ["num_q_heads", "0"]),
    ("q_heads_not_multiple", "num_q_heads = 33", ["num_q_heads", "33", "num_kv_heads"]),
    ("kv_heads_str", 'num_kv_heads = "4"', ["num_kv_heads", "'4'"]),
    ("head_dim_100", "head_dim = 100", ["head_dim", "100", "[64, 96, 128, 256]"]),
    ("page_size_8", "page_size = 8", ["page_size", "8", "[16, 32, 64]"]),
    ("kv_dtype", 'kv_cache_dtype = "fp8_e5m2"', ["kv_cache_dtype", "'fp8_e5m2'"]),
    ("kv_layout", 'kv_layout = "NHD"', ["kv_layout", "'NHD'"]),
    ("weights", 'weight_format = "int4"', ["weight_format", "'int4'"]),
    ("bias_str", 'qkv_bias = "yes"', ["qkv_bias", "'yes'"]),
    ("sinks_int", "sinks = 1", ["sinks", "1"]),
    ("window_neg", "sliding_window = -1", ["sliding_window", "-1"]),
    ("window_zero", "sliding_window = 0", ["sliding_window", "0"]),
    ("window_str", 'sliding_window = "128"', ["sliding_window", "'128'"]),
    ("window_without_sliding", 'layer_types = ["full"]', ["sliding_window", "128"]),
    ("layer_bad", 'layer_types = ["sliding", "local"]', ["layer_types[1]", "'local'"]),
    ("layer_str", 'layer_types = "sliding"', ["layer_types", "'sliding'"]),
    ("layer_empty", "layer_types = []", ["layer_types", "[]"]),
    ("qk_norm_str", 'qk_norm = "no"', ["qk_norm", "'no'"]),
    ("rope_style", 'rope_style = "gptj"', ["rope_style", "'gptj'"]),
    ("rope_theta_neg", "rope_theta = -1.0", ["rope_theta", "-1.0"]),
    ("rope_theta_str", 'rope_theta = "big"', ["rope_theta", "'big'"]),
    ("rope_theta_nan", "rope_theta = nan", ["rope_theta", "nan"]),
    ("rope_scaling", 'rope_scaling = "ntk"', ["rope_scaling", "'ntk'"]),
    ("rope_params_value", 'rope_scaling = "llama3"\nrope_scaling_params = { factor = "x" }',
     ["rope_scaling_params.factor", "'x'"]),
    ("rope_params_type", "rope_scaling_params = 3", ["rope_scaling_params", "3"]),
    ("rope_none_scaled", 'rope_style = "none"\nrope_scaling = "llama3"', ["rope_scaling", "'llama3'"]),
    ("rotary_dim_odd", "rotary_dim = 63", ["rotary_dim", "63", "2..head_dim = 128"]),
    ("rotary_dim_str", 'rotary_dim = "64"', ["rotary_dim", "'64'"]),
    ("sliding_rope_scaling", 'sliding_rope_theta = 1e4\nsliding_rope_scaling = "ntk"', ["sliding_rope_scaling", "'ntk'"]),
    ("longrope_factors_len", 'rope_scaling = "longrope"\nrope_scaling_params = { short_factor = [1.0, 1.0] }',
     ["rope_scaling_params.short_factor", "rotary_dim / 2 = 64"]),
    ("eps_zero", "rms_eps = 0.0", ["rms_eps", "0.0"]),
    ("scale_neg", "softmax_scale = -1.0", ["softmax_scale", "-1.0"]),
    ("max_tokens_zero", "max_tokens = 0", ["max_tokens", "0"]),
    ("max_tokens_300", "max_tokens = 300", ["max_tokens", "300", "1..256"]),
    ("tp_3", "tp_size = 3", ["tp_size", "3"]),
    ("tp_zero", "tp_size = 0", ["tp_size", "0"]),
    ("max_batch_zero", "max_batch = 0", ["max_batch", "0"]),
    ("max_batch_huge", "max_batch = 5000", ["max_batch", "5000"]),
    ("name_empty", 'name = ""', ["name", "''"]),
    ("unknown_field", "hiden_size = 2048", ["hiden_size", "unknown"]),
    ("bad_preset", 'preset = "nope"', ["preset", "'nope'"]),
    ("preset_int", "preset = 3", ["preset", "3"]),
]
FILES = [
    ("toml_syntax", "toml", 'preset = "flint"\nhidden_size = ', ["not valid TOML"]),
    ("json_syntax", "json", '{"preset": "flint",', ["not valid JSON"]),
    ("json_list", "json", "[1, 2]", ["table/object", "list"]),
    ("toml_empty", "toml", "", ["is empty", "preset"]),
    ("json_empty", "json", "{}", ["is empty"]),
    ("not_utf8", "toml", b"\xff\xfe\x00", ["not UTF-8"]),
    ("yaml", "yaml", "preset: flint", ["unsupported extension", ".toml and .json"]),
]
HF_CASES = [
    ("hf_list", "[1, 2]", ["JSON list", "config.json"]),
    ("hf_syntax", "{", ["not valid JSON"]),
    ("hf_deepseek", {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128},
     ["'deepseek_v3'", "multi-head latent attention (MLA) is not implemented", "supported:"]),
    ("hf_no_type", {"hidden_size": 2048, "num_attention_heads": 16, "rope_theta": 1e4}, ["model_type None"]),
    ("hf_no_hidden", {"model_type": "llama", "num_attention_heads": 32, "rope_theta": 1e4}, ["hidden_size"]),
    ("hf_heads_str", {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": "32",
                      "rope_theta": 1e4}, ["num_attention_heads", "'32'"]),
    ("hf_rope_type", {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 1e4,
                      "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["'dynamic'", "rope_type"]),
    ("hf_rope_list", {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 1e4,
                      "rope_scaling": [1, 2]}, ["rope_scaling", "[1, 2]"]),
    ("hf_layer_types", {"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e6,
                        "layer_types": ["chunked_attention"]}, ["layer_types", "chunked_attention"]),
    ("hf_head_dim", {"model_type": "llama", "hidden_size": 4000, "num_attention_heads": 40, "rope_theta": 1e4},
     ["head_dim", "100"]),
    ("hf_no_theta", {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32}, ["rope_theta"]),
]
ARGS = [
    ("jobs_zero", ["build", "--preset", "flint", "--jobs", "0"], ["--jobs", "0", "1<=x<=128"]),
    ("jobs_neg", ["build", "--preset", "flint", "--jobs", "-3"], ["--jobs", "-3"]),
    ("jobs_huge", ["build", "--preset", "flint", "--jobs", "10000"], ["--jobs", "10000"]),
    ("jobs_str", ["build", "--preset", "flint", "-j", "many"], ["'many'"]),
    ("num_sms_zero", ["build", "--preset", "flint", "--num-sms", "0"], ["--num-sms", "0"]),
    ("num_sms_huge", ["build", "--preset", "flint", "--num-sms", "100000"], ["--num-sms", "100000"]),
    ("arch", ["build", "--preset", "flint", "--arch", "sm_80"], ["'sm_80'", "sm_90a"]),
    ("arch_list", ["list", "--preset", "flint", "--arch", "sm_100a"], ["'sm_100a'"]),
    ("tp_3", ["build", "--preset", "flint", "--tp", "3"], ["tp_size", "3"]),
    ("tp_zero", ["show-spec", "--preset", "flint", "--tp", "0"], ["tp_size", "0"]),
    ("page_7", ["build", "--preset", "flint", "--page-size", "7"], ["page_size", "7"]),
    ("weights", ["build", "--preset", "flint", "--weights", "int4"], ["--weights", "'int4'"]),
    ("max_batch_zero", ["list", "--preset", "flint", "--max-batch", "0"], ["max_batch", "0"]),
    ("max_batch_huge", ["list", "--preset", "flint", "--max-batch", "99999"], ["max_batch", "99999"]),
    ("kernel", ["build", "--preset", "flint", "--kernel", "nope"], ["'nope'", "rms_norm"]),
    ("option", ["build", "--preset", "flint", "--frobnicate"], ["--frobnicate"]),
    ("command", ["frobnicate"], ["'frobnicate'"]),
    ("variant", ["show", "rms_norm", "--preset", "flint", "--variant", "99"], ["99", "out of range"]),
    ("show_kernel", ["show", "nope", "--preset", "flint"], ["'nope'"]),
    ("two_sources", ["build", "--preset", "flint", "--hf-config", os.path.join(HF, "qwen3-8b.json")],
     ["give one of"]),
    ("no_source", ["build"], ["--preset", "--spec", "--hf-config"]),
    ("preset", ["list", "--preset", "nope"], ["'nope'", "flint"]),
    ("spec_missing", ["show-spec", "--spec", "/nonexistent/s.toml"], ["/nonexistent/s.toml"]),
    ("spec_dir", ["show-spec", "--spec", "/"], ["'/'", "directory"]),
    ("hf_missing", ["show-spec", "--hf-config", "/nonexistent/config.json"], ["/nonexistent/config.json"]),
    ("other_toolchains", ["cache", "clean", "--other-toolchains"], ["--other-toolchains", "--stale"]),
    ("head_dim_256", ["list", "--spec", "{tmp}/hd256.toml"], ["decode_attention", "head_dim = 256 with GQA 16"]),
]
ENV = [
    ("lock_abc", {"FLINTGEN_LOCK_TIMEOUT": "abc"}, ["FLINTGEN_LOCK_TIMEOUT", "'abc'"]),
    ("lock_neg", {"FLINTGEN_LOCK_TIMEOUT": "-1"}, ["FLINTGEN_LOCK_TIMEOUT", "'-1'"]),
    ("lock_inf", {"FLINTGEN_LOCK_TIMEOUT": "inf"}, ["FLINTGEN_LOCK_TIMEOUT", "'inf'"]),
    ("sms_abc", {"FLINTGEN_NUM_SMS": "abc"}, ["FLINTGEN_NUM_SMS", "'abc'"]),
    ("sms_zero", {"FLINTGEN_NUM_SMS": "0"}, ["FLINTGEN_NUM_SMS", "'0'"]),
    ("sms_huge", {"FLINTGEN_NUM_SMS": "100000"}, ["FLINTGEN_NUM_SMS", "'100000'"]),
    ("arch", {"FLINTGEN_ARCH": "sm_80"}, ["FLINTGEN_ARCH", "'sm_80'"]),
    ("no_jit", {"FLINTGEN_NO_JIT": "maybe"}, ["FLINTGEN_NO_JIT", "'maybe'"]),
    ("check_inputs", {"FLINTGEN_CHECK_INPUTS": "2"}, ["FLINTGEN_CHECK_INPUTS", "'2'"]),
    ("debug", {"FLINTGEN_DEBUG": "perhaps"}, ["FLINTGEN_DEBUG", "'perhaps'"]),
    ("runtime_lib", {"FLINTGEN_RUNTIME_LIB": "/nonexistent/libcute_dsl_runtime.so"},
     ["FLINTGEN_RUNTIME_LIB", "/nonexistent/libcute_dsl_runtime.so"]),
]


def _cases():
    for cid, body, words in TOML_FIELDS:
        yield pytest.param("toml", f'preset = "flint"\n{body}\n' if "preset" not in body else body, words,
                           id=f"spec-{cid}")
    for cid, ext, body, words in FILES:
        yield pytest.param(ext, body, words, id=f"file-{cid}")
    for cid, body, words in HF_CASES:
        yield pytest.param("hf", body, words, id=f"hf-{cid}")
    for cid, args, words in ARGS:
        yield pytest.param("args", args, words, id=f"arg-{cid}")
    for cid, env, words in ENV:
        yield pytest.param("env", env, words, id=f"env-{cid}")


CASES = list(_cases())


def test_fuzz_table_is_large():
    assert len(CASES) >= 75


def _invoke(kind, payload, tmp_path):
    env, args = {}, None
    if kind in ("toml", "json", "yaml"):
        f = tmp_path / f"s.{kind}"
        (f.write_bytes if isinstance(payload, bytes) else f.write_text)(payload)
        args = ["show-spec", "--spec", str(f)]
    elif kind == "hf":
        f = tmp_path / "config.json"
        f.write_text(payload if isinstance(payload, str) else json.dumps(payload))
        args = ["show-spec", "--hf-config", str(f)]
    elif kind == "args":
        (tmp_path / "hd256.toml").write_text('preset = "flint"\nhidden_size = 4096\nhead_dim = 256\nnum_q_heads = 64\n')
        args = [a.replace("{tmp}", str(tmp_path)) for a in payload]
        args += ["--cache-dir", str(tmp_path / "c")] if args[0] == "cache" else []
    else:
        env = payload
        args = ["list", "--preset", "flint"]
    return CliRunner().invoke(main, args, env=env), args


@pytest.mark.parametrize("kind, payload, words", CASES)
def test_user_error_is_one_line(kind, payload, words, tmp_path):
    r, args = _invoke(kind, payload, tmp_path)
    assert r.exit_code == 2, (args, r.exit_code, r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flintgen: error: "), r.stderr
    assert "Traceback" not in r.output
    for w in words:
        assert w in lines[0], (w, lines[0])
    if kind in ("toml", "json", "yaml"):
        assert "s." + kind in lines[0]                                 # names the file
    assert any(fw in lines[0].lower() for fw in FIX_WORDS), f"no fix in: {lines[0]}"


@pytest.mark.parametrize("args", [["build", "--preset", "flint", "--jobs", "0"], ["frobnicate"],
                                  ["show-spec", "--spec", "/nonexistent.toml"]])
def test_real_process_prints_one_line_and_exits_2(args):
    env = {k: v for k, v in os.environ.items() if k != "FLINTGEN_DEBUG"}
    p = subprocess.run([sys.executable, "-m", "flintgen.cli", *args], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith("flintgen: error: "), p.stderr


def test_debug_shows_the_traceback(tmp_path):
    for extra_env, pre in (({}, ["--debug"]), ({"FLINTGEN_DEBUG": "1"}, [])):
        p = subprocess.run([sys.executable, "-m", "flintgen.cli", *pre, "list", "--preset", "nope"],
                           capture_output=True, text=True, env=dict(os.environ, **extra_env))
        assert p.returncode == 1 and "Traceback" in p.stderr and "unknown preset 'nope'" in p.stderr


def test_internal_failure_exits_1_with_rerun_hint(monkeypatch):
    from flintgen import cli

    def boom(*a, **k):
        raise KeyError("bug")

    monkeypatch.setattr(cli, "_plan", boom)
    r = CliRunner().invoke(main, ["build", "--preset", "flint", "--arch", "sm_90a"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flintgen: internal error: KeyError")
    assert "rerun with --debug" in lines[0]


# ------------------------------------------------------------------ the library
@pytest.mark.parametrize("var, value, attr", [
    ("FLINTGEN_LOCK_TIMEOUT", "abc", "lock_timeout"), ("FLINTGEN_LOCK_TIMEOUT", "-1", "lock_timeout"),
    ("FLINTGEN_NUM_SMS", "x", "num_sms"), ("FLINTGEN_NUM_SMS", "100000", "num_sms"),
    ("FLINTGEN_NO_JIT", "maybe", "no_jit"), ("FLINTGEN_CHECK_INPUTS", "2", "check_inputs"),
    ("FLINTGEN_DEBUG", "perhaps", "debug"), ("FLINTGEN_RUNTIME_LIB", "/nonexistent.so", "runtime_lib"),
])
def test_library_checks_environment_at_first_use(monkeypatch, var, value, attr):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"environment variable {var}={value!r}"):
        getattr(knobs, attr)


def test_every_knob_is_declared():
    names = {k.name for k in knobs_mod.KNOBS}
    src = open(knobs_mod.__file__).read()
    used = set(__import__("re").findall(r'"(FLINTGEN_[A-Z_]+)"', src))
    assert used == names
