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
    entry = cache.make_entry(variant, kdef.template_of(variant), dict(kdef.render_params(spec, variant)), target, root)
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
    with _lock:
        if name is not None:
            return _bound(spec, target, name)
        key = (spec, target, None)
        if key not in _ops:
            _ops[key] = KernelSet(spec, {n: _bound(spec, target, n) for n, k in KERNELS.items() if k.needed(spec)})
        return _ops[key]


def _bound(spec: Spec, target, name: str):
    """The one op of (spec, target, name): ``get_kernel(spec, name)`` and
    ``get_kernel(spec)[name]`` are the same object (one workspace, one
    warmup). Called with ``_lock`` held."""
    key = (spec, target, name)
    if key not in _ops:
        kdef = get_def(name)
        _ops[key] = kdef.bind(spec, target, _make_loader(kdef, spec, target))
    return _ops[key]


def warmup(spec: Spec | str, names: Iterable[str] | None = None, *, device: int | None = None) -> None:
    """Load every variant of the spec's kernels (of ``names`` only, when
    given: the ops ``get_kernel(spec, name)`` returns), allocate workspaces and
    run each binary once, so that nothing loads during a CUDA-graph capture."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    if names is None:
        kernels = get_kernel(spec, device=device)
        ops = [kernels[n] for n in kernels.names()]
    else:
        ops = [get_kernel(spec, n, device=device) for n in names]
    for op in ops:
        op.warmup(dev)
    torch.cuda.synchronize(dev)
