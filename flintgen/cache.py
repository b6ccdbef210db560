"""The on-disk kernel cache.

Layout (one directory per kernel identity)::

    <root>/CACHEDIR.TAG                          marks the root as a flintgen cache
    <root>/<arch>-<num_sms>sm/<variant name>-<key16>/     (a name past 227 characters: <prefix>~<sha12>)
        module.py    the generated CuTe DSL source (imported from here to compile)
        kernel.so    the exported kernel (TVM-FFI), loaded without cutlass
        kernel.ptx   the PTX, kept for inspection and CI checks
        meta.json    written last: the commit marker; sha256 of every other file
    <root>/locks/<arch>-<num_sms>sm/<variant name>-<key16>.lock

The key hashes the kernel's identity: kernel name and compile-time parameters,
the rendered source, flintgen's device-helper modules it imports (found with
``ast``, transitively), the compile and export code (``compiler.py``: options,
link flags), the target (arch, SM count), the compile options and the DSL's
compile-affecting environment. Not the Python version, so a cache built under
3.11 serves 3.12. Not the tvm-ffi version: an exported kernel calls tvm-ffi's
C ABI through symbols resolved when it loads, so a library that does not fit
the installed tvm-ffi fails to load, which is a miss (rebuilt), never a wrong
kernel.

The DSL version is checked, not keyed: where the DSL is installed, an entry
built by another DSL version is a miss and is rebuilt in place; where only the
runtime and tvm-ffi are installed (a serving machine), any entry whose library
loads is used.

Lifecycle (FlashInfer's JitSpec contract): ``try_load`` never raises for a
missing, partial, stale or corrupt entry, it returns None; ``build`` raises
only when no usable kernel can result. ``get_or_build`` = check, lock, check,
build. An unwritable cache still yields a working kernel, with a warning
(``fallback=False``, used by ``flintgen build``, raises instead).

One check, ``check_dir``, decides whether an entry is usable: the runtime
(``check_entry``), ``flintgen cache verify`` (with ``load=True``) and bundle
unpacking all call it.
``clean`` removes only directories it can prove are entries, each under its
lock, so a concurrent build survives it.
"""

from __future__ import annotations

import ast
import datetime
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import warnings
from dataclasses import dataclass, field

import filelock

from flintgen import codegen, resources, toolchain
from flintgen._version import __version__
from flintgen.kernels.base import Target, Variant
from flintgen.knobs import compile_env, knobs

_PKG_DIR = resources.PACKAGE_DIR
META_VERSION = 2  # 2: sha256 of every file, compile code in the key, a lock per entry directory
ENTRY_FILES = ("module.py", "kernel.so", "kernel.ptx", "meta.json")
HASHED_FILES = ("module.py", "kernel.so", "kernel.ptx")  # meta.json records their sha256
#: Work files of an entry being written (left behind only by a killed process).
WORK_PREFIXES = (".build-", ".tmp-")
TARGET_DIR = re.compile(r"^sm_\d+a?-\d+sm$")
ENTRY_DIR = re.compile(r"^[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*-([0-9a-f]{16})$")
CACHEDIR_TAG = "CACHEDIR.TAG"
_TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
             "# This directory is a flintgen kernel cache (https://bford.info/cachedir/).\n")


class MissingKernelError(RuntimeError):
    """FLINTGEN_NO_JIT=1 and the kernel is not in the cache."""


class CacheUnusableError(RuntimeError):
    """The cache cannot take a kernel (``get_or_build(..., fallback=False)``)."""


class KernelResourceError(RuntimeError):
    """ptxas reports spills or local memory: the kernel is refused, never cached."""


class CacheWarning(UserWarning):
    pass


class Problem(str):
    """Why an entry is not usable (the text); ``other_toolchain``: the entry is
    sound but was built by another DSL or flintgen version."""

    other_toolchain = False


def _other_toolchain(reason: str) -> Problem:
    p = Problem(reason)
    p.other_toolchain = True
    return p


def default_root() -> str:
    """FLINTGEN_CACHE_DIR, else ``cache/`` of the source checkout flintgen runs
    from, else ``$XDG_CACHE_HOME/flintgen`` (``~/.cache/flintgen``)."""
    if knobs.cache_dir:
        return os.path.abspath(knobs.cache_dir)
    checkout = resources.checkout_root()
    if checkout is not None:
        return os.path.join(checkout, "cache")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "flintgen")


