"""What every kernel of flintgen provides (cute-free: imported on serving
machines where only the DSL runtime and tvm-ffi are installed).

A kernel is a template plus a ``KernelDef``:

* ``variants(spec, target)`` lists every binary the spec needs (launch
  configurations chosen by the heuristics, code paths such as residual or
  not). Each ``Variant`` is compiled once and cached on disk.
* ``render_params(spec, variant)`` gives the template its constants and code-path
  flags; nothing else reaches the generated source, so the rendered text plus
  the helper modules is the kernel's identity.
* ``bind(spec, target, load)`` returns the torch-facing op: it validates its
  arguments, picks the variant and calls ``load(variant)`` (a compiled TVM-FFI
  function taking torch tensors and running on the current stream).

Generated modules define ``compile_args() -> (kernel_object, fake_args)``, which
``flintgen.compiler`` passes to ``cute.compile``.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from flintgen.spec import Spec


@dataclass(frozen=True)
class Target:
    """What a binary is built for. Only sm_90a is supported for now."""

    arch: str
    num_sms: int

    def to_json(self) -> dict:
        return {"arch": self.arch, "num_sms": self.num_sms}


@dataclass(frozen=True)
class Variant:
    """One compiled binary of a kernel: its compile-time parameters."""

    kernel: str
    params: tuple[tuple[str, Any], ...]

    @staticmethod
    def of(kernel: str, **params: Any) -> "Variant":
        return Variant(kernel, tuple(sorted(params.items())))

    def __getitem__(self, key: str) -> Any:
        return dict(self.params)[key]

    @property
    def name(self) -> str:
        """Readable, filesystem-safe name, e.g. ``rms_norm-has_residual1``."""
        parts = [self.kernel]
        for k, v in self.params:
            if isinstance(v, bool):
                v = int(v)
            parts.append(f"{k}{v}")
        return "-".join(parts)

    def canonical(self) -> str:
        return json.dumps({"kernel": self.kernel, "params": dict(self.params)}, sort_keys=True)


Loader = Callable[[Variant], Callable[..., Any]]


class KernelDef(abc.ABC):
    name: str
    template: str
    description: str
    #: PTX fragments every variant must contain (checked in CI on the compiled
    #: PTX): the instructions the design depends on.
    required_ptx: tuple[str, ...] = ()
    #: Inclusive ranges of the integer spec fields this kernel supports,
    #: ``{field: (lo, hi)}``. The spec admits the union over kernels; a kernel
    #: asked for outside its own range is refused by ``check_limits``.
    limits: Mapping[str, tuple[int, int]] = {}

    def check_limits(self, spec: Spec) -> None:
        """Raise ValueError naming this kernel when ``spec`` is outside ``limits``."""
        for field_name, (lo, hi) in self.limits.items():
            value = getattr(spec, field_name)
            if not lo <= value <= hi:
                raise ValueError(f"kernel {self.name} supports {field_name} {lo}..{hi}, got {value} "
                                 f"(spec {spec.name!r}): use a {field_name} in that range")

    def template_of(self, variant: Variant) -> str:
        """The template that renders ``variant`` (a kernel of several designs overrides this)."""
        return self.template

    def needed(self, spec: Spec) -> bool:
        """Whether ``spec`` uses this kernel at all."""
        return True

    @abc.abstractmethod
    def variants(self, spec: Spec, target: Target) -> list[Variant]:
        """Every variant the spec needs, up to ``spec.max_batch``."""

    @abc.abstractmethod
    def render_params(self, spec: Spec, variant: Variant) -> Mapping[str, Any]:
        """Template context for one variant."""

    @abc.abstractmethod
    def bind(self, spec: Spec, target: Target, load: Loader) -> Callable[..., Any]:
        """The torch-facing op."""
