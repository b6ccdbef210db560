"""Compile a generated kernel module and export it as a shared library.

This is the only module that imports cutlass (lazily): loading a cached kernel
needs just tvm-ffi and the DSL runtime library.

Pipeline: import the generated file (the DSL needs real source files) ->
``compile_args()`` -> ``cute.compile`` for the target arch with TVM-FFI calling
convention -> ``export_to_c`` (object file with the embedded cubin) -> link
``kernel.so`` against ``libcute_dsl_runtime`` and ``libtvm_ffi``.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import io
import os
import re
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass

from flintgen import toolchain
from flintgen.kernels.base import Target


def compile_options(target: Target) -> str:
    """Options that reach the binary (part of every cache key). ``remarks{ptx}``
    only makes ptxas print its resource report, which we keep."""
    return f"--enable-tvm-ffi --gpu-arch {target.arch} remarks{{ptx}}"


@dataclass
class CompileResult:
    function: object          # the in-memory compiled function (TVM-FFI callable)
    ptx: str
    resources: dict           # ptxas report: registers, stack, spills
    object_path: str


_PTXAS = {
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_store_bytes": re.compile(r"(\d+) bytes spill stores"),
    "spill_load_bytes": re.compile(r"(\d+) bytes spill loads"),
    "registers": re.compile(r"Used (\d+) registers"),
}


def parse_ptxas_report(text: str) -> dict:
    """Max over the module's kernels of each ptxas figure; ``None`` if absent."""
    out = {}
    for key, rx in _PTXAS.items():
        vals = [int(v) for v in rx.findall(text)]
        out[key] = max(vals) if vals else None
    return out


@contextlib.contextmanager
def _capture_fds():
    """Capture everything written to fds 1 and 2 and to sys.stdout/sys.stderr
    (the DSL prints ptxas remarks from Python; native code writes to the fds)."""
    sys.stdout.flush()
    sys.stderr.flush()
    py = io.StringIO()
    with tempfile.TemporaryFile(mode="w+b") as tmp, contextlib.redirect_stdout(py), \
            contextlib.redirect_stderr(py):
        saved = os.dup(1), os.dup(2)
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        box = {}
        try:
            yield box
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            tmp.seek(0)
            box["text"] = tmp.read().decode(errors="replace") + py.getvalue()


def import_file(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in cache entries
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = saved
    return module


def compile_module(module_path: str, module_name: str, function_name: str,
                   target: Target, work_dir: str) -> CompileResult:
    """Compile ``module_path`` and write ``work_dir/kernel.o``."""
    import cutlass.cute as cute

    module = import_file(module_path, module_name)
    kernel, args = module.compile_args()
    dump = tempfile.mkdtemp(prefix="dump-", dir=work_dir)
    options = compile_options(target) + f" --keep-ptx --dump-dir {dump}"
    # ptxas remarks arrive as Python warnings (DSLWarning) or on the fds.
    try:
        with _capture_fds() as cap, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn = cute.compile(kernel, *args, options=options)
    except OSError:
        raise  # a full or unwritable work dir: the cache's problem, not the kernel's
    except Exception as e:
        _raise_if_disk_full(f"{e}\n{cap.get('text', '')}", module_path)
        raise RuntimeError(
            f"compiling {module_path} failed: {e}\n--- compiler output ---\n{cap.get('text', '')}"
        ) from e
    text = cap.get("text", "") + "\n".join(str(w.message) for w in caught)
    ptx = fn.__ptx__ or ""
    obj = os.path.join(work_dir, "kernel.o")
    try:
        fn.export_to_c(obj, function_name)
    except OSError:
        raise
    except Exception as e:
        _raise_if_disk_full(str(e), obj)
        raise
    report = parse_ptxas_report(text)
    report["local_memory"] = "ld.local" in ptx or "st.local" in ptx
    return CompileResult(fn, ptx, report, obj)


def _raise_if_disk_full(text: str, path: str) -> None:
    """Tools report a full disk as text; make it the OSError the cache falls back on."""
    if "No space left on device" in text or "Disk quota exceeded" in text:
        raise OSError(errno.ENOSPC, f"no space left writing {path}", path)


def link_shared(obj: str, so_path: str) -> None:
    """Link an exported object into a shared library loadable by tvm_ffi."""
    cxx = toolchain.find_linker()
    if cxx is None:
        raise RuntimeError("no C++ linker (g++/c++/clang++) found to link exported kernels")
    rt = toolchain.find_runtime_lib()
    if rt is None:
        raise RuntimeError("libcute_dsl_runtime.so not found (set FLINTGEN_RUNTIME_LIB)")
    import tvm_ffi.libinfo

    tvm_dir = os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())
    cmd = [cxx, "-shared", "-o", so_path, obj, f"-L{os.path.dirname(rt)}", f"-L{tvm_dir}",
           "-lcute_dsl_runtime", "-ltvm_ffi"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        _raise_if_disk_full(proc.stderr, so_path)
        raise RuntimeError(f"linking {obj} failed ({' '.join(cmd)}):\n{proc.stderr}")