# ------------------------------------------------------------------ the key
def _module_file(name: str) -> str | None:
    """The file of flintgen module ``name`` (``flintgen.device.ptx``), or None."""
    parts = name.split(".")
    if parts[0] != "flintgen":
        return None
    base = os.path.join(_PKG_DIR, *parts[1:])
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


@functools.lru_cache(maxsize=None)
def _imports(source: str, package: str = "") -> frozenset[str]:
    """The flintgen modules ``source`` imports (parsed, so every import form
    counts: ``from flintgen.device import (a, b)``, ``import flintgen.x as y``,
    relative imports inside ``package``). Memoized by content: every variant's
    key walks the same helper modules."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "flintgen")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([mod] if mod else []))
            if mod.split(".")[0] != "flintgen":
                continue
            for a in node.names:  # a submodule when one exists, else a name in ``mod``
                sub = f"{mod}.{a.name}"
                out.add(sub if _module_file(sub) else mod)
    return frozenset(out)


def _read_module(name: str) -> bytes:
    path = _module_file(name)
    if path is None:
        raise ValueError(f"generated source imports {name}, which does not exist in flintgen")
    with open(path, "rb") as f:
        return f.read()


def helpers_hash(source: str) -> str:
    """sha256 over the flintgen modules the generated ``source`` imports,
    transitively: editing a helper rebuilds exactly the kernels that use it."""
    seen: set[str] = set()
    todo = sorted(_imports(source))
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        package = name if _module_file(name).endswith("__init__.py") else name.rsplit(".", 1)[0]
        todo += sorted(_imports(_read_module(name).decode(), package) - seen)
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(name.encode() + b"\0" + _read_module(name))
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def compile_code_hash() -> str:
    """sha256 of the code that turns a module into a binary (``compiler.py``:
    compile options, export, link command), so an upgrade that changes how
    kernels are built never serves an old binary."""
    return hashlib.sha256(_read_module("flintgen.compiler")).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One kernel identity and where it lives."""

    variant: Variant
    template: str
    source: str
    target: Target
    key: str
    root: str

    @property
    def target_dir(self) -> str:
        return f"{self.target.arch}-{self.target.num_sms}sm"

    @property
    def dir_name(self) -> str:
        return entry_dir_name(self.variant.name, self.key)

    @property
    def dir(self) -> str:
        return os.path.join(self.root, self.target_dir, self.dir_name)

    @property
    def function_name(self) -> str:
        return f"{self.variant.kernel}_{self.key[:12]}"

    @property
    def module_name(self) -> str:
        return f"flintgen_generated.{self.variant.kernel}_{self.key[:16]}"

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)


def key_material(variant: Variant, source: str, target: Target) -> dict:
    from flintgen.compiler import compile_options  # cutlass-free module top

    return {
        "kernel": variant.kernel,
        "params": dict(variant.params),
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "helpers_sha256": helpers_hash(source),
        "compile_code_sha256": compile_code_hash(),
        "arch": target.arch,
        "num_sms": target.num_sms,
        "options": compile_options(target),
        "env": compile_env(),
    }


def key_of(material: dict) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def make_entry(variant: Variant, template: str, params: dict, target: Target,
               root: str | None = None) -> Entry:
    source = codegen.render(variant.kernel, template, params)
    key = key_of(key_material(variant, source, target))
    return Entry(variant, template, source, target, key, root or default_root())


# ------------------------------------------------------------------ files
def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: str, data: bytes) -> None:
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600: other users of a shared cache must read it
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX
    except BaseException:
        with_suppress(os.unlink, tmp)
        raise


def with_suppress(fn, *args):
    try:
        fn(*args)
    except OSError:
        pass


