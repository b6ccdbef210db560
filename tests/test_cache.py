"""Disk cache: hit, miss, corrupt entries, stale DSL, locking, unwritable roots."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from flintgen import cache, toolchain
from flintgen.kernels import KERNELS
from flintgen.kernels.base import Target
from flintgen.presets import FLINT

pytestmark = pytest.mark.compile

T = Target("sm_90a", 132)
REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def _entry(root, residual=False):
    k = KERNELS["rms_norm"]
    v = k.variants(FLINT, T)[int(residual)]
    return cache.make_entry(v, k.template, dict(k.render_params(FLINT, v)), T, str(root))


def _replace(path, data):
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.replace(path + ".new", path)


def test_miss_then_hit(tmp_path):
    e = _entry(tmp_path)
    assert cache.try_load(e) is None
    first = cache.get_or_build(e)
    assert not first.hit
    assert sorted(os.listdir(e.dir)) == ["kernel.ptx", "kernel.so", "meta.json", "module.py"]
    meta = cache.read_meta(e)
    assert meta["key"] == e.key and meta["target"] == {"arch": "sm_90a", "num_sms": 132}
    assert meta["resources"]["spill_store_bytes"] == 0
    assert cache.get_or_build(e).hit
    with open(e.path("module.py")) as f:
        assert f.read() == e.source


def test_key_covers_target_and_source(tmp_path):
    e = _entry(tmp_path)
    k = KERNELS["rms_norm"]
    v = e.variant
    p = dict(k.render_params(FLINT, v))
    assert cache.make_entry(v, k.template, p, Target("sm_90a", 114), str(tmp_path)).key != e.key
    p2 = dict(p, threads=512)
    assert cache.make_entry(v, k.template, p2, T, str(tmp_path)).key != e.key


def test_key_covers_compile_env(tmp_path, monkeypatch):
    e = _entry(tmp_path)
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert _entry(tmp_path).key != e.key


@pytest.mark.parametrize("damage", ["truncate_so", "garbage_so", "no_meta", "bad_meta", "wrong_key"])
def test_corrupt_entry_is_rebuilt(tmp_path, damage):
    e = _entry(tmp_path)
    cache.get_or_build(e)
    # Damage through a new inode: the loaded library stays mapped in this
    # process, and truncating a mapped file in place would SIGBUS it.
    if damage == "truncate_so":
        _replace(e.path("kernel.so"), open(e.path("kernel.so"), "rb").read()[:100])
    elif damage == "garbage_so":
        _replace(e.path("kernel.so"), b"not an ELF")
    elif damage == "no_meta":
        os.unlink(e.path("meta.json"))
    elif damage == "bad_meta":
        with open(e.path("meta.json"), "w") as f:
            f.write("{truncated")
    elif damage == "wrong_key":
        meta = cache.read_meta(e)
        meta["key"] = "0" * 64
        with open(e.path("meta.json"), "w") as f:
            json.dump(meta, f)
    assert cache.check_entry(e) is not None
    assert cache.try_load(e) is None
    out = cache.get_or_build(e)
    assert not out.hit and cache.check_entry(e) is None
    assert cache.get_or_build(e).hit


def test_other_dsl_version_rebuilds(tmp_path, monkeypatch):
    e = _entry(tmp_path)
    cache.get_or_build(e)
    fake = (("nvidia-cutlass-dsl", "4.9.0"), ("nvidia-cutlass-dsl-libs-cu13", "4.9.0"))
    monkeypatch.setattr(toolchain, "dsl_versions", lambda: fake)
    assert "built with DSL" in cache.check_entry(e)


def test_serving_machine_accepts_any_dsl_version(tmp_path, monkeypatch):
    e = _entry(tmp_path)
    cache.get_or_build(e)
    meta = cache.read_meta(e)
    meta["dsl"] = {"nvidia-cutlass-dsl": "4.8.0", "flavour": "cu13", "libs": "4.8.0"}
    with open(e.path("meta.json"), "w") as f:
        json.dump(meta, f)
    monkeypatch.setattr(toolchain, "dsl_versions", lambda: ())  # DSL not installed
    assert cache.check_entry(e) is None


def test_no_jit_raises_on_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("FLINTGEN_NO_JIT", "1")
    with pytest.raises(cache.MissingKernelError, match="FLINTGEN_NO_JIT=1"):
        cache.get_or_build(_entry(tmp_path))


def test_missing_dsl_on_miss_is_clear(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain, "dsl_versions", lambda: ())
    with pytest.raises(cache.MissingKernelError, match="CuTe DSL is not installed"):
        cache.get_or_build(_entry(tmp_path))


def test_unwritable_root_still_gives_a_kernel(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the cache dir should be: every write fails
    e = _entry(blocker / "cache")
    with pytest.warns(cache.CacheWarning, match="FLINTGEN_CACHE_DIR"):
        out = cache.get_or_build(e)
    assert out.function is not None and not out.hit


def test_concurrent_builders_compile_once(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        from tests.test_cache import _entry
        from flintgen import cache
        print("HIT" if cache.get_or_build(_entry({str(tmp_path)!r}, residual=True)).hit else "MISS")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(outs) == ["HIT", "HIT", "MISS"]


def test_verify_and_clean(tmp_path):
    e = _entry(tmp_path)
    cache.get_or_build(e)
    entries = cache.list_entries(str(tmp_path))
    assert [d for d, _ in entries] == [e.dir]
    assert cache.check_dir(e.dir, load=True) is None
    _replace(e.path("kernel.so"), open(e.path("kernel.so"), "rb").read() + b"x")
    assert "sha256" in cache.check_dir(e.dir, load=True)
    report = cache.clean(str(tmp_path))
    assert report.removed == 1 and report.bytes_freed > 0 and not report.failed
    assert cache.list_entries(str(tmp_path)) == []


def test_long_variant_names_fit_a_file_name(tmp_path):
    """A variant with many launch options (its name past 255 characters with the key and '.lock') gets a
    bounded entry directory (a prefix and a hash of the whole name), builds, hits and verifies."""
    from flintgen.kernels.base import Variant

    k = KERNELS["rms_norm"]
    real = k.variants(FLINT, T)[0]
    long = Variant.of(real.kernel, **dict(real.params), **{f"launch_option_{i:02d}": i for i in range(16)})
    assert len(long.name) > 255
    e = cache.make_entry(long, k.template, dict(k.render_params(FLINT, real)), T, str(tmp_path))
    name = os.path.basename(e.dir)
    assert name == cache.entry_dir_name(long.name, e.key) and "~" in name and name.endswith(e.key[:16])
    assert len(name) == cache.MAX_NAME_CHARS + 17 and len(os.path.basename(cache.lock_path(e.dir)) + ".owner") == 255
    assert not cache.get_or_build(e).hit and cache.get_or_build(e).hit
    assert cache.check_dir(e.dir, load=True) is None          # meta's variant is the long name; its place fits it
    assert cache.read_meta(e)["variant"] == long.name
    # two long names with the same prefix stay apart; a short name is unchanged
    other = long.name[:-1] + "9"
    assert cache.entry_dir_name(other, e.key) != name
    assert cache.entry_dir_name(real.name, e.key) == f"{real.name}-{e.key[:16]}"


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("FLINTGEN_CACHE_DIR", str(tmp_path / "c"))
    assert cache.default_root() == str(tmp_path / "c")
    monkeypatch.delenv("FLINTGEN_CACHE_DIR")
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(cache.__file__)))
    assert cache.default_root() == os.path.join(checkout, "cache")


def test_key_covers_imported_helpers_only(tmp_path, monkeypatch):
    e = _entry(tmp_path)
    assert cache._imports(e.source) == {"flintgen.device.ldst", "flintgen.device.ptx", "flintgen.device.reduce"}
    real = cache._read_module

    def edited(name, which):
        return real(name) + (b"\n# edited" if name == which else b"")

    monkeypatch.setattr(cache, "_read_module", lambda n: edited(n, "flintgen.device.ptx"))  # via ldst too
    assert _entry(tmp_path).key != e.key
    monkeypatch.setattr(cache, "_read_module", lambda n: edited(n, "flintgen.device.rope"))  # not imported
    assert _entry(tmp_path).key == e.key


def test_imports_are_parsed_in_every_form():
    src = textwrap.dedent("""
        from flintgen.device import (
            ldst,
            rope as r,
        )
        import flintgen.device.gemv as g
        from flintgen.device.nvfp4 import something
        from flintgen.kernels.base import Target
        x = "from flintgen.device import paged_kv"   # a string, not an import
    """)
    assert cache._imports(src) == {"flintgen.device.ldst", "flintgen.device.rope", "flintgen.device.gemv",
                                   "flintgen.device.nvfp4", "flintgen.kernels.base"}
    assert cache._imports("from . import ptx\nfrom .rope import f", "flintgen.device") == {
        "flintgen.device.ptx", "flintgen.device.rope"}


_KEY_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from flintgen import cache
from flintgen.kernels import KERNELS
from flintgen.kernels.base import Target
from flintgen.presets import FLINT
T = Target("sm_90a", 132)
for name in ("rms_norm", "qkv", "decode_attention"):
    k = KERNELS[name]
    v = k.variants(FLINT, T)[0]
    print(name, cache.make_entry(v, k.template, dict(k.render_params(FLINT, v)), T, "/nonexistent").key)
"""


