"""Cache bundles: one archive of exactly the cache entries a spec needs.

    report = pack(spec, Target("sm_90a", 132), "flint.tar.gz")   # builds what is missing
    print(report.sha256)
    unpack("flint.tar.gz", sha256=report.sha256)                  # on the serving machine

A bundle is a tar archive (gzip; xz when the file name ends in ``.xz``) whose
first member is ``manifest.json``; then, per entry, its files under the cache
layout ``<arch>-<num_sms>sm/<variant>-<key16>/<file>``, meta.json last. The
manifest records the flintgen version, the DSL identity, the target, the
spec(s) the bundle was packed for (so that unpack can recompute the keys the
installed flintgen would look up) and the sha256 and size of every member.

``unpack`` never extracts with tarfile: it reads the members itself and refuses
(ValueError, nothing published) path tricks (``..``, absolute names, names
outside the layout), anything but regular files (symlinks, hard links,
devices), duplicate members, a truncated or corrupt archive, a member whose
sha256 or size differs from the manifest, an entry whose meta.json does not
match its place (``cache.check_place``) or that ``cache.check_dir`` (the
check of ``flintgen cache verify``) rejects, more than ``max_members`` members
or ``max_bytes`` uncompressed bytes, a bundle for another SM count than the
local GPU's and one none of whose entries this flintgen would use. Entries
are staged inside ``<root>/<arch>-<num_sms>sm/`` and published under the
entry's lock: the staged directory is renamed into place, or (over an
incomplete or stale entry) meta.json is removed, the files are replaced and
meta.json comes last, so that a loading process sees no entry or a complete
one. Entries already present and valid are skipped.

A bundle is trusted native code: unpack guards against corruption and path
tricks, not against a malicious builder (whoever builds the bundle chooses the
code that runs).

Cute-free: runs on a serving machine with only tvm-ffi and the DSL runtime.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import io
import json
import lzma
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import filelock

from flintgen import cache, toolchain
from flintgen._version import __version__
from flintgen.kernels import KERNELS, get_def
from flintgen.kernels.base import Target
from flintgen.knobs import knobs
from flintgen.spec import Spec

BUNDLE_FORMAT = 1
MANIFEST = "manifest.json"
#: The files of an entry, in archive order (meta.json, the commit marker, last).
ENTRY_FILES = cache.ENTRY_FILES
#: Refusal limits (``unpack``'s ``max_members`` / ``max_bytes`` defaults). A
#: full spec is a few dozen entries of a few MiB each.
MAX_MEMBERS = 20_000
MAX_BYTES = 16 << 30  # uncompressed, manifest and trailing padding included
MAX_MANIFEST_BYTES = 64 << 20

_REBUILD = "rebuild the bundle with `flintgen cache pack`"
_TARGET_DIR = re.compile(r"(sm_[0-9]+[a-z]?)-([1-9][0-9]{0,5})sm")
_ENTRY_DIR = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.~-]*)-([0-9a-f]{16})")   # ~: a long name's hash (cache.entry_dir_name)
_HEX64 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError)  # reading the bundle


# ---------------------------------------------------------------- planning
def planned_entries(spec: Spec, target: Target, root: str | None = None,
                    kernels: Sequence[str] = ()) -> list[cache.Entry]:
    """The cache entries ``spec`` needs on ``target`` (only ``kernels``, if given),
    with the keys the installed flintgen computes."""
    for name in kernels:
        get_def(name)  # unknown names fail early
    out = []
    for name, kdef in KERNELS.items():
        if kdef.needed(spec) and (not kernels or name in kernels):
            for v in kdef.variants(spec, target):
                out.append(cache.make_entry(v, kdef.template_of(v), dict(kdef.render_params(spec, v)), target, root))
    return out


def _locked(entry_dir: str, what: str):
    """The entry's lock (the one ``cache.get_or_build`` takes), held."""
    lock = cache._EntryLock(entry_dir, what)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise ValueError(
            f"the lock of {what} ({cache.lock_path(entry_dir)}) is held by another process for more than "
            f"FLINTGEN_LOCK_TIMEOUT={knobs.lock_timeout:g} s: wait for the build to finish or raise "
            "FLINTGEN_LOCK_TIMEOUT"
        ) from None
    return lock


