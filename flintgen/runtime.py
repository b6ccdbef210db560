"""Run-time entry points: ``get_kernel`` and ``warmup``.

    ops = flintgen.get_kernel("flint")             # every kernel of the spec
    norm = flintgen.get_kernel(spec, "rms_norm")   # one kernel

Ops are memoized per (spec, target) in the process. Each op loads the binary
of a launch variant the first time that variant is used (from the disk cache,
compiling it first on a miss). A first use inside a CUDA-graph capture raises:
call ``warmup`` before capturing.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from flintgen import cache, toolchain
from flintgen.kernels import KERNELS, get_def
from flintgen.kernels.base import KernelDef, Target, Variant
from flintgen.spec import Spec, as_spec

_lock = threading.RLock()
_ops: dict[tuple, Any] = {}
_functions: dict[tuple[str, str], Any] = {}  # (cache root, key) -> loaded function


class KernelSet:
    """The ops of one spec, by name (attribute or item access)."""

    def __init__(self, spec: Spec, ops: dict[str, Any]):
        self.spec = spec
        self._ops = ops

    def __getitem__(self, name: str):
        try:
            return self._ops[name]
        except KeyError:
            raise KeyError(f"spec {self.spec.name!r} has no kernel {name!r}; it has {sorted(self._ops)}") from None

    def __getattr__(self, name: str):
        ops = self.__dict__.get("_ops", {})
        if name in ops:
            return ops[name]
        raise AttributeError(name)

    def __iter__(self):
        return iter(self._ops)

    def names(self) -> list[str]:
        return list(self._ops)


def _capturing() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001
        return False


def load_variant(kdef: KernelDef, spec: Spec, variant: Variant, target: Target,
                 root: str | None = None) -> tuple[Any, bool]:
    """(compiled function, cache hit?) for one variant."""
    entry = cache.make_entry(variant, kdef.template, dict(kdef.render_params(spec, variant)), target, root)
    k = (entry.root, entry.key)
    with _lock:
        fn = _functions.get(k)
        if fn is not None:
            return fn, True
        if _capturing():
            raise RuntimeError(
                f"flintgen kernel {variant.name} is first used inside a CUDA-graph capture: "
                "call flintgen.warmup(spec) (or run the op once) before capturing"
            )
        outcome = cache.get_or_build(entry)
        _functions[k] = outcome.function
        return outcome.function, outcome.hit


def _make_loader(kdef: KernelDef, spec: Spec, target: Target):
    def load(variant: Variant):
        return load_variant(kdef, spec, variant, target)[0]

    return load


def get_kernel(spec: Spec | str, name: str | None = None, *, device: int | None = None):
    """The spec's kernel set, or one op by name.

    ``device``: CUDA device index whose arch and SM count select the binaries
    (default: the current device).
    """
    spec = as_spec(spec)
    if name is not None:
        kdef = get_def(name)
        if not kdef.needed(spec):
            raise ValueError(f"spec {spec.name!r} does not use kernel {name!r}")
    target = toolchain.resolve_target(device_index=device)
    key = (spec, target, name)
    with _lock:
        if key in _ops:
            return _ops[key]
        if name is not None:
            op = get_def(name).bind(spec, target, _make_loader(get_def(name), spec, target))
        else:
            op = KernelSet(spec, {
                n: k.bind(spec, target, _make_loader(k, spec, target))
                for n, k in KERNELS.items() if k.needed(spec)
            })
        _ops[key] = op
        return op


def warmup(spec: Spec | str, names: Iterable[str] | None = None, *, device: int | None = None) -> None:
    """Load every variant of the spec's kernels, allocate workspaces and run
    each binary once, so that nothing loads during a CUDA-graph capture."""
    import torch

    kernels = get_kernel(spec, device=device)
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    for n in names or kernels.names():
        kernels[n].warmup(dev)
    torch.cuda.synchronize(dev)