def _keys_of_copy(tmp_path, edit=None):
    """Keys of one variant per kernel computed by a copy of flintgen with ``edit`` applied."""
    copy = tmp_path / "copy"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(REPO / "flintgen", copy / "flintgen", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "templates", copy / "templates")
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    if edit:
        with open(copy / edit, "a") as f:
            f.write("\n# an upgrade changed this file\n")
    out = subprocess.run([sys.executable, "-c", _KEY_SCRIPT, str(copy)], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONPATH=str(copy))).stdout
    return dict(line.split() for line in out.splitlines())


@pytest.mark.parametrize("edit, changed", [
    ("flintgen/compiler.py", {"rms_norm", "qkv", "decode_attention"}),        # compile / export / link code
    ("flintgen/device/ptx.py", {"rms_norm", "qkv", "decode_attention"}),      # imported by every kernel
    ("flintgen/device/reduce.py", {"rms_norm", "qkv"}),                       # through head_epilogue
    ("flintgen/device/paged_kv.py", {"decode_attention"}),
    ("flintgen/layout.py", {"qkv", "decode_attention"}),                      # read by their helpers
    ("templates/qkv_gemv.py.j2", {"qkv"}),
    ("flintgen/hf.py", set()),                                                # not part of any binary
])
def test_key_covers_compile_code_and_helpers_in_a_copy(tmp_path, edit, changed):
    base = _keys_of_copy(tmp_path)
    after = _keys_of_copy(tmp_path, edit)
    assert {k for k in base if base[k] != after[k]} == changed