def _sha256_stream(f) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(_CHUNK), b""):
        h.update(chunk)
    return h.hexdigest()


def can_load() -> tuple[bool, str]:
    """(whether libraries can be load-checked here, why not)."""
    if importlib.util.find_spec("tvm_ffi") is None:
        return False, "apache-tvm-ffi is not installed"
    if toolchain.find_runtime_lib() is None:
        return False, "libcute_dsl_runtime.so not found (set FLINTGEN_RUNTIME_LIB)"
    return True, ""


# -------------------------------------------------------------------- pack
@dataclass
class PackReport:
    path: str
    sha256: str        # of the archive file
    entries: int
    built: int         # entries that were missing and were built first
    members: int       # files in the archive, manifest included
    bytes: int         # uncompressed member bytes


def _tarinfo(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime, ti.type = size, 0o644, mtime, tarfile.REGTYPE
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def pack(spec: Spec | Iterable[Spec], target: Target, out_path: str, root: str | None = None,
         kernels: Sequence[str] = ()) -> PackReport:
    """Write one bundle of exactly the entries ``spec`` needs on ``target``
    (building the missing ones into the cache at ``root``) to ``out_path``."""
    specs = [spec] if isinstance(spec, Spec) else list(spec)
    toolchain._check_arch(target.arch)
    toolchain._check_num_sms(target.num_sms)
    root = os.path.abspath(root or cache.default_root())
    entries: dict[str, cache.Entry] = {}
    for s in specs:
        for e in planned_entries(s, target, root, kernels):
            entries.setdefault(e.key, e)
    if not entries:
        raise ValueError(f"spec(s) {[s.name for s in specs]} need no kernel {list(kernels) or ''} on "
                         f"{target.arch}: nothing to pack; check --kernel")
    out_path = os.path.abspath(out_path)
    out_dir = os.path.dirname(out_path)
    os.makedirs(out_dir, exist_ok=True)
    snap = tempfile.mkdtemp(prefix=".flintgen-pack-", dir=out_dir)
    built = 0
    try:
        members: dict[str, dict] = {}
        listed, dsls = [], []
        for e in entries.values():
            if not cache.get_or_build(e).hit:
                built += 1
            rel = os.path.relpath(e.dir, root)
            # Snapshot under the lock: a concurrent rebuild cannot mix two builds.
            lock = _locked(e.dir, f"kernel {e.variant.name}")
            try:
                problem = cache.check_entry(e)
                if problem:
                    raise ValueError(
                        f"kernel {e.variant.name} is not usable in the cache at {root} ({problem}) after "
                        "building it: the cache root must be writable to pack; set --cache-dir"
                    )
                os.makedirs(os.path.join(snap, rel))
                for name in ENTRY_FILES:
                    shutil.copyfile(e.path(name), os.path.join(snap, rel, name))
            finally:
                lock.release()
            with open(os.path.join(snap, rel, "meta.json")) as f:
                meta = json.load(f)
            if meta.get("dsl") not in dsls:
                dsls.append(meta.get("dsl"))
            for name in ENTRY_FILES:
                p = os.path.join(snap, rel, name)
                members[f"{rel}/{name}"] = {"sha256": cache._sha256_file(p), "size": os.path.getsize(p)}
            if any(members[f"{rel}/{n}"]["sha256"] != (meta.get("files") or {}).get(n)
                   for n in cache.HASHED_FILES):
                raise ValueError(f"kernel {e.variant.name} changed while it was packed: run pack again")
            listed.append({"dir": rel, "key": e.key, "kernel": e.variant.kernel, "variant": e.variant.name})
        manifest = {
            "bundle_format": BUNDLE_FORMAT,
            "flintgen": __version__,
            # The DSL the entries were built with (None if they differ: packed from a
            # serving machine's cache); unpack checks each entry's own too.
            "dsl": dsls[0] if len(dsls) == 1 else None,
            "tvm_ffi": toolchain.package_version("apache-tvm-ffi"),
            "target": target.to_json(),
            "specs": [{"name": s.name, "spec_hash": s.spec_hash, "spec": s.to_dict(),
                       "kernels": list(kernels) or None} for s in specs],
            "entries": listed,
            "members": members,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        mode, kw = ("w:xz", {"preset": 6}) if out_path.endswith(".xz") else ("w:gz", {"compresslevel": 6})
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".bundle", dir=out_dir)
        os.close(fd)
        try:
            mtime = int(datetime.datetime.now().timestamp())
            with tarfile.open(tmp, mode, format=tarfile.PAX_FORMAT, **kw) as tf:
                tf.addfile(_tarinfo(MANIFEST, len(data), mtime), io.BytesIO(data))
                for name, m in members.items():
                    with open(os.path.join(snap, name), "rb") as f:
                        tf.addfile(_tarinfo(name, m["size"], mtime), f)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out_path)
        except BaseException:
            cache.with_suppress(os.unlink, tmp)
            raise
    finally:
        shutil.rmtree(snap, ignore_errors=True)
    return PackReport(out_path, cache._sha256_file(out_path), len(listed), built, len(members) + 1,
                      len(data) + sum(m["size"] for m in members.values()))