def read_meta_file(d: str) -> dict | None:
    """The entry's meta.json as a dict; None when missing, unreadable, not JSON or not an object."""
    try:
        with open(os.path.join(d, "meta.json"), "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


# a variant's part of an entry directory name: + "-<key16>" (17) + the lock's ".lock.owner" (11) = 255 bytes,
# the longest file name; every variant name of the presets is shorter (207 at most), so theirs are unchanged
MAX_NAME_CHARS = 227


def entry_dir_name(variant: str, key: str) -> str:
    """``<variant>-<key16>``: the entry directory of variant name ``variant`` and
    cache key ``key``. A name longer than MAX_NAME_CHARS keeps its first
    characters and a hash of the whole, ``<prefix>~<sha12>``: file names are
    at most 255 bytes, and a variant with many launch options (the streaming
    QKV GEMV's) plus the key and its lock's ``.lock`` would not fit."""
    if len(variant) > MAX_NAME_CHARS:
        variant = f"{variant[:MAX_NAME_CHARS - 13]}~{hashlib.sha256(variant.encode()).hexdigest()[:12]}"
    return f"{variant}-{key[:16]}"


def read_meta(entry: Entry) -> dict | None:
    return read_meta_file(entry.dir)


def lock_path(entry_dir: str) -> str:
    """``<root>/locks/<target dir>/<entry dir>.lock``: one lock per entry directory."""
    tdir = os.path.dirname(os.path.abspath(entry_dir))
    root = os.path.dirname(tdir)
    return os.path.join(root, "locks", os.path.basename(tdir), os.path.basename(entry_dir) + ".lock")


# ------------------------------------------------------------------ the check
_KEY_RE = re.compile(r"[0-9a-f]{64}")


def check_place(entry_dir: str, meta: dict) -> str | None:
    """Why ``meta`` does not belong at ``entry_dir``, or None: the directory
    must be ``<arch>-<num_sms>sm/<variant>-<key16>`` of meta's target, variant
    and key (only the names are compared; nothing is read)."""
    if not isinstance(meta, dict):
        return "meta.json is not a JSON object"
    d = os.path.normpath(os.path.abspath(entry_dir))
    name, tdir = os.path.basename(d), os.path.basename(os.path.dirname(d))
    key, variant, target = meta.get("key"), meta.get("variant"), meta.get("target")
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        return f"meta.json key {key!r} is not a sha256 hex digest"
    if not isinstance(variant, str) or not variant:
        return f"meta.json variant {variant!r} is not a name"
    if name != entry_dir_name(variant, key):
        return (f"entry directory {name!r} does not match meta.json (variant {variant}, key {key[:16]}): "
                f"expected {entry_dir_name(variant, key)} (copied from another entry?)")
    if not isinstance(target, dict) or not isinstance(target.get("arch"), str) \
            or not isinstance(target.get("num_sms"), int):
        return f"meta.json target {target!r} is not {{'arch': str, 'num_sms': int}}"
    expected = f"{target['arch']}-{target['num_sms']}sm"
    if tdir != expected:
        return f"target directory {tdir!r} does not match meta.json target: expected {expected}"
    return None


def check_dir(d: str, expected_key: str | None = None, load: bool = False) -> Problem | None:
    """Why the entry at ``d`` is not usable, or None. The one check: the
    runtime, ``flintgen cache verify`` and bundle unpacking all use it."""
    meta = read_meta_file(d)
    if meta is None:
        return Problem("missing or unreadable meta.json (not a JSON object)")
    if meta.get("meta_version") != META_VERSION:
        return _other_toolchain(f"written by flintgen {meta.get('flintgen')} (meta version "
                                f"{meta.get('meta_version')}; this flintgen {__version__} writes {META_VERSION})")
    problem = check_place(d, meta)
    if problem:
        return Problem(problem)
    key = meta["key"]
    material = meta.get("key_material")
    if not isinstance(material, dict) or key_of(material) != key:
        return Problem("meta.json's key_material does not hash to its key")
    if expected_key is not None and key != expected_key:
        return Problem("meta.json does not match this key")
    if meta.get("function") != f"{meta.get('kernel')}_{key[:12]}" or meta.get("kernel") != material.get("kernel"):
        return Problem("meta.json's kernel or function name does not match its key")
    files = meta.get("files")
    if not isinstance(files, dict):
        return Problem("meta.json records no file hashes")
    for name in HASHED_FILES:
        try:
            if _sha256_file(os.path.join(d, name)) != files.get(name):
                return Problem(f"{name} does not match its recorded sha256")
        except OSError:
            return Problem(f"{name} missing")
    if files.get("module.py") != material.get("source_sha256"):
        return Problem("module.py is not the source the key was computed from")
    ident = toolchain.dsl_identity()
    if ident is not None and ident != meta.get("dsl"):
        return _other_toolchain(f"built with DSL {meta.get('dsl')}, installed {ident}")
    if load:
        try:
            load_library(os.path.join(d, "kernel.so"), meta["function"])
        except Exception as e:  # noqa: BLE001
            return Problem(f"does not load: {e}")
    return None


def check_entry(entry: Entry) -> Problem | None:
    """Why ``entry`` is not usable, or None when it is (no loading)."""
    return check_dir(entry.dir, expected_key=entry.key)


def load_library(so_path: str, function_name: str):
    toolchain.load_runtime()
    import tvm_ffi

    module = tvm_ffi.load_module(so_path)
    fn = module[function_name]
    _LOADED_MODULES.append(module)  # keep the library mapped for the process lifetime
    return fn


_LOADED_MODULES: list = []


def try_load(entry: Entry):
    """The cached kernel, or None (never raises for a bad entry)."""
    if check_entry(entry) is not None:
        return None
    try:
        return load_library(entry.path("kernel.so"), entry.function_name)
    except Exception:  # noqa: BLE001 - an unloadable library is a miss
        return None


# ------------------------------------------------------------------ building
def _check_resources(entry: Entry, resources_: dict) -> None:
    spills = (resources_.get("spill_store_bytes") or 0) + (resources_.get("spill_load_bytes") or 0)
    if spills or resources_.get("stack_bytes") or resources_.get("local_memory"):
        raise KernelResourceError(
            f"kernel {entry.variant.name} spills or uses local memory (ptxas: "
            f"{resources_.get('registers')} registers, {resources_.get('spill_store_bytes')} bytes spill stores, "
            f"{resources_.get('spill_load_bytes')} bytes spill loads, {resources_.get('stack_bytes')} bytes "
            "stack): refused and not cached; this shape needs another launch configuration (please report it)")


def _write_entry(entry: Entry, module_path: str, work: str) -> dict:
    """Compile the generated module at ``module_path``; export and link into
    ``work``. Returns the meta dict. Raises KernelResourceError for a kernel
    that spills."""
    from flintgen import compiler

    result = compiler.compile_module(module_path, entry.module_name, entry.function_name,
                                     entry.target, work)
    _check_resources(entry, result.resources)
    compiler.link_shared(result.object_path, os.path.join(work, "kernel.so"))
    with open(os.path.join(work, "kernel.ptx"), "w") as f:
        f.write(result.ptx)
    files = {"module.py": _sha256_file(module_path)}
    files.update({n: _sha256_file(os.path.join(work, n)) for n in ("kernel.so", "kernel.ptx")})
    return {
        "meta_version": META_VERSION,
        "key": entry.key,
        "kernel": entry.variant.kernel,
        "variant": entry.variant.name,
        "params": dict(entry.variant.params),
        "template": entry.template,
        "target": entry.target.to_json(),
        "function": entry.function_name,
        "key_material": key_material(entry.variant, entry.source, entry.target),
        "dsl": toolchain.dsl_identity(),
        "dsl_distributions": dict(toolchain.dsl_versions()),
        "tvm_ffi": toolchain.package_version("apache-tvm-ffi"),
        "flintgen": __version__,
        "built_with_python": sys.version.split()[0],
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "resources": result.resources,
        "files": files,
    }


def _require_compiler(entry: Entry) -> None:
    if knobs.no_jit:
        raise MissingKernelError(
            f"kernel {entry.variant.name} (key {entry.key[:16]}) is not in the cache at "
            f"{entry.root} and FLINTGEN_NO_JIT=1: build it with `flintgen build` or unset FLINTGEN_NO_JIT"
        )
    if not toolchain.dsl_installed():
        raise MissingKernelError(
            f"kernel {entry.variant.name} (key {entry.key[:16]}) is not in the cache at {entry.root} "
            "and the CuTe DSL is not installed here to compile it: install nvidia-cutlass-dsl[cu13], "
            "or carry a cache built with `flintgen build --arch sm_90a --num-sms N` and point "
            "FLINTGEN_CACHE_DIR at it"
        )


def _mark_root(root: str) -> None:
    tag = os.path.join(root, CACHEDIR_TAG)
    if not os.path.isfile(tag):
        _atomic_write(tag, _TAG_TEXT.encode())


def build(entry: Entry) -> None:
    """Write the generated module into the entry (atomically) and compile it
    from there; publish the library and PTX with ``os.replace``, meta.json
    last. Call with the entry's lock held. Raises if no kernel can be built."""
    _require_compiler(entry)
    os.makedirs(entry.dir, exist_ok=True)
    _mark_root(entry.root)
    with_suppress(os.unlink, entry.path("meta.json"))  # invalidate first
    _atomic_write(entry.path("module.py"), entry.source.encode())
    work = tempfile.mkdtemp(prefix=".build-", dir=entry.dir)
    try:
        meta = _write_entry(entry, entry.path("module.py"), work)
        for name in ("kernel.ptx", "kernel.so"):
            os.replace(os.path.join(work, name), entry.path(name))
        _atomic_write(entry.path("meta.json"), json.dumps(meta, indent=1, sort_keys=True).encode())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _owner(path: str) -> str:
    try:
        with open(path + ".owner") as f:
            o = json.load(f)
        return f"process {o['pid']} on {o['host']} (since {o['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


class _EntryLock:
    """The entry's file lock; says who holds it while waiting, and records
    this process as the holder."""

    def __init__(self, entry_dir: str, what: str, timeout: float | None = None):
        self.path = lock_path(entry_dir)
        self.what = what
        self.timeout = knobs.lock_timeout if timeout is None else timeout
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._lock = filelock.FileLock(self.path)

    def acquire(self) -> None:
        try:
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            if self.timeout <= 0:
                raise
            warnings.warn(f"waiting up to {self.timeout:g} s (FLINTGEN_LOCK_TIMEOUT) for {_owner(self.path)}, "
                          f"which holds the lock {self.path} of {self.what}", CacheWarning, stacklevel=4)
            self._lock.acquire(timeout=self.timeout)
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "since": datetime.datetime.now().isoformat(timespec="seconds")}
        with_suppress(_atomic_write, self.path + ".owner", json.dumps(owner).encode())

    def release(self) -> None:
        with_suppress(os.unlink, self.path + ".owner")
        self._lock.release()


