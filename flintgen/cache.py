"""The on-disk kernel cache.

Layout (one directory per kernel identity)::

    <root>/<arch>-<num_sms>sm/<variant name>-<key16>/
        module.py    the generated CuTe DSL source (imported from here to compile)
        kernel.so    the exported kernel (TVM-FFI), loaded without cutlass
        kernel.ptx   the PTX, kept for inspection and CI checks
        meta.json    written last: the commit marker

The key hashes the kernel's identity: kernel name and compile-time parameters,
the rendered source, flintgen's device-helper modules (and flintgen/layout.py,
which they read), the target (arch, SM count), the compile options and the
DSL's compile-affecting environment. Not the Python version, so a cache built
under 3.11 serves 3.12.

The DSL version is checked, not keyed: where the DSL is installed, an entry
built by another DSL version is a miss and is rebuilt in place; where only the
runtime and tvm-ffi are installed (a serving machine), any entry whose library
loads is used.

Lifecycle (FlashInfer's JitSpec contract): ``try_load`` never raises for a
missing, partial, stale or corrupt entry, it returns None; ``build`` raises
only when no usable kernel can result. ``get_or_build`` = check, lock, check,
build. An unwritable cache still yields a working kernel, with a warning.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass

import filelock

from flintgen import codegen, toolchain
from flintgen._version import __version__
from flintgen.kernels.base import Target, Variant
from flintgen.knobs import compile_env, knobs

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
META_VERSION = 1


class MissingKernelError(RuntimeError):
    """FLINTGEN_NO_JIT=1 and the kernel is not in the cache."""


class CacheWarning(UserWarning):
    pass


def default_root() -> str:
    """FLINTGEN_CACHE_DIR, else ``cache/`` of the source checkout flintgen runs
    from, else ``$XDG_CACHE_HOME/flintgen`` (``~/.cache/flintgen``)."""
    if knobs.cache_dir:
        return os.path.abspath(knobs.cache_dir)
    checkout = os.path.dirname(_PKG_DIR)
    if os.path.isfile(os.path.join(checkout, "pyproject.toml")) and os.path.isdir(
        os.path.join(checkout, "templates")
    ):
        return os.path.join(checkout, "cache")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "flintgen")


_DEVICE_IMPORT = re.compile(r"^\s*(?:from\s+flintgen\.device(?:\.(\w+))?\s+import\s+([\w, ]+)|"
                            r"import\s+flintgen\.device\.(\w+))", re.M)
# flintgen/layout.py (cute-free layout numbers) is read by device helpers too:
# it is a helper dependency under this name (no device module can be named so).
LAYOUT_DEP = "flintgen.layout"
_LAYOUT_IMPORT = re.compile(r"^\s*(?:from\s+flintgen\.layout\s+import|import\s+flintgen\.layout\b|"
                            r"from\s+flintgen\s+import\s+(?:[\w, ]+,\s*)?layout\b)", re.M)


def _device_deps(source: str) -> set[str]:
    """Names of the flintgen.device modules ``source`` imports (and
    LAYOUT_DEP when it imports flintgen.layout)."""
    deps = set()
    for mod, names, plain in _DEVICE_IMPORT.findall(source):
        if mod or plain:
            deps.add(mod or plain)
        else:  # from flintgen.device import a, b
            deps.update(n.strip() for n in names.split(",") if n.strip())
    if _LAYOUT_IMPORT.search(source):
        deps.add(LAYOUT_DEP)
    return deps


def _device_file(name: str) -> bytes:
    if name == LAYOUT_DEP:
        path = os.path.join(_PKG_DIR, "layout.py")
    else:
        path = os.path.join(_PKG_DIR, "device", f"{name}.py")
    with open(path, "rb") as f:
        return f.read()


def helpers_hash(source: str) -> str:
    """sha256 over the flintgen.device modules (and flintgen/layout.py) the
    generated ``source`` imports, transitively: editing a helper rebuilds
    exactly the kernels that use it."""
    seen: set[str] = set()
    todo = sorted(_device_deps(source))
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += sorted(_device_deps(_device_file(name).decode()) - seen)
        except OSError:
            raise ValueError(f"generated source imports flintgen.device.{name}, which does not exist") from None
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(name.encode() + b"\0" + _device_file(name))
    return h.hexdigest()


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
    def dir(self) -> str:
        return os.path.join(self.root, f"{self.target.arch}-{self.target.num_sms}sm",
                            f"{self.variant.name}-{self.key[:16]}")

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
        "arch": target.arch,
        "num_sms": target.num_sms,
        "options": compile_options(target),
        "env": compile_env(),
    }


def make_entry(variant: Variant, template: str, params: dict, target: Target,
               root: str | None = None) -> Entry:
    source = codegen.render(variant.kernel, template, params)
    material = key_material(variant, source, target)
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return Entry(variant, template, source, target, key, root or default_root())


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


def read_meta(entry: Entry) -> dict | None:
    try:
        with open(entry.path("meta.json")) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def check_entry(entry: Entry) -> str | None:
    """Why ``entry`` is not usable, or None when it is (cheap: no loading)."""
    meta = read_meta(entry)
    if meta is None:
        return "missing or unreadable meta.json"
    if meta.get("meta_version") != META_VERSION or meta.get("key") != entry.key:
        return "meta.json does not match this key"
    ident = toolchain.dsl_identity()
    if ident is not None and ident != meta.get("dsl"):
        return f"built with DSL {meta.get('dsl')}, installed {ident}"
    so = entry.path("kernel.so")
    try:
        if _sha256_file(so) != meta.get("so_sha256"):
            return "kernel.so does not match its recorded sha256"
    except OSError:
        return "kernel.so missing"
    return None


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


def _write_entry(entry: Entry, module_path: str, work: str) -> dict:
    """Compile the generated module at ``module_path``; export and link into
    ``work``. Returns the meta dict."""
    from flintgen import compiler

    result = compiler.compile_module(module_path, entry.module_name, entry.function_name,
                                     entry.target, work)
    compiler.link_shared(result.object_path, os.path.join(work, "kernel.so"))
    with open(os.path.join(work, "kernel.ptx"), "w") as f:
        f.write(result.ptx)
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
        "so_sha256": _sha256_file(os.path.join(work, "kernel.so")),
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


def build(entry: Entry) -> None:
    """Write the generated module into the entry (atomically) and compile it
    from there; publish the library and PTX with ``os.replace``, meta.json
    last. Call with the entry's lock held. Raises if no kernel can be built."""
    _require_compiler(entry)
    os.makedirs(entry.dir, exist_ok=True)
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