# ------------------------------------------------------------------ unpack
@dataclass
class UnpackReport:
    path: str
    sha256: str              # of the archive file
    root: str
    target: Target
    bundle_flintgen: str
    entries: int
    used: int                # entries whose key the installed flintgen computes for the bundle's spec(s)
    installed: list[str] = field(default_factory=list)   # relative to root
    skipped: list[str] = field(default_factory=list)     # already present and valid
    loaded: bool = False     # libraries were load-checked before publishing
    load_note: str = ""


def _refuse(path: str, why: str, fix: str = _REBUILD) -> ValueError:
    return ValueError(f"bundle {path}: {why}; {fix}")


def _check_name(path: str, name: str, target_dir: str | None) -> tuple[str, str, str]:
    """(target dir, entry dir, file) of a member name, or raise."""
    if not isinstance(name, str) or not name:
        raise _refuse(path, f"member name {name!r} is empty")
    if "\0" in name or "\\" in name:
        raise _refuse(path, f"member name {name!r} has a NUL or backslash")
    if name.startswith("/") or re.match(r"[A-Za-z]:", name):
        raise _refuse(path, f"member {name!r} is an absolute path (members are relative to the cache root)")
    parts = name.split("/")
    if ".." in parts:
        raise _refuse(path, f"member {name!r} escapes the cache root ('..')")
    if any(p in ("", ".") for p in parts) or os.path.normpath(name) != name:
        raise _refuse(path, f"member name {name!r} is not a normalized relative path")
    if len(parts) != 3 or not _TARGET_DIR.fullmatch(parts[0]) or not _ENTRY_DIR.fullmatch(parts[1]) \
            or parts[2] not in ENTRY_FILES:
        raise _refuse(path, f"member {name!r} is not <arch>-<num_sms>sm/<variant>-<key16>/<file> "
                            f"with <file> one of {list(ENTRY_FILES)}")
    if target_dir is not None and parts[0] != target_dir:
        raise _refuse(path, f"member {name!r} is not under the bundle's target directory {target_dir}/")
    return parts[0], parts[1], parts[2]


def _check_type(path: str, m: tarfile.TarInfo) -> None:
    kind = ("a symbolic link (to %r)" % m.linkname if m.issym() else
            "a hard link (to %r)" % m.linkname if m.islnk() else
            "a device file" if m.ischr() or m.isblk() else
            "a FIFO" if m.isfifo() else
            "a directory" if m.isdir() else
            None if m.type in (tarfile.REGTYPE, tarfile.AREGTYPE) else
            f"not a regular file (tar type {m.type!r})")
    if kind:
        raise _refuse(path, f"member {m.name!r} is {kind}: bundles hold regular files only")


