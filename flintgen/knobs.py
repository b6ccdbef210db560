"""Every environment variable flintgen reads, declared once and typed.

Read through the module-level ``knobs`` object. Values are read and checked at
access time (so tests may set them with ``monkeypatch.setenv``); a bad value
raises a ``ValueError`` naming the variable, the value, what is accepted and
the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MAX_NUM_SMS = 512     # H100 SXM / H200: 132; no GPU flintgen targets has more than a few hundred
MAX_LOCK_TIMEOUT = 7 * 24 * 3600.0


def _raw(name: str) -> str | None:
    v = os.environ.get(name, "").strip()
    return v or None


def _bool(name: str) -> bool:
    v = (_raw(name) or "").lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {name}={os.environ[name]!r} is not a boolean: "
                     f"set {name}=1 or {name}=0 (or unset it)")


def _ranged(name: str, conv, lo, hi, what: str, example):
    """``conv`` of the variable's value when it lies in ``lo..hi`` (NaN and inf
    do not), None when unset; ValueError naming the variable otherwise."""
    v = _raw(name)
    if v is None:
        return None
    try:
        x = conv(v)
    except ValueError:
        x = None
    if x is None or not lo <= x <= hi:
        raise ValueError(f"environment variable {name}={v!r} is not {what} in {lo:g}..{hi:g}: "
                         f"set e.g. {name}={example:g} (or unset it)")
    return x


@dataclass(frozen=True)
class _Knob:
    name: str
    doc: str


KNOBS = (
    _Knob("FLINTGEN_CACHE_DIR", "Cache root. Default: <checkout>/cache from a source checkout, else the user cache dir."),
    _Knob("FLINTGEN_CHECK_INPUTS", "1: sync and check device-side contracts (block tables, positions, fp8 k/v scales) before each launch."),
    _Knob("FLINTGEN_NO_JIT", "1: never compile at run time; a cache miss raises MissingKernelError."),
    _Knob("FLINTGEN_ARCH", "Target arch when no GPU is visible (e.g. sm_90a); the CLI's --arch wins."),
    _Knob("FLINTGEN_NUM_SMS", f"SM count when no GPU is visible (1..{MAX_NUM_SMS}, e.g. 132); the CLI's --num-sms wins."),
    _Knob("FLINTGEN_RUNTIME_LIB", "Path of libcute_dsl_runtime.so, if not found next to the installed DSL."),
    _Knob("FLINTGEN_LOCK_TIMEOUT", "Seconds to wait for another process building the same kernel (default 600)."),
    _Knob("FLINTGEN_DEBUG", "1: the command line prints Python tracebacks (same as --debug)."),
)


class _Knobs:
    @property
    def cache_dir(self) -> str | None:
        return _raw("FLINTGEN_CACHE_DIR")

    @property
    def check_inputs(self) -> bool:
        return _bool("FLINTGEN_CHECK_INPUTS")

    @property
    def no_jit(self) -> bool:
        return _bool("FLINTGEN_NO_JIT")

    @property
    def debug(self) -> bool:
        return _bool("FLINTGEN_DEBUG")

    @property
    def arch(self) -> str | None:
        return _raw("FLINTGEN_ARCH")

    @property
    def num_sms(self) -> int | None:
        return _ranged("FLINTGEN_NUM_SMS", int, 1, MAX_NUM_SMS, "an integer", 132)

    @property
    def runtime_lib(self) -> str | None:
        v = _raw("FLINTGEN_RUNTIME_LIB")
        if v is not None and not os.path.isfile(v):
            raise ValueError(f"environment variable FLINTGEN_RUNTIME_LIB={v!r} is not a file: point it at "
                             "libcute_dsl_runtime.so (it ships in nvidia-cutlass-dsl-libs-cu13) or unset it")
        return v

    @property
    def lock_timeout(self) -> float:
        t = _ranged("FLINTGEN_LOCK_TIMEOUT", float, 0, MAX_LOCK_TIMEOUT, "a number of seconds", 600)
        return 600.0 if t is None else t


knobs = _Knobs()


def check_all() -> None:
    """Read every knob once: a bad value raises its ValueError now."""
    for attr in ("cache_dir", "check_inputs", "no_jit", "debug", "arch", "num_sms", "runtime_lib",
                 "lock_timeout"):
        getattr(knobs, attr)


# CuTe DSL variables that change the generated binary (``affects_compile=True``
# in cutlass/base_dsl/env_manager.py, 4.8.1). Their values enter every cache key.
CUTE_DSL_COMPILE_ENV = (
    "CUTE_DSL_ARCH", "CUTE_DSL_DEBUG", "CUTE_DSL_ENABLE_PYIR", "CUTE_DSL_AUTO_M2S",
    "CUTE_DSL_TOLERATE_M2M", "CUTE_DSL_LINEINFO", "CUTE_DSL_DRYRUN", "CUTE_DSL_WARNINGS_AS_ERRORS",
    "CUTE_DSL_COMPILER_OPT", "CUTE_DSL_COMPILER_BACKEND", "CUTE_DSL_LIBS", "CUTE_DSL_ENABLE_ASSERTIONS",
    "CUTE_DSL_ENABLE_TVM_FFI", "CUTE_DSL_LOC_TRACEBACKS", "CUTE_DSL_USE_EXTENSION_COMPILER",
)


def compile_env() -> dict[str, str]:
    return {k: os.environ[k] for k in CUTE_DSL_COMPILE_ENV if k in os.environ}
