"""The cache under faults and hostile input (issue 13): real processes, real
kill signals, file modes without CAP_DAC_OVERRIDE, a full disk on a small tmpfs.

Each test is named after the finding it pins down (bug 1-10 of the fault probe).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from flintgen import cache, compiler
from flintgen.kernels import KERNELS
from flintgen.kernels.base import Target
from flintgen.presets import FLINT

pytestmark = pytest.mark.compile

T = Target("sm_90a", 132)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]


def flintgen_cmd(*args):
    return [sys.executable, "-c", "from flintgen.cli import main; main()", *args]


def run(args, *, env=None, priv=False, timeout=300, **kw):
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("FLINTGEN_DEBUG", None)
    cmd = (NO_DAC if priv else []) + flintgen_cmd(*args)
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, **kw)


def assert_one_error(p, status, *words):
    lines = p.stderr.strip().splitlines()
    assert p.returncode == status, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in lines if ln.startswith("flintgen: error:")]
    assert errors, p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr)


def can_drop_dac() -> bool:
    if shutil.which("setpriv") is None:
        return False
    probe = subprocess.run(NO_DAC + ["true"], capture_output=True)
    return probe.returncode == 0


needs_no_dac = pytest.mark.skipif(not can_drop_dac(), reason="setpriv cannot drop CAP_DAC_OVERRIDE here")


def _entry(root, residual=False, spec=FLINT):
    k = KERNELS["rms_norm"]
    v = k.variants(spec, T)[int(residual)]
    return cache.make_entry(v, k.template, dict(k.render_params(spec, v)), T, str(root))


@pytest.fixture
def built(tmp_path):
    """A cache root with the two rms_norm entries of flint built."""
    root = tmp_path / "cache"
    entries = [_entry(root, r) for r in (False, True)]
    for e in entries:
        cache.get_or_build(e)
    return root, entries


BUILD_ARGS = ["--preset", "flint", "--kernel", "rms_norm", "--arch", "sm_90a", "--num-sms", "132"]


# -------------------------------------------------------------- bug 1
def test_1_clean_refuses_a_directory_that_is_not_a_cache(tmp_path):
    for rel in ("src/pkg/a.py", "docs/img/x.png", ".git/objects/ab/cd"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("user data")
    p = run(["cache", "clean", "--yes", "--cache-dir", str(tmp_path)])
    assert_one_error(p, 2, "is not a flintgen cache", "nothing removed")
    for rel in ("src/pkg/a.py", "docs/img/x.png", ".git/objects/ab/cd"):
        assert (tmp_path / rel).read_text() == "user data"


def test_1_clean_touches_only_provable_entries(built):
    root, entries = built
    foreign = [root / "sm_90a-132sm" / "notes" / "todo.txt",                       # not an entry name
               root / "sm_90a-132sm" / f"mine-{'0' * 16}" / "thesis.tex",          # entry name, foreign file
               root / "other" / "x-0123456789abcdef" / "data.bin"]                 # not a target dir
    for f in foreign:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("keep")
    p = run(["cache", "clean", "--yes", "--cache-dir", str(root)])
    assert p.returncode == 0 and "removed 2 entries" in p.stdout, p.stdout + p.stderr
    assert all(f.read_text() == "keep" for f in foreign)
    assert not any(os.path.exists(e.dir) for e in entries)


# -------------------------------------------------------------- bug 2
def flint_variants(**changes) -> int:
    """Launch variants `flintgen build` compiles (every kernel's) for the flint preset with ``changes``, on
    sm_90a with 132 SMs (the build's CPU default)."""
    import flintgen
    from flintgen.kernels import KERNELS
    from flintgen.kernels.base import Target

    spec = flintgen.get_preset("flint").replace(**changes)
    return sum(len(k.variants(spec, Target("sm_90a", 132))) for k in KERNELS.values() if k.needed(spec))


def test_2_build_survives_concurrent_clean(tmp_path):
    root = str(tmp_path / "cache")
    spec = tmp_path / "s.toml"  # a hidden size of its own: every kernel is compiled, none is a hit
    spec.write_text('preset = "flint"\nhidden_size = 1536\n')
    builder = subprocess.Popen(flintgen_cmd("build", "--spec", str(spec), "--arch", "sm_90a", "--num-sms", "132",
                                            "--cache-dir", root, "--jobs", "2"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cleans = 0
    while builder.poll() is None:
        if os.path.isdir(root):
            p = run(["cache", "clean", "--yes", "--cache-dir", root])
            assert p.returncode == 0, p.stderr
            cleans += 1
        time.sleep(0.05)
    out, err = builder.communicate()
    assert builder.returncode == 0, out + err
    assert f"{flint_variants(hidden_size=1536)} built" in out and "0 failed" in out, out
    assert cleans >= 3


# -------------------------------------------------------------- bug 3
def test_3_huge_hidden_is_refused_at_once(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text(f'preset = "flint"\nhidden_size = {2**40}\n')
    t0 = time.monotonic()
    p = run(["build", "--spec", str(spec), "--kernel", "rms_norm", "--arch", "sm_90a",
             "--cache-dir", str(tmp_path / "c")], timeout=60)
    assert_one_error(p, 2, "hidden_size", str(2**40), "64..32768")
    assert time.monotonic() - t0 < 30


def test_3_kernel_outside_its_own_range_is_refused_naming_it(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text('preset = "flint"\nmax_tokens = 65\n')
    p = run(["build", "--spec", str(spec), "--arch", "sm_90a", "--cache-dir", str(tmp_path / "c")], timeout=60)
    assert_one_error(p, 2, "kernel qkv supports max_tokens 1..64, got 65")


def test_3_spilling_kernel_fails_the_build_and_is_not_cached(tmp_path, monkeypatch):
    real = compiler.parse_ptxas_report

    def spilling(text):
        r = real(text)
        r.update(spill_store_bytes=8, spill_load_bytes=8)
        return r

    monkeypatch.setattr(compiler, "parse_ptxas_report", spilling)
    e = _entry(tmp_path / "c")
    with pytest.raises(cache.KernelResourceError, match="spills or uses local memory.*not cached"):
        cache.get_or_build(e)
    assert cache.read_meta(e) is None and cache.try_load(e) is None
    from click.testing import CliRunner

    from flintgen.cli import main

    r = CliRunner().invoke(main, ["build", *BUILD_ARGS, "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 1 and "spills or uses local memory" in r.stderr and "2 failed" in r.output


# -------------------------------------------------------------- bug 4
@pytest.mark.parametrize("bad", ["[1, 2, 3]", '"x"', "42"])
def test_4_meta_that_is_not_an_object(built, bad):
    root, (e0, e1) = built
    with open(e0.path("meta.json"), "w") as f:
        f.write(bad)
    p = run(["cache", "verify", "--cache-dir", str(root)])
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"BAD sm_90a-132sm/{os.path.basename(e0.dir)}: missing or unreadable meta.json" in p.stdout
    assert "1 ok, 1 bad" in p.stdout                                          # the other entry was checked
    p = run(["cache", "ls", "--cache-dir", str(root)])
    assert p.returncode == 0 and "[incomplete]" in p.stdout and os.path.basename(e1.dir) in p.stdout


# -------------------------------------------------------------- bug 5
def test_5_verify_catches_files_copied_from_another_entry(built):
    root, (e0, e1) = built
    for name in ("kernel.so", "meta.json"):
        shutil.copyfile(e1.path(name), e0.path(name) + ".new")
        os.replace(e0.path(name) + ".new", e0.path(name))
    p = run(["cache", "verify", "--no-load", "--cache-dir", str(root)])
    assert p.returncode == 1 and "copied from another entry" in p.stdout, p.stdout


@pytest.mark.parametrize("damage", ["delete", "edit"])
def test_5_module_py_is_checked_and_restored(built, damage):
    root, (e0, _) = built
    if damage == "delete":
        os.unlink(e0.path("module.py"))
    else:
        with open(e0.path("module.py"), "a") as f:
            f.write("\n# edited\n")
    p = run(["cache", "verify", "--no-load", "--cache-dir", str(root)])
    assert p.returncode == 1 and "module.py" in p.stdout, p.stdout
    out = cache.get_or_build(e0)                      # the runtime sees a miss and rebuilds it
    assert not out.hit and open(e0.path("module.py")).read() == e0.source
    assert run(["cache", "verify", "--no-load", "--cache-dir", str(root)]).returncode == 0


# -------------------------------------------------------------- bug 6
@needs_no_dac
def test_6_clean_of_a_read_only_cache_fails(built):
    root, entries = built
    tdir = os.path.dirname(entries[0].dir)
    os.chmod(tdir, 0o555)
    try:
        p = run(["cache", "clean", "--yes", "--cache-dir", str(root)], priv=True)
    finally:
        os.chmod(tdir, 0o755)
    assert_one_error(p, 1, "could not remove")
    assert "removed 0 entries" in p.stdout, p.stdout
    assert all(os.path.isdir(e.dir) for e in entries)


# -------------------------------------------------------------- bug 7
def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_7_workers_die_with_the_parent(tmp_path, sig):
    spec = tmp_path / "s.toml"
    spec.write_text('preset = "flint"\nhidden_size = 1536\n')
    parent = subprocess.Popen(flintgen_cmd("build", "--spec", str(spec), "--arch", "sm_90a", "--jobs", "2",
                                           "--cache-dir", str(tmp_path / "c")),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    kids: list[int] = []
    while time.monotonic() < deadline and len(kids) < 3:  # 2 workers + the resource tracker
        kids = _children(parent.pid)
        time.sleep(0.1)
    assert len(kids) >= 3, f"workers did not start: {kids}"
    time.sleep(1.0)
    parent.send_signal(sig)
    parent.wait(timeout=30)
    time.sleep(5)
    alive = [k for k in kids if _alive(k)]
    for k in alive:  # do not leave them behind even when the test fails
        os.kill(k, signal.SIGKILL)
    assert alive == [], f"still alive 5 s after the parent got {sig.name}: {alive}"


# -------------------------------------------------------------- bug 8
DISK_FULL = textwrap.dedent("""
    import os, sys, warnings
    sys.path.insert(0, {repo!r})
    from tests.test_cache_faults import _entry
    from flintgen import cache
    from flintgen.kernels import KERNELS
    from flintgen.presets import FLINT
    from flintgen.kernels.base import Target
    root, filler = sys.argv[1], sys.argv[2]
    T = Target("sm_90a", 132)
    spec = FLINT.replace(hidden_size=int(sys.argv[3]))
    k = KERNELS["rms_norm"]
    ok = fallback = 0
    for v in k.variants(spec, T):
        e = cache.make_entry(v, k.template, dict(k.render_params(spec, v)), T, root)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = cache.get_or_build(e)          # must never raise for a full disk
        assert out.function is not None
        fallback += any(issubclass(x.category, cache.CacheWarning) for x in w)
        ok += 1
    print("OK", ok, "FALLBACK", fallback)
""")


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="unshare -m (a private mount namespace) is not permitted here")
@pytest.mark.parametrize("free_kib", [8, 40, 120, 400])
def test_8_disk_full_falls_back_to_an_uncached_build(tmp_path, free_kib):
    """A 2 MiB tmpfs as the cache, filled to leave ``free_kib``: wherever ENOSPC
    strikes (module, object file, linker output, meta), the kernel still comes."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL.format(repo=REPO))
    work_tmp = tmp_path / "tmp"
    work_tmp.mkdir()
    shell = (f"mount -t tmpfs -o size=2m tmpfs {mnt} && "
             f"head -c $(( 2048 * 1024 - {free_kib} * 1024 )) /dev/zero > {mnt}/filler 2>/dev/null; "
             f"{sys.executable} {script} {mnt}/cache {mnt}/filler {512 + 64 * free_kib // 8}")
    p = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TMPDIR=str(work_tmp)))
    assert p.returncode == 0 and "OK 2" in p.stdout, p.stdout + p.stderr
    # bug 10: uncached builds leave no flintgen-nocache-* behind (the DSL keeps its own cache there)
    assert [n for n in os.listdir(work_tmp) if n.startswith("flintgen-")] == []
    if free_kib <= 120:
        assert "FALLBACK 0" not in p.stdout, p.stdout      # the disk really was full


# -------------------------------------------------------------- bug 9
def test_9_build_into_a_cache_under_a_file_fails(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = run(["build", *BUILD_ARGS, "--cache-dir", str(blocker / "cache")])
    assert_one_error(p, 2, str(blocker / "cache"), "--cache-dir")


@needs_no_dac
def test_9_build_into_a_read_only_cache_fails(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    os.chmod(root, 0o555)
    try:
        p = run(["build", *BUILD_ARGS, "--cache-dir", str(root)], priv=True)
    finally:
        os.chmod(root, 0o755)
    assert_one_error(p, 2, str(root), "not usable", "writable")


def test_9_lock_held_past_the_timeout_fails_build_and_says_who(tmp_path):
    root = tmp_path / "c"
    e = _entry(root)
    os.makedirs(os.path.dirname(cache.lock_path(e.dir)), exist_ok=True)
    holder = cache._EntryLock(e.dir, "test holder")
    holder.acquire()
    try:
        p = run(["build", *BUILD_ARGS, "--cache-dir", str(root)], env={"FLINTGEN_LOCK_TIMEOUT": "1"})
    finally:
        holder.release()
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    assert f"waiting up to 1 s (FLINTGEN_LOCK_TIMEOUT) for process {os.getpid()}" in p.stderr, p.stderr
    assert "longer than FLINTGEN_LOCK_TIMEOUT=1 s" in p.stderr and "FLINTGEN_CACHE_DIR" not in p.stderr
    assert "1 failed" in p.stdout


def test_9_runtime_keeps_its_uncached_fallback_for_a_held_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("FLINTGEN_LOCK_TIMEOUT", "0")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    e = _entry(tmp_path / "c")
    holder = cache._EntryLock(e.dir, "test holder")
    holder.acquire()
    try:
        with pytest.warns(cache.CacheWarning, match="FLINTGEN_LOCK_TIMEOUT") as w:
            out = cache.get_or_build(e)
    finally:
        holder.release()
    assert out.function is not None and not out.hit
    assert all("FLINTGEN_CACHE_DIR" not in str(x.message) for x in w)


# -------------------------------------------------------------- bug 10
def test_10_uncached_builds_leak_no_temp_dirs(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(cache.CacheWarning):
        assert cache.get_or_build(_entry(blocker / "cache")).function is not None
    assert [n for n in os.listdir(tmp) if n.startswith("flintgen-")] == []


def test_10_leftover_work_dirs_are_shown_and_cleaned(built):
    root, (e0, e1) = built
    os.mkdir(e0.path(".build-killed"))
    with open(e0.path(".build-killed/kernel.o"), "wb") as f:
        f.write(b"\0" * 4096)
    with open(e1.path(".tmp-abc"), "wb") as f:
        f.write(b"partial")
    p = run(["cache", "ls", "--cache-dir", str(root)])
    assert p.stdout.count("leftover work files") == 2, p.stdout
    p = run(["cache", "verify", "--no-load", "--cache-dir", str(root)])
    assert p.returncode == 1 and "0 ok, 2 bad" in p.stdout, p.stdout
    p = run(["cache", "clean", "--stale", "--cache-dir", str(root)])
    assert p.returncode == 0 and "removed 0 entries and 2 leftover work files" in p.stdout, p.stdout
    assert run(["cache", "verify", "--cache-dir", str(root)]).returncode == 0
    assert cache.try_load(e0) is not None and cache.try_load(e1) is not None


# -------------------------------------------------------------- clean --stale
def test_clean_stale_keeps_good_and_other_toolchains_unless_asked(built, monkeypatch):
    root, (good, other) = built
    extra = _entry(root, spec=FLINT.replace(hidden_size=1024))
    cache.get_or_build(extra)
    with open(extra.path("kernel.so"), "ab") as f:       # damaged
        f.write(b"x")
    meta = cache.read_meta(other)
    meta["dsl"] = {"nvidia-cutlass-dsl": "4.7.0", "flavour": "cu13", "libs": "4.7.0"}
    with open(other.path("meta.json"), "w") as f:          # another DSL's entry
        json.dump(meta, f)
    p = run(["cache", "clean", "--stale", "--cache-dir", str(root)])
    assert p.returncode == 0 and "removed 1 entries" in p.stdout and "kept 2" in p.stdout, p.stdout
    assert " MiB)" in p.stdout
    assert not os.path.exists(extra.dir) and os.path.isdir(other.dir) and cache.try_load(good)
    p = run(["cache", "clean", "--stale", "--other-toolchains", "--cache-dir", str(root)])
    assert p.returncode == 0 and "removed 1 entries" in p.stdout and "kept 1" in p.stdout, p.stdout
    assert not os.path.exists(other.dir) and cache.try_load(good)


def test_old_meta_version_is_a_miss_that_is_rebuilt(built):
    _, (e0, _) = built
    meta = cache.read_meta(e0)
    meta["meta_version"] = 1
    with open(e0.path("meta.json"), "w") as f:
        json.dump(meta, f)
    problem = cache.check_entry(e0)
    assert problem is not None and problem.other_toolchain and "meta version 1" in problem
    out = cache.get_or_build(e0)
    assert not out.hit and cache.read_meta(e0)["meta_version"] == cache.META_VERSION


def test_meta_records_every_file(built):
    _, (e0, _) = built
    files = cache.read_meta(e0)["files"]
    assert sorted(files) == sorted(cache.HASHED_FILES)
    for name, digest in files.items():
        assert cache._sha256_file(e0.path(name)) == digest


def test_entries_hold_exactly_their_files_with_bytecode_writing_on(tmp_path):
    """Compiling imports module.py from the entry: no __pycache__ may appear there
    (a user's Python writes bytecode by default)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    root = tmp_path / "c"
    p = subprocess.run(flintgen_cmd("build", *BUILD_ARGS, "--cache-dir", str(root)), capture_output=True,
                       text=True, env=env)
    assert p.returncode == 0, p.stderr
    dirs = cache.entry_dirs(str(root))
    assert len(dirs) == 2
    for d in dirs:
        assert sorted(os.listdir(d)) == sorted(cache.ENTRY_FILES)
