"""Host side of the RMSNorm kernels: ``rms_norm`` and ``fused_add_rms_norm``.

    xn = rms_norm(x, weight, eps)                        (first layer)
    xn, residual_out = rms_norm(x, weight, eps, residual)   r = x + residual

x, residual: [M, hidden] bf16 contiguous; weight: [hidden] bf16. A spec with
``norm_weight_offset = 1`` (Gemma) scales by ``f32(weight) + 1`` in fp32.
"""

from __future__ import annotations

from typing import Any, Mapping

from flintgen.configs.rms_norm_config import RMSNormConfig
from flintgen.kernels import checks
from flintgen.kernels.base import KernelDef, Loader, Target, Variant
from flintgen.spec import Spec


class RMSNormDef(KernelDef):
    name = "rms_norm"
    template = "rms_norm.py.j2"
    description = "RMSNorm / fused residual-add RMSNorm over [M, hidden] bf16 (PDL)"
    required_ptx = ("griddepcontrol.launch_dependents", "griddepcontrol.wait", "ld.global.L1::no_allocate.v4.u32",
                    "ld.global.v4.u32", "st.global.v4.u32", "rsqrt.approx.ftz.f32", "cvt.rn.bf16x2.f32")

    # hidden 65536 spills (ptxas 13.0: 460 bytes at 8 vectors per thread); 32768 takes 64 registers.
    # Any M: the token count is a run-time dimension (max_tokens bounds the spec, not this kernel).
    limits = {"hidden_size": (64, 32768), "max_tokens": (1, 256)}

    def variants(self, spec: Spec, target: Target) -> list[Variant]:
        self.check_limits(spec)
        # norm_weight_offset only where set: the other variants keep their names.
        off = {"norm_weight_offset": spec.norm_weight_offset} if spec.norm_weight_offset else {}
        return [Variant.of(self.name, hidden=spec.hidden_size, has_residual=r, **off) for r in (False, True)]

    def render_params(self, spec: Spec, variant: Variant) -> Mapping[str, Any]:
        cfg = RMSNormConfig.for_hidden(variant["hidden"])
        return {"hidden": variant["hidden"], "has_residual": variant["has_residual"],
                "norm_weight_offset": dict(variant.params).get("norm_weight_offset", 0),
                "threads": cfg.threads, "vec_per_thread": cfg.vec_per_thread}

    def bind(self, spec: Spec, target: Target, load: Loader) -> "RMSNormOp":
        self.check_limits(spec)
        return RMSNormOp(spec, self.variants(spec, target), load)


class RMSNormOp:
    """``op(x, weight, eps=None, residual=None, *, out=None, residual_out=None)``

    Returns ``out`` (no residual) or ``(out, residual_out)``. ``residual_out``
    may be ``residual`` itself (in-place update); ``out`` may be ``x``.
    Launches on the current CUDA stream with programmatic dependent launch.
    """

    name = "rms_norm"

    def __init__(self, spec: Spec, variants: list[Variant], load: Loader):
        self.spec = spec
        self.hidden = spec.hidden_size
        self._variants = {v["has_residual"]: v for v in variants}
        self._load = load

    def __call__(self, x, weight, eps: float | None = None, residual=None, *, out=None,
                 residual_out=None):
        import torch

        h = self.hidden
        checks.tensor("x", x, dtype=torch.bfloat16, ndim=2, last=h)
        m = x.shape[0]
        checks.tensor("weight", weight, dtype=torch.bfloat16, shape=(h,), device=x.device)
        eps = self.spec.rms_eps if eps is None else checks.positive_float("eps", eps)
        if out is None:
            out = torch.empty_like(x)
        else:
            checks.tensor("out", out, dtype=torch.bfloat16, shape=(m, h), device=x.device)
        if residual is not None:
            checks.tensor("residual", residual, dtype=torch.bfloat16, shape=(m, h), device=x.device)
            if residual_out is None:
                residual_out = torch.empty_like(x)
            else:
                checks.tensor("residual_out", residual_out, dtype=torch.bfloat16, shape=(m, h),
                              device=x.device)
        elif residual_out is not None:
            raise ValueError("residual_out was given without residual: pass residual, or drop residual_out")
        fn = self._load(self._variants[residual is not None])
        if m > 0:
            if residual is None:
                fn(x, out, weight, eps)
            else:
                fn(x, residual, residual_out, out, weight, eps)
        return out if residual is None else (out, residual_out)

    def warmup(self, device) -> None:
        """Load both variants and run each once (module load happens on the first
        call, which must not be inside a CUDA-graph capture)."""
        import torch

        x = torch.zeros(1, self.hidden, dtype=torch.bfloat16, device=device)
        w = torch.ones(self.hidden, dtype=torch.bfloat16, device=device)
        self(x, w)
        self(x, w, residual=x.clone())

    def variants(self) -> list[Variant]:
        return list(self._variants.values())