def _parse_manifest(path: str, data: bytes) -> dict:
    try:
        mf = json.loads(data)
    except ValueError as e:
        raise _refuse(path, f"manifest.json is not valid JSON ({e})") from None
    if not isinstance(mf, dict):
        raise _refuse(path, "manifest.json is not a JSON object")
    if mf.get("bundle_format") != BUNDLE_FORMAT:
        raise _refuse(path, f"bundle format {mf.get('bundle_format')!r} (flintgen {mf.get('flintgen')}) is not "
                            f"{BUNDLE_FORMAT}, the one flintgen {__version__} reads",
                      f"pack it with flintgen {__version__}")
    t = mf.get("target")
    if not isinstance(t, dict) or not isinstance(t.get("arch"), str) or not isinstance(t.get("num_sms"), int):
        raise _refuse(path, f"manifest target {t!r} is not {{'arch': str, 'num_sms': int}}")
    toolchain._check_arch(t["arch"])
    toolchain._check_num_sms(t["num_sms"])
    tdir = f"{t['arch']}-{t['num_sms']}sm"
    members, entries, specs = mf.get("members"), mf.get("entries"), mf.get("specs")
    if not isinstance(members, dict) or not isinstance(entries, list) or not isinstance(specs, list):
        raise _refuse(path, "manifest.json lacks 'members' (object), 'entries' (list) or 'specs' (list)")
    for name, m in members.items():
        _check_name(path, name, tdir)
        if not isinstance(m, dict) or not isinstance(m.get("sha256"), str) or not _HEX64.fullmatch(m["sha256"]) \
                or not isinstance(m.get("size"), int) or m["size"] < 0:
            raise _refuse(path, f"manifest record of {name!r} is not {{'sha256': hex, 'size': int}}")
    dirs = set()
    for ent in entries:
        if not isinstance(ent, dict) or not all(isinstance(ent.get(k), str) for k in ("dir", "key", "variant")):
            raise _refuse(path, f"manifest entry {ent!r} lacks dir, key or variant")
        want = f"{tdir}/{cache.entry_dir_name(ent['variant'], ent['key'])}" if _HEX64.fullmatch(ent["key"]) else None
        if ent["dir"] != want:
            raise _refuse(path, f"manifest entry {ent['dir']!r} does not match its key and variant "
                                f"(expected {want or 'a sha256 key'})")
        if ent["dir"] in dirs:
            raise _refuse(path, f"manifest lists entry {ent['dir']!r} twice")
        dirs.add(ent["dir"])
        for f in ENTRY_FILES:
            if f"{ent['dir']}/{f}" not in members:
                raise _refuse(path, f"manifest entry {ent['dir']!r} has no {f}")
    for name in members:
        if name.rsplit("/", 1)[0] not in dirs:
            raise _refuse(path, f"member {name!r} belongs to no entry of the manifest")
    if not entries:
        raise _refuse(path, "the bundle has no entries")
    return mf


def _used(mf: dict, target: Target, root: str) -> tuple[int, list[str]]:
    """How many bundled entries the installed flintgen looks up for the bundle's
    spec(s), and why a spec yields nothing."""
    keys, notes = set(), []
    for s in mf["specs"]:
        try:
            spec = Spec.from_dict(s["spec"])
            kernels = s.get("kernels") or ()
            keys |= {e.key for e in planned_entries(spec, target, root, kernels)}
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            notes.append(f"spec {s.get('name') if isinstance(s, dict) else s!r} does not load here ({e})")
    return sum(1 for ent in mf["entries"] if ent["key"] in keys), notes


class _Reader:
    """Sequential, bounded reading of a bundle's members."""

    def __init__(self, path: str, tf: tarfile.TarFile, max_members: int, max_bytes: int):
        self.path, self.tf, self.max_members, self.max_bytes = path, tf, max_members, max_bytes
        self.count = 0
        self.total = 0

    def _corrupt(self, e) -> ValueError:
        return _refuse(self.path, f"the archive is truncated or corrupt ({type(e).__name__}: {e})",
                       "copy it again or " + _REBUILD)

    def next(self) -> tarfile.TarInfo | None:
        try:
            m = self.tf.next()
        except _ARCHIVE_ERRORS as e:
            raise self._corrupt(e) from None
        if m is None:
            return None
        self.count += 1
        if self.count > self.max_members:
            raise _refuse(self.path, f"more than {self.max_members} members (the limit: max_members, "
                                     "flintgen.bundle.MAX_MEMBERS); a spec's bundle has a few dozen",
                          "pack one spec per bundle")
        return m

    def _budget(self, n: int, what: str) -> None:
        self.total += n
        if self.total > self.max_bytes:
            raise _refuse(self.path, f"more than {self.max_bytes} uncompressed bytes at {what} (the limit: "
                                     "max_bytes, flintgen.bundle.MAX_BYTES)", "pack one spec per bundle")

    def chunks(self, m: tarfile.TarInfo):
        self._budget(m.size, repr(m.name))
        try:
            f = self.tf.extractfile(m)
            left = m.size
            while left:
                b = f.read(min(_CHUNK, left))
                if not b:
                    raise EOFError(f"member {m.name!r} ends early")
                left -= len(b)
                yield b
        except _ARCHIVE_ERRORS as e:
            raise self._corrupt(e) from None

    def drain(self) -> None:
        """Read to the end of the (compressed) stream: its checksum and length
        are checked there, so a cut after the last member is caught too."""
        f = self.tf.fileobj
        try:
            while True:
                b = f.read(_CHUNK)
                if not b:
                    return
                self._budget(len(b), "the end of the archive")
        except _ARCHIVE_ERRORS as e:
            raise self._corrupt(e) from None


