"""Every environment variable flintgen reads, declared once and typed.

Read through the module-level ``knobs`` object (values are read at access time,
so tests may set them with ``monkeypatch.setenv``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _bool(name: str) -> bool:
    v = os.environ.get(name, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {name}={v!r} is not a boolean: use 1 or 0")


def _str(name: str) -> str | None:
    v = os.environ.get(name)
    return v if v else None


@dataclass(frozen=True)
class _Knob:
    name: str
    doc: str


KNOBS = (
    _Knob("FLINTGEN_CACHE_DIR", "Cache root. Default: <checkout>/cache from a source checkout, else the user cache dir."),
    _Knob("FLINTGEN_CHECK_INPUTS", "1: sync and check device-side contracts (block tables, positions) before each launch."),
    _Knob("FLINTGEN_NO_JIT", "1: never compile at run time; a cache miss raises MissingKernelError."),
    _Knob("FLINTGEN_ARCH", "Target arch when no GPU is visible (e.g. sm_90a); the CLI's --arch wins."),
    _Knob("FLINTGEN_NUM_SMS", "SM count when no GPU is visible (e.g. 132); the CLI's --num-sms wins."),
    _Knob("FLINTGEN_RUNTIME_LIB", "Path of libcute_dsl_runtime.so, if not found next to the installed DSL."),
    _Knob("FLINTGEN_LOCK_TIMEOUT", "Seconds to wait for another process building the same kernel (default 600)."),
)


class _Knobs:
    @property
    def cache_dir(self) -> str | None:
        return _str("FLINTGEN_CACHE_DIR")

    @property
    def check_inputs(self) -> bool:
        return _bool("FLINTGEN_CHECK_INPUTS")

    @property
    def no_jit(self) -> bool:
        return _bool("FLINTGEN_NO_JIT")

    @property
    def arch(self) -> str | None:
        return _str("FLINTGEN_ARCH")

    @property
    def num_sms(self) -> int | None:
        v = _str("FLINTGEN_NUM_SMS")
        if v is None:
            return None
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"FLINTGEN_NUM_SMS={v!r} is not an integer (e.g. 132)") from None

    @property
    def runtime_lib(self) -> str | None:
        return _str("FLINTGEN_RUNTIME_LIB")

    @property
    def lock_timeout(self) -> float:
        v = _str("FLINTGEN_LOCK_TIMEOUT")
        return float(v) if v else 600.0


knobs = _Knobs()

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
