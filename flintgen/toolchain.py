"""The toolchain and target: DSL distributions, runtime library, linker, arch.

Nothing here imports cutlass: a serving machine may have only the DSL runtime
library and tvm-ffi.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata as md
import os
import shutil
import sys

from flintgen.kernels.base import Target
from flintgen.knobs import MAX_NUM_SMS, knobs

SUPPORTED_ARCHS = ("sm_90a",)
DEFAULT_NUM_SMS = 132  # H100 SXM / H200


@functools.lru_cache(maxsize=None)
def dsl_versions() -> tuple[tuple[str, str], ...]:
    """Every installed ``nvidia-cutlass-dsl*`` distribution and its version.

    All of them, because cu12 and cu13 flavours compile different binaries
    (as FlashInfer's cute_dsl_core does). Empty where the DSL is not installed.
    """
    found = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("nvidia-cutlass-dsl"):
            found[name] = dist.version
    return tuple(sorted(found.items()))


def dsl_installed() -> bool:
    return any(n == "nvidia-cutlass-dsl" for n, _ in dsl_versions())


def dsl_flavour() -> str:
    """CUDA flavour the DSL compiles with here: the newest installed libs (cu13
    when present: CUDA 13.x ptxas, whose sm_90a SASS the H200's CUDA 13.0
    driver runs without JIT)."""
    names = dict(dsl_versions())
    return "cu13" if "nvidia-cutlass-dsl-libs-cu13" in names else "cu12"


def dsl_identity() -> dict[str, str] | None:
    """What makes a DSL build distinct: its version, the CUDA flavour it
    compiles with and that flavour's library version. None without the DSL.
    (Other installed flavours do not change the binary, so a cache built where
    cu12 and cu13 are both installed is current where only cu13 is.)"""
    if not dsl_installed():
        return None
    names = dict(dsl_versions())
    flavour = dsl_flavour()
    return {"nvidia-cutlass-dsl": names["nvidia-cutlass-dsl"], "flavour": flavour,
            "libs": names.get(f"nvidia-cutlass-dsl-libs-{flavour}", "")}


def package_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def find_runtime_lib() -> str | None:
    """Path of ``libcute_dsl_runtime.so``: FLINTGEN_RUNTIME_LIB, else next to the
    DSL packages on sys.path (cu13 first), else LD_LIBRARY_PATH."""
    if knobs.runtime_lib:
        return knobs.runtime_lib
    for flavour in ("cu13", "cu12"):
        for entry in sys.path:
            p = os.path.join(entry or ".", "nvidia_cutlass_dsl", flavour, "lib", "libcute_dsl_runtime.so")
            if os.path.isfile(p):
                return p
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        p = os.path.join(d, "libcute_dsl_runtime.so")
        if d and os.path.isfile(p):
            return p
    return None


@functools.lru_cache(maxsize=None)
def load_runtime() -> None:
    """Load tvm-ffi and the DSL runtime globally so exported kernels resolve
    their ``libtvm_ffi.so`` / ``libcute_dsl_runtime.so`` dependencies."""
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so)

    lib = find_runtime_lib()
    if lib is None:
        raise RuntimeError(
            "libcute_dsl_runtime.so not found: install nvidia-cutlass-dsl (or just its runtime "
            "library) or set FLINTGEN_RUNTIME_LIB to its path"
        )
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def find_linker() -> str | None:
    """The C++ driver used to link exported objects into shared libraries."""
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"target arch {arch!r} is not supported: flintgen builds for {list(SUPPORTED_ARCHS)} "
            "(Hopper: H100/H200). Use --arch sm_90a, or run on a Hopper GPU."
        )
    return arch


def _check_num_sms(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NUM_SMS:
        raise ValueError(f"num_sms = {n!r} is not an SM count in 1..{MAX_NUM_SMS} (an H100 SXM / H200 has "
                         "132): pass --num-sms 132")
    return n


def gpu_target(device_index: int | None = None) -> Target | None:
    """The current GPU's target, or None when no CUDA device is visible."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device() if device_index is None else device_index
    major, minor = torch.cuda.get_device_capability(idx)
    props = torch.cuda.get_device_properties(idx)
    arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"GPU {idx} ({props.name}) is {arch}; flintgen supports {list(SUPPORTED_ARCHS)} only "
            "(Hopper). Run on an H100/H200."
        )
    return Target(arch, props.multi_processor_count)


def resolve_target(arch: str | None = None, num_sms: int | None = None,
                   device_index: int | None = None, *, cpu_default: bool = False) -> Target:
    """Explicit values win; then the visible GPU; then FLINTGEN_ARCH / FLINTGEN_NUM_SMS;
    then, only with ``cpu_default`` (the CLI's build on a machine without a GPU,
    which says so), sm_90a with 132 SMs.

    Never guesses silently: the DSL itself would target sm_100a.
    """
    if arch is not None:
        _check_arch(arch)
    gpu = gpu_target(device_index) if arch is None or num_sms is None else None
    if arch is None and gpu is None and knobs.arch is not None:
        if knobs.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"environment variable FLINTGEN_ARCH={knobs.arch!r} is not a supported arch: "
                             f"flintgen builds for {list(SUPPORTED_ARCHS)}; set FLINTGEN_ARCH=sm_90a or unset it")
        arch = knobs.arch
    arch = arch or (gpu.arch if gpu else None) or ("sm_90a" if cpu_default else None)
    if arch is None:
        raise ValueError(
            "no GPU is visible and no target arch was given: pass --arch sm_90a --num-sms 132 "
            "(or set FLINTGEN_ARCH=sm_90a FLINTGEN_NUM_SMS=132)"
        )
    _check_arch(arch)
    if num_sms is None:
        num_sms = gpu.num_sms if gpu else knobs.num_sms
    if num_sms is None:
        if not cpu_default:
            raise ValueError(
                f"no GPU is visible and no SM count was given for {arch}: pass --num-sms 132 "
                "(H100 SXM / H200) or set FLINTGEN_NUM_SMS"
            )
        num_sms = DEFAULT_NUM_SMS
    return Target(arch, _check_num_sms(num_sms))