def _write_member(reader: _Reader, m: tarfile.TarInfo, dest: str, want: dict) -> None:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    h = hashlib.sha256()
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o644)
        for b in reader.chunks(m):
            h.update(b)
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    if h.hexdigest() != want["sha256"]:
        raise _refuse(reader.path, f"member {m.name!r} has sha256 {h.hexdigest()}, the manifest says "
                                   f"{want['sha256']}: the archive is corrupt", "copy it again or " + _REBUILD)


def _publish(staged: str, final: str) -> None:
    """Move a verified entry into place (its lock held): a reader sees no entry
    or a complete one."""
    if not os.path.lexists(final):
        os.rename(staged, final)  # the whole directory at once
        return
    if os.path.islink(final) or not os.path.isdir(final):
        raise ValueError(f"{final} exists and is not an entry directory: remove it and unpack again")
    cache.with_suppress(os.unlink, os.path.join(final, "meta.json"))  # invalidate first
    for name in ENTRY_FILES:  # meta.json last: the commit marker
        os.replace(os.path.join(staged, name), os.path.join(final, name))


def unpack(path: str, root: str | None = None, sha256: str | None = None, *, load: bool | None = None,
           max_members: int = MAX_MEMBERS, max_bytes: int = MAX_BYTES) -> UnpackReport:
    """Verify the bundle at ``path`` and install its entries into the cache at
    ``root``. ``load``: load-check every library before publishing it (default:
    where tvm-ffi and the DSL runtime library are available). Raises ValueError
    (with nothing published) for a bundle it refuses."""
    root = os.path.abspath(root or cache.default_root())
    note = ""
    if load is None:
        load, note = can_load()
    with open(path, "rb") as f:
        digest = _sha256_stream(f)
        if sha256 is not None:
            want = sha256.strip().lower()
            if not _HEX64.fullmatch(want):
                raise ValueError(f"--sha256 {sha256!r} is not a sha256 (64 hex digits): pass the value "
                                 "`flintgen cache pack` printed")
            if want != digest:
                raise _refuse(path, f"its sha256 is {digest}, expected {want}: the file is corrupt, truncated or "
                                    "another bundle", "copy it again, or pass the sha256 pack printed for it")
        f.seek(0)
        try:
            tf = tarfile.open(fileobj=f, mode="r:*")
        except _ARCHIVE_ERRORS as e:
            raise _refuse(path, f"not a tar archive, or truncated ({e})", "copy it again or " + _REBUILD) from None
        with tf:
            return _unpack(path, digest, tf, root, load, note, max_members, max_bytes)


