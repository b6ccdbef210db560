"""Cache bundles: pack, unpack, and every refusal (path tricks, link and device
members, duplicates, truncation, hash and place mismatches, limits, another
flintgen version, another SM count)."""

import hashlib
import io
import json
import os
import tarfile
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from flintgen import bundle, cache, codegen, toolchain
from flintgen._version import __version__
from flintgen.cli import main
from flintgen.kernels.base import Target
from flintgen.presets import FLINT

T = Target("sm_90a", 132)
KERNELS = ("rms_norm",)  # the fastest kernel to compile: two entries


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("pack")
    rep = bundle.pack(FLINT, T, str(d / "flint.tar.gz"), str(d / "build-cache"), KERNELS)
    return SimpleNamespace(path=rep.path, report=rep, build_root=str(d / "build-cache"))


@pytest.fixture
def fresh(tmp_path):
    """An empty cache root inside a sentinel parent: nothing may appear beside it."""
    outer = tmp_path / "outer"
    outer.mkdir()
    return SimpleNamespace(outer=outer, root=outer / "root")


def _read(path):
    with tarfile.open(path) as tf:
        return [(m, tf.extractfile(m).read() if m.isreg() else None) for m in tf]


def _write(path, members, mode="w:gz"):
    with tarfile.open(path, mode, format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return str(path)


def _manifest(members) -> dict:
    assert members[0][0].name == "manifest.json"
    return json.loads(members[0][1])


def _set_manifest(members, mf):
    members[0] = (members[0][0], json.dumps(mf).encode())


def _resign(members):
    """Make the manifest's sha256/size of every file match the (edited) data."""
    mf = _manifest(members)
    for ti, data in members[1:]:
        if data is not None and ti.name in mf["members"]:
            mf["members"][ti.name] = {"sha256": _sha(data), "size": len(data)}
    _set_manifest(members, mf)


def _find(members, suffix, which=0):
    return [i for i, (ti, _) in enumerate(members) if ti.name.endswith(suffix)][which]


def _special(name, kind, linkname=""):
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = kind, linkname
    if kind == tarfile.CHRTYPE:
        ti.devmajor, ti.devminor = 1, 3
    return ti, None


def _assert_untouched(fresh):
    """A refused bundle leaves nothing: not beside the root, not in it (no half entry)."""
    assert os.listdir(fresh.outer) == [] or os.listdir(fresh.outer) == ["root"]
    assert cache.list_entries(str(fresh.root)) == []
    for dirpath, dirnames, filenames in os.walk(fresh.root):
        assert not [n for n in dirnames + filenames if n.startswith(".unpack-")]


# ------------------------------------------------------------ without compiling
def test_check_place():
    key = "ab" * 32
    meta = {"key": key, "variant": "rms_norm-x1", "target": {"arch": "sm_90a", "num_sms": 132}}
    good = f"/c/sm_90a-132sm/rms_norm-x1-{key[:16]}"
    assert cache.check_place(good, meta) is None
    assert cache.check_place(good + "/", meta) is None
    assert "entry directory" in cache.check_place(f"/c/sm_90a-132sm/rms_norm-x2-{key[:16]}", meta)
    assert "entry directory" in cache.check_place(f"/c/sm_90a-132sm/rms_norm-x1-{'cd' * 8}", meta)
    assert "target directory" in cache.check_place(f"/c/sm_90a-114sm/rms_norm-x1-{key[:16]}", meta)
    assert "sha256" in cache.check_place(good, dict(meta, key="../x"))
    assert "target" in cache.check_place(good, dict(meta, target=None))
    assert "not a JSON object" in cache.check_place(good, [])
    # a variant name too long for a file name: its place is the bounded name (cache.entry_dir_name)
    long = "qkv-" + "-".join(f"option{i}x{i}" for i in range(40))
    short = cache.entry_dir_name(long, key)
    assert "~" in short and len(short) == cache.MAX_NAME_CHARS + 17
    assert cache.check_place(f"/c/sm_90a-132sm/{short}", dict(meta, variant=long)) is None
    assert "entry directory" in cache.check_place(f"/c/sm_90a-132sm/{long}-{key[:16]}", dict(meta, variant=long))
    assert bundle._check_name("b", f"sm_90a-132sm/{short}/meta.json", "sm_90a-132sm")[1] == short


def test_not_a_bundle(tmp_path, fresh):
    p = tmp_path / "x.tar.gz"
    p.write_bytes(b"hello, not a tarball\n" * 10)
    with pytest.raises(ValueError, match="not a tar archive"):
        bundle.unpack(str(p), str(fresh.root))
    _assert_untouched(fresh)


# ------------------------------------------------------------------ pack/unpack
@pytest.mark.compile
def test_pack_then_unpack_serves_without_jit(packed, fresh, monkeypatch):
    rep = packed.report
    assert rep.entries == 2 and rep.members == 9 and rep.built == 2
    assert rep.sha256 == _sha(open(rep.path, "rb").read())
    members = _read(rep.path)
    mf = _manifest(members)
    assert mf["flintgen"] == __version__ and mf["dsl"] == toolchain.dsl_identity()
    assert mf["target"] == {"arch": "sm_90a", "num_sms": 132}
    assert mf["specs"][0]["spec_hash"] == FLINT.spec_hash and mf["specs"][0]["kernels"] == ["rms_norm"]
    assert {ti.name: {"sha256": _sha(d), "size": len(d)} for ti, d in members[1:]} == mf["members"]
    assert [ti.name.rsplit("/", 1)[1] for ti, _ in members[1:5]] == list(bundle.ENTRY_FILES)  # meta last

    out = bundle.unpack(rep.path, str(fresh.root), rep.sha256)
    assert (out.entries, out.used, len(out.installed), out.skipped) == (2, 2, 2, [])
    assert out.loaded and out.sha256 == rep.sha256
    assert sorted(os.listdir(fresh.outer)) == ["root"]
    monkeypatch.setenv("FLINTGEN_NO_JIT", "1")
    planned = bundle.planned_entries(FLINT, T, str(fresh.root), KERNELS)
    assert len(planned) == 2
    for e in planned:
        assert cache.check_entry(e) is None and cache.try_load(e) is not None
        assert cache.get_or_build(e).hit  # NO_JIT: a miss would raise
        assert cache.check_dir(e.dir, load=True) is None
        assert oct(os.stat(e.dir).st_mode & 0o777) == "0o755"
    assert not [n for n in os.listdir(os.path.join(fresh.root, "sm_90a-132sm")) if n.startswith(".")]

    again = bundle.pack(FLINT, T, str(fresh.outer / "again.tar.gz"), packed.build_root, KERNELS)
    assert again.built == 0 and again.entries == 2


@pytest.mark.compile
def test_unpack_skips_present_and_repairs_broken(packed, fresh, monkeypatch):
    first = bundle.unpack(packed.path, str(fresh.root), load=False)
    assert len(first.installed) == 2 and not first.loaded
    again = bundle.unpack(packed.path, str(fresh.root))
    assert again.installed == [] and sorted(again.skipped) == sorted(first.installed)

    broken, incomplete = (os.path.join(fresh.root, d) for d in sorted(first.installed))
    os.unlink(os.path.join(broken, "meta.json"))                     # an interrupted build
    with open(os.path.join(incomplete, "kernel.so"), "ab") as f:   # a damaged library
        f.write(b"x")
    replaced = []
    real = os.replace
    def spy(a, b):  # entry files only (lock-owner notes are written with os.replace too)
        if os.path.basename(b) in bundle.ENTRY_FILES:
            replaced.append(os.path.basename(b))
        return real(a, b)

    monkeypatch.setattr(os, "replace", spy)
    out = bundle.unpack(packed.path, str(fresh.root))
    assert sorted(out.installed) == sorted(first.installed) and out.skipped == []
    # Into an existing directory the files are replaced one by one, meta.json last each time.
    assert replaced == list(bundle.ENTRY_FILES) * 2
    for d in (broken, incomplete):
        assert cache.check_dir(d, load=True) is None


@pytest.mark.compile
def test_wrong_sha256_is_refused(packed, fresh):
    with pytest.raises(ValueError, match="its sha256 is [0-9a-f]{64}, expected 0{64}"):
        bundle.unpack(packed.path, str(fresh.root), "0" * 64)
    with pytest.raises(ValueError, match="not a sha256"):
        bundle.unpack(packed.path, str(fresh.root), "abc")
    _assert_untouched(fresh)
    assert not fresh.root.exists()


def _dotdot(m, tmp):
    m.append((tarfile.TarInfo("sm_90a-132sm/../../evil"), b"x"))


def _dotdot_first(m, tmp):
    m.insert(1, (tarfile.TarInfo("../evil"), b"x"))


def _absolute(m, tmp):
    m.append((tarfile.TarInfo(str(tmp / "abs_evil")), b"x"))


def _outside_layout(m, tmp):
    m.append((tarfile.TarInfo("sm_90a-132sm/evil.sh"), b"x"))


def _unknown_file(m, tmp):
    d = m[_find(m, "meta.json")][0].name.rsplit("/", 1)[0]
    m.append((tarfile.TarInfo(f"{d}/evil.sh"), b"x"))


def _symlink(m, tmp):
    i = _find(m, "kernel.so")
    m[i] = _special(m[i][0].name, tarfile.SYMTYPE, "/etc/passwd")


def _hardlink(m, tmp):
    i = _find(m, "kernel.so")
    m[i] = _special(m[i][0].name, tarfile.LNKTYPE, m[_find(m, "module.py")][0].name)


def _chardev(m, tmp):
    i = _find(m, "kernel.so")
    m[i] = _special(m[i][0].name, tarfile.CHRTYPE)


def _directory(m, tmp):
    i = _find(m, "kernel.so")
    m[i] = _special(m[i][0].name, tarfile.DIRTYPE)


def _duplicate(m, tmp):
    m.append(m[_find(m, "meta.json")])


def _sha_mismatch(m, tmp):
    i = _find(m, "kernel.ptx")
    data = bytearray(m[i][1])
    data[100] ^= 1
    m[i] = (m[i][0], bytes(data))


def _unlisted(m, tmp):
    ti, data = m[_find(m, "meta.json")]
    m.append((tarfile.TarInfo(ti.name.replace(ti.name.split("/")[1], "rms_norm-x-" + "0" * 16)), data))


def _manifest_last(m, tmp):
    m.append(m.pop(0))


def _meta_edit(fn):
    def edit(m, tmp):
        i = _find(m, "meta.json")
        meta = json.loads(m[i][1])
        fn(meta)
        m[i] = (m[i][0], json.dumps(meta).encode())
        _resign(m)  # only the place is wrong, every hash matches
    return edit


def _other_key(meta):
    meta["key"] = "f" * 64


def _other_variant(meta):
    meta["variant"] = "rms_norm-has_residual9-hidden2048"


def _other_sms(meta):
    meta["target"] = {"arch": "sm_90a", "num_sms": 114}


def _missing_member(m, tmp):
    del m[_find(m, "kernel.so", 1)]


REFUSALS = {
    "dotdot": (_dotdot, "escapes the cache root"),
    "dotdot_first": (_dotdot_first, "escapes the cache root"),
    "absolute": (_absolute, "is an absolute path"),
    "outside_layout": (_outside_layout, r"is not <arch>-<num_sms>sm/<variant>-<key16>/<file>"),
    "unknown_file": (_unknown_file, r"<file> one of"),
    "symlink": (_symlink, "is a symbolic link"),
    "hardlink": (_hardlink, "is a hard link"),
    "chardev": (_chardev, "is a device file"),
    "directory": (_directory, "is a directory"),
    "duplicate": (_duplicate, "appears twice"),
    "sha_mismatch": (_sha_mismatch, "has sha256 [0-9a-f]{64}, the manifest says"),
    "unlisted": (_unlisted, "is not listed in the manifest"),
    "missing_member": (_missing_member, "truncated: 1 member"),
    "manifest_last": (_manifest_last, "not manifest.json"),
    "meta_key": (_meta_edit(_other_key), "does not match its place: entry directory"),
    "meta_variant": (_meta_edit(_other_variant), "does not match its place: entry directory"),
    "meta_sms": (_meta_edit(_other_sms), "does not match its place: target directory 'sm_90a-132sm'"),
}


@pytest.mark.compile
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused(packed, fresh, tmp_path, case):
    edit, match = REFUSALS[case]
    members = _read(packed.path)
    edit(members, tmp_path)
    bad = _write(tmp_path / "bad.tar.gz", members)
    with pytest.raises(ValueError, match=match) as ei:
        bundle.unpack(bad, str(fresh.root))
    assert "flintgen cache pack" in str(ei.value) or "copy it again" in str(ei.value)
    _assert_untouched(fresh)
    assert not fresh.root.exists()  # the directories it made are removed again
    assert not (tmp_path / "abs_evil").exists() and not (tmp_path / "evil").exists()


@pytest.mark.compile
@pytest.mark.parametrize("cut", [40, 0.5, -4, -20])
def test_truncated_archive(packed, fresh, tmp_path, cut):
    data = open(packed.path, "rb").read()
    n = int(len(data) * cut) if isinstance(cut, float) else cut if cut > 0 else len(data) + cut
    p = tmp_path / "cut.tar.gz"
    p.write_bytes(data[:n])
    with pytest.raises(ValueError, match="truncated"):
        bundle.unpack(str(p), str(fresh.root))
    _assert_untouched(fresh)


@pytest.mark.compile
def test_truncated_plain_tar(packed, fresh, tmp_path):
    members = _read(packed.path)
    data = open(_write(tmp_path / "plain.tar", members, "w"), "rb").read()
    p = tmp_path / "cut.tar"
    p.write_bytes(data[:len(data) // 2 + 7])
    with pytest.raises(ValueError, match="truncated"):
        bundle.unpack(str(p), str(fresh.root))
    _assert_untouched(fresh)
    assert len(bundle.unpack(str(tmp_path / "plain.tar"), str(fresh.root)).installed) == 2  # uncut: fine


@pytest.mark.compile
def test_limits(packed, fresh):
    with pytest.raises(ValueError, match="more than 3 members"):
        bundle.unpack(packed.path, str(fresh.root), max_members=3)
    with pytest.raises(ValueError, match="more than 20000 uncompressed bytes"):
        bundle.unpack(packed.path, str(fresh.root), max_bytes=20000)
    _assert_untouched(fresh)
    with pytest.raises(ValueError, match="more than 100 uncompressed bytes at 'manifest.json'"):
        bundle.unpack(packed.path, str(fresh.root), max_bytes=100)
    assert not fresh.root.exists()


@pytest.mark.compile
def test_other_flintgen_version_is_refused(packed, fresh, monkeypatch):
    real = codegen.render
    # Another flintgen renders other source, so it computes other keys.
    monkeypatch.setattr(codegen, "render", lambda *a, **k: real(*a, **k) + "\n# flintgen 9.9\n")
    with pytest.raises(ValueError, match=rf"flintgen {__version__} would use none of its 2 entries: it was "
                                         rf"packed by flintgen {__version__}"):
        bundle.unpack(packed.path, str(fresh.root))
    assert not fresh.root.exists()


@pytest.mark.compile
def test_unknown_spec_field_uses_nothing(packed, fresh, tmp_path):
    members = _read(packed.path)
    mf = _manifest(members)
    mf["flintgen"] = "9.9.0"
    mf["specs"][0]["spec"]["new_field"] = 1
    _set_manifest(members, mf)
    with pytest.raises(ValueError, match=r"would use none .* flintgen 9\.9\.0 .*does not load here"):
        bundle.unpack(_write(tmp_path / "b.tar.gz", members), str(fresh.root))
    assert not fresh.root.exists()


@pytest.mark.compile
def test_other_sm_count_than_the_gpu_is_refused(packed, fresh, monkeypatch):
    monkeypatch.setattr(toolchain, "gpu_target", lambda *a, **k: Target("sm_90a", 114))
    with pytest.raises(ValueError, match="built for sm_90a with 132 SMs but the local GPU is sm_90a with 114 SMs"):
        bundle.unpack(packed.path, str(fresh.root))
    assert not fresh.root.exists()
    monkeypatch.setattr(toolchain, "gpu_target", lambda *a, **k: Target("sm_90a", 132))
    assert len(bundle.unpack(packed.path, str(fresh.root), load=False).installed) == 2


@pytest.mark.compile
def test_dsl_identity(packed, fresh, monkeypatch):
    fake = (("nvidia-cutlass-dsl", "4.9.0"), ("nvidia-cutlass-dsl-libs-cu13", "4.9.0"))
    monkeypatch.setattr(toolchain, "dsl_versions", lambda: fake)
    with pytest.raises(ValueError, match="stale here"):
        bundle.unpack(packed.path, str(fresh.root))
    assert not fresh.root.exists()
    monkeypatch.setattr(toolchain, "dsl_versions", lambda: ())  # a serving machine: runtime + tvm-ffi only
    out = bundle.unpack(packed.path, str(fresh.root))
    assert len(out.installed) == 2 and out.used == 2


@pytest.mark.compile
def test_cli_pack_unpack(packed, tmp_path):
    r = CliRunner()
    common = ["--preset", "flint", "--kernel", "rms_norm", "--arch", "sm_90a", "--num-sms", "132",
              "--cache-dir", packed.build_root]
    res = r.invoke(main, ["cache", "pack", *common, "-o", str(tmp_path / "b.tar.xz")])
    assert res.exit_code == 0, res.output
    assert "packed 2 entries (0 built first)" in res.output
    sha = res.output.split("sha256: ")[1].split()[0]
    assert sha == _sha(open(tmp_path / "b.tar.xz", "rb").read())
    root = str(tmp_path / "root")
    res = r.invoke(main, ["cache", "unpack", str(tmp_path / "b.tar.xz"), "--sha256", sha, "--cache-dir", root,
                          "--no-load"])
    assert res.exit_code == 0, res.output
    assert "2 installed, 0 already present" in res.output and "load-checked: no" in res.output
    assert f"flintgen {__version__} will use 2 of the 2 entries" in res.output
    res = r.invoke(main, ["cache", "verify", "--cache-dir", root])
    assert res.exit_code == 0 and " 0 bad" in res.output, res.output
    res = r.invoke(main, ["cache", "unpack", str(tmp_path / "b.tar.xz"), "--sha256", "1" * 64, "--cache-dir", root])
    assert res.exit_code == 2 and "expected 1111" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.compile
def test_reader_never_sees_a_half_entry(packed, fresh):
    """A loading process polling an entry while unpack replaces it sees no entry
    or a complete one, never meta.json beside a library that does not match."""
    import threading

    bundle.unpack(packed.path, str(fresh.root), load=False)
    planned = bundle.planned_entries(FLINT, T, str(fresh.root), KERNELS)
    seen = set()

    def poll(stop):
        while not stop.is_set():
            for e in planned:
                seen.add(cache.check_entry(e))

    for i in range(10):
        for e in planned:  # an interrupted rebuild of both: unpack replaces them in place
            os.unlink(e.path("meta.json"))
            with open(e.path("kernel.so") + ".new", "wb") as f:
                f.write(b"garbage")
            os.replace(e.path("kernel.so") + ".new", e.path("kernel.so"))
        stop = threading.Event()
        t = threading.Thread(target=poll, args=(stop,))
        t.start()
        try:
            assert len(bundle.unpack(packed.path, str(fresh.root), load=False).installed) == 2
        finally:
            stop.set()
            t.join()
    half = "missing or unreadable meta.json (not a JSON object)"
    assert seen <= {None, half}
    assert None in seen and half in seen
    for e in planned:
        assert cache.check_entry(e) is None