def _lock(entry: Entry) -> filelock.FileLock:
    locks = os.path.join(entry.root, "locks")
    os.makedirs(locks, exist_ok=True)
    return filelock.FileLock(os.path.join(locks, f"{entry.key[:32]}.lock"), timeout=knobs.lock_timeout)


def _build_uncached(entry: Entry):
    """Cache unusable: build in a private temp dir and load from there."""
    _require_compiler(entry)
    work = tempfile.mkdtemp(prefix="flintgen-nocache-")
    module_path = os.path.join(work, "module.py")
    with open(module_path, "w") as f:
        f.write(entry.source)
    _write_entry(entry, module_path, work)
    return load_library(os.path.join(work, "kernel.so"), entry.function_name)


@dataclass
class Outcome:
    hit: bool
    function: object


def get_or_build(entry: Entry) -> Outcome:
    """Check, lock, check, build. Exactly one process compiles a key."""
    fn = try_load(entry)
    if fn is not None:
        return Outcome(True, fn)
    try:
        lock = _lock(entry)
        lock.acquire()
    except (OSError, filelock.Timeout) as e:
        warnings.warn(
            f"flintgen cache at {entry.root} is not usable ({e}); compiling {entry.variant.name} "
            "without caching it. Set FLINTGEN_CACHE_DIR to a writable directory.",
            CacheWarning, stacklevel=3,
        )
        return Outcome(False, _build_uncached(entry))
    try:
        fn = try_load(entry)
        if fn is not None:
            return Outcome(True, fn)
        try:
            build(entry)
        except OSError as e:
            warnings.warn(
                f"cannot write kernel {entry.variant.name} to the flintgen cache at {entry.root} "
                f"({e}); using an uncached build. Set FLINTGEN_CACHE_DIR to a writable directory.",
                CacheWarning, stacklevel=3,
            )
            return Outcome(False, _build_uncached(entry))
        fn = try_load(entry)
        if fn is None:
            raise RuntimeError(f"kernel {entry.variant.name} was built at {entry.dir} but does not load: "
                               f"{check_entry(entry) or 'tvm_ffi.load_module failed'}")
        return Outcome(False, fn)
    finally:
        lock.release()


# ------------------------------------------------------------------ inspection
def list_entries(root: str | None = None) -> list[tuple[str, dict | None]]:
    root = root or default_root()
    out = []
    if not os.path.isdir(root):
        return out
    for tdir in sorted(os.listdir(root)):
        p = os.path.join(root, tdir)
        if tdir == "locks" or not os.path.isdir(p):
            continue
        for e in sorted(os.listdir(p)):
            d = os.path.join(p, e)
            if not os.path.isdir(d):
                continue
            try:
                with open(os.path.join(d, "meta.json")) as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                meta = None
            out.append((d, meta))
    return out


def verify_dir(d: str, meta: dict | None, load: bool = True) -> str | None:
    """Problem with the entry at ``d``, or None."""
    if meta is None:
        return "missing or unreadable meta.json"
    so = os.path.join(d, "kernel.so")
    try:
        if _sha256_file(so) != meta.get("so_sha256"):
            return "kernel.so does not match its recorded sha256"
    except OSError:
        return "kernel.so missing"
    ident = toolchain.dsl_identity()
    if ident is not None and ident != meta.get("dsl"):
        return f"stale: built with DSL {meta.get('dsl')}, installed {ident}"
    if load:
        try:
            load_library(so, meta["function"])
        except Exception as e:  # noqa: BLE001
            return f"does not load: {e}"
    return None


def clean(root: str | None = None) -> int:
    root = root or default_root()
    n = 0
    for d, _ in list_entries(root):
        shutil.rmtree(d, ignore_errors=True)
        n += 1
    return n