def _unpack(path, digest, tf, root, load, note, max_members, max_bytes) -> UnpackReport:
    reader = _Reader(path, tf, max_members, max_bytes)
    m = reader.next()
    if m is None or m.name != MANIFEST:
        raise _refuse(path, f"the first member is {m.name if m else None!r}, not {MANIFEST}: not a flintgen bundle")
    _check_type(path, m)
    if m.size > MAX_MANIFEST_BYTES:
        raise _refuse(path, f"manifest.json is {m.size} bytes, more than {MAX_MANIFEST_BYTES}")
    mf = _parse_manifest(path, b"".join(reader.chunks(m)))
    target = Target(mf["target"]["arch"], mf["target"]["num_sms"])
    tdir = f"{target.arch}-{target.num_sms}sm"
    where = f"{target.arch} with {target.num_sms} SMs"

    gpu = toolchain.gpu_target()
    if gpu is not None and gpu != target:
        raise _refuse(path, f"it is built for {where} but the local GPU is {gpu.arch} with {gpu.num_sms} SMs "
                            "(launch configurations depend on the SM count): flintgen would not use it here",
                      f"pack one with `flintgen cache pack --arch {gpu.arch} --num-sms {gpu.num_sms}`")
    ident = toolchain.dsl_identity()
    if ident is not None and mf.get("dsl") is not None and mf["dsl"] != ident:
        raise _refuse(path, f"it was built with DSL {mf.get('dsl')} and this machine has DSL {ident}, so its "
                            "entries are stale here (the cache would rebuild them)",
                      "pack it with the installed DSL, or unpack on a serving machine without the DSL")
    used, notes = _used(mf, target, root)
    if used == 0:
        raise _refuse(path, f"flintgen {__version__} would use none of its {len(mf['entries'])} entries: it was "
                            f"packed by flintgen {mf.get('flintgen')} (DSL {mf.get('dsl')}) for spec(s) "
                            f"{[s.get('name') for s in mf['specs'] if isinstance(s, dict)]} and the kernel keys "
                            "this flintgen computes differ (generated source, helpers, compile options or "
                            f"CUTE_DSL_* environment){'; ' + '; '.join(notes) if notes else ''}",
                      f"pack the bundle with flintgen {__version__}")

    # Stage everything inside the target directory (same filesystem: renames are atomic).
    target_root = os.path.join(root, tdir)
    made = [d for d in (root, target_root) if not os.path.isdir(d)]
    os.makedirs(target_root, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".unpack-", dir=target_root)
    ok = False
    try:
        members = mf["members"]
        seen: set[str] = set()
        while (m := reader.next()) is not None:
            _, edir, _ = _check_name(path, m.name, tdir)
            _check_type(path, m)
            if m.name in seen:
                raise _refuse(path, f"member {m.name!r} appears twice")
            seen.add(m.name)
            want = members.get(m.name)
            if want is None:
                raise _refuse(path, f"member {m.name!r} is not listed in the manifest")
            if m.size != want["size"]:
                raise _refuse(path, f"member {m.name!r} is {m.size} bytes, the manifest says {want['size']}",
                              "copy it again or " + _REBUILD)
            d = os.path.join(stage, tdir, edir)
            if not os.path.isdir(d):
                os.makedirs(d)
                os.chmod(d, 0o755)  # published as is: readable by every user of a shared cache
            _write_member(reader, m, os.path.join(d, os.path.basename(m.name)), want)
        missing = sorted(set(members) - seen)
        if missing:
            raise _refuse(path, f"the archive is truncated: {len(missing)} member(s) of the manifest are "
                                f"missing, e.g. {missing[0]!r}", "copy it again or " + _REBUILD)
        reader.drain()

        for ent in mf["entries"]:
            staged, final = os.path.join(stage, ent["dir"]), os.path.join(root, ent["dir"])
            meta = cache.read_meta_file(staged)
            if meta is None:
                raise _refuse(path, f"entry {ent['dir']}: meta.json is not a JSON object")
            problem = cache.check_place(final, meta)
            if problem is None and meta.get("key") != ent["key"]:
                problem = f"meta.json key {meta.get('key')} is not the manifest's {ent['key']}"
            if problem:
                raise _refuse(path, f"entry {ent['dir']} does not match its place: {problem}")
            problem = cache.check_dir(staged, load=load)
            if problem:
                raise _refuse(path, f"entry {ent['dir']} fails verification: {problem}")

        report = UnpackReport(path, digest, root, target, str(mf.get("flintgen")), len(mf["entries"]), used,
                              loaded=load, load_note=note)
        for ent in mf["entries"]:
            staged, final = os.path.join(stage, ent["dir"]), os.path.join(root, ent["dir"])
            lock = _locked(final, f"entry {ent['dir']}")
            try:
                if cache.check_dir(final, expected_key=ent["key"]) is None:
                    report.skipped.append(ent["dir"])
                    continue
                _publish(staged, final)
            finally:
                lock.release()
            report.installed.append(ent["dir"])
        ok = True
        return report
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not ok:
            for d in reversed(made):  # leave no empty directories behind a refused bundle
                cache.with_suppress(os.rmdir, d)