def _build_uncached(entry: Entry):
    """Cache unusable: build in a private temp dir, load from there, remove it
    (the loaded library stays mapped)."""
    _require_compiler(entry)
    work = tempfile.mkdtemp(prefix="flintgen-nocache-")
    try:
        module_path = os.path.join(work, "module.py")
        with open(module_path, "w") as f:
            f.write(entry.source)
        _write_entry(entry, module_path, work)
        return load_library(os.path.join(work, "kernel.so"), entry.function_name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class Outcome:
    hit: bool
    function: object


def _unusable(entry: Entry, why: str, fix: str, fallback: bool) -> Outcome:
    if not fallback:
        raise CacheUnusableError(f"cannot cache kernel {entry.variant.name} at {entry.root}: {why}; {fix}")
    warnings.warn(f"flintgen cache at {entry.root} cannot take kernel {entry.variant.name} ({why}); compiling "
                  f"it without caching. {fix[0].upper() + fix[1:]}.", CacheWarning, stacklevel=4)
    return Outcome(False, _build_uncached(entry))


_WRITABLE_FIX = "point --cache-dir or FLINTGEN_CACHE_DIR at a writable directory with free space"


def get_or_build(entry: Entry, fallback: bool = True) -> Outcome:
    """Check, lock, check, build. Exactly one process compiles a key.

    ``fallback``: when the cache cannot take the kernel (unwritable, full, a
    lock held past FLINTGEN_LOCK_TIMEOUT), warn and build uncached; when
    False raise ``CacheUnusableError`` (``flintgen build`` fills the cache)."""
    fn = try_load(entry)
    if fn is not None:
        return Outcome(True, fn)
    try:
        lock = _EntryLock(entry.dir, f"kernel {entry.variant.name}")
        lock.acquire()
    except filelock.Timeout:
        return _unusable(entry, f"{_owner(lock_path(entry.dir))} held its lock {lock_path(entry.dir)} longer "
                         f"than FLINTGEN_LOCK_TIMEOUT={knobs.lock_timeout:g} s",
                         "wait for that build to finish or stop it, or raise FLINTGEN_LOCK_TIMEOUT", fallback)
    except OSError as e:
        return _unusable(entry, f"cannot create its lock: {e.strerror or e}", _WRITABLE_FIX, fallback)
    try:
        fn = try_load(entry)
        if fn is not None:
            return Outcome(True, fn)
        try:
            build(entry)
        except OSError as e:
            return _unusable(entry, f"cannot write the entry: {e.strerror or e}", _WRITABLE_FIX, fallback)
        fn = try_load(entry)
        if fn is None:
            raise RuntimeError(f"kernel {entry.variant.name} was built at {entry.dir} but does not load: "
                               f"{check_entry(entry) or 'tvm_ffi.load_module failed'}")
        return Outcome(False, fn)
    finally:
        lock.release()


def check_root_usable(root: str) -> None:
    """Raise ValueError unless ``root`` can hold cache entries (``flintgen build``
    checks this before compiling anything)."""
    try:
        os.makedirs(root, exist_ok=True)
        _mark_root(root)
    except OSError as e:
        raise ValueError(f"cache root {root} is not usable ({e.strerror or e}): {_WRITABLE_FIX}") from None


# ------------------------------------------------------------------ inspection
def _is_work_file(name: str) -> bool:
    """A file a writer leaves only when killed (or bytecode an old flintgen let Python write)."""
    return name.startswith(WORK_PREFIXES) or name == "__pycache__"


def _known_contents(d: str) -> bool:
    try:
        names = os.listdir(d)
    except OSError:
        return False
    return all(n in ENTRY_FILES or _is_work_file(n) for n in names)


def entry_dirs(root: str) -> list[str]:
    """The directories under ``root`` that are provably flintgen entries: laid
    out as ``<arch>-<n>sm/<variant>-<key16>``, real directories (not links)
    holding only entry files and work files. Whether one is usable is
    ``check_dir``'s question."""
    out = []
    try:
        targets = sorted(os.listdir(root))
    except OSError:
        return out
    for tdir in targets:
        tp = os.path.join(root, tdir)
        if not TARGET_DIR.match(tdir) or os.path.islink(tp) or not os.path.isdir(tp):
            continue
        for e in sorted(os.listdir(tp)):
            d = os.path.join(tp, e)
            if not ENTRY_DIR.match(e) or os.path.islink(d) or not os.path.isdir(d) or not _known_contents(d):
                continue
            out.append(d)
    return out


def is_cache_root(root: str) -> bool:
    """A directory flintgen wrote: it has CACHEDIR.TAG, or (caches from before
    the tag) a ``locks/`` directory beside provable entries."""
    try:
        with open(os.path.join(root, CACHEDIR_TAG)) as f:
            if f.read(43) == _TAG_TEXT[:43]:
                return True
    except OSError:
        pass
    return os.path.isdir(os.path.join(root, "locks")) and bool(entry_dirs(root))


def list_entries(root: str | None = None) -> list[tuple[str, dict | None]]:
    """(entry dir, meta or None) for every provable entry under ``root``."""
    return [(d, read_meta_file(d)) for d in entry_dirs(root or default_root())]


def work_files(d: str) -> list[str]:
    """Leftover work files of a killed writer inside entry ``d``."""
    try:
        return sorted(os.path.join(d, n) for n in os.listdir(d) if _is_work_file(n))
    except OSError:
        return []


def tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


@dataclass
class CleanReport:
    removed: int = 0                 # entries removed
    work_removed: int = 0            # leftover work files removed from kept entries
    bytes_freed: int = 0
    kept: int = 0
    busy: list[str] = field(default_factory=list)                       # locked by a build: skipped
    failed: list[tuple[str, str]] = field(default_factory=list)         # (path, why)


def _remove(path: str, report: CleanReport) -> bool:
    size = tree_bytes(path) if os.path.isdir(path) else os.lstat(path).st_size
    errors: list[str] = []
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, onerror=lambda fn, p, exc: errors.append(f"{p}: {exc[1]}"))
    else:
        try:
            os.unlink(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    if os.path.lexists(path):
        report.failed.append((path, errors[0] if errors else "still present"))
        return False
    report.bytes_freed += size
    return True


def clean(root: str | None = None, *, stale: bool = False, other_toolchains: bool = False,
          lock_timeout: float = 10.0) -> CleanReport:
    """Remove cache entries under ``root``: every entry, or with ``stale`` only
    unusable ones (damaged, partial) and leftover work files, plus with
    ``other_toolchains`` entries of another DSL or flintgen version. Each
    entry is removed under its lock (a build in progress is skipped, reported
    busy). Refuses a root that is not a flintgen cache."""
    root = os.path.abspath(root or default_root())
    report = CleanReport()
    if not os.path.isdir(root) or not os.listdir(root):
        return report
    if not is_cache_root(root):
        raise ValueError(f"{root} is not a flintgen cache (no {CACHEDIR_TAG}, no flintgen entries): nothing "
                         "removed. Pass the cache root that `flintgen env` shows, or --cache-dir of a cache")
    for d in entry_dirs(root):
        lock = _EntryLock(d, f"entry {os.path.basename(d)}", timeout=lock_timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            report.busy.append(d)
            continue
        except OSError as e:
            report.failed.append((d, f"cannot take its lock: {e.strerror or e}"))
            continue
        try:
            problem = check_dir(d) if stale else None
            keep = stale and (problem is None or (problem.other_toolchain and not other_toolchains))
            if keep:
                report.kept += 1
                for w in work_files(d):
                    report.work_removed += _remove(w, report)
            elif _remove(d, report):
                report.removed += 1
        finally:
            lock.release()
    return report
