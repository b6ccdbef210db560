"""flintgen kernels as ``torch.library`` custom ops (``torch.ops.flintgen.*``).

Each op takes the spec as its canonical JSON string (a constant under
``torch.compile``) and has a fake implementation, so ``torch.compile`` traces
through it without running it and CUDA graphs capture the real kernel.

    import flintgen.torch_ops
    key = flintgen.get_preset("flint").canonical_json()
    xn, res = torch.ops.flintgen.fused_add_rms_norm(x, residual, w, 1e-6, key)

fp8 KV caches (spec kv_cache_dtype "fp8_e4m3"): ``qkv`` and ``decode_attention``
take the layer's ``k_scale`` / ``v_scale`` (fp32 CUDA tensors of one element,
dequantized value = e4m3 x scale) as optional trailing arguments, required by
the kernels for such a spec and None otherwise; the caches may be
``torch.float8_e4m3fn`` or ``torch.uint8`` (vLLM's allocation), which the fake
implementations accept as they are.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

import torch

from flintgen.spec import Spec


@functools.lru_cache(maxsize=64)
def _spec(key: str) -> Spec:
    return Spec.from_dict(json.loads(key))


def _op(key: str, name: str):
    from flintgen.runtime import get_kernel

    return get_kernel(_spec(key), name)


@torch.library.custom_op("flintgen::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, spec: str) -> torch.Tensor:
    return _op(spec, "rms_norm")(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps, spec):
    return torch.empty_like(x)


@torch.library.custom_op("flintgen::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _op(spec, "rms_norm")(x, weight, eps, residual)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, spec):
    return torch.empty_like(x), torch.empty_like(x)


def _scales(k_scale, v_scale) -> dict:
    """The scale keywords to pass on: only those given, so a bf16 op never sees them."""
    return {k: v for k, v in (("k_scale", k_scale), ("v_scale", v_scale)) if v is not None}


@torch.library.custom_op("flintgen::decode_attention", mutates_args=("out",))
def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, sinks: Optional[torch.Tensor], window: Optional[int],
                     scale: float, out: torch.Tensor, spec: str, softcap: Optional[float] = None,
                     k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> None:
    """``softcap``: the logit cap of a spec with ``attn_logit_softcap`` (None otherwise);
    ``k_scale`` / ``v_scale``: an fp8 cache's scales (None for bf16)."""
    _op(spec, "decode_attention")(q, kv_cache, block_tables, seq_lens, sinks, window, scale, out,
                                  softcap=softcap, **_scales(k_scale, v_scale))


@decode_attention.register_fake
def _(q, kv_cache, block_tables, seq_lens, sinks, window, scale, out, spec, softcap=None, k_scale=None,
      v_scale=None):
    return None


@torch.library.custom_op("flintgen::qkv", mutates_args=("k_cache", "v_cache"))
def qkv(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, weight: torch.Tensor,
        weight_scale: Optional[torch.Tensor], global_scale: Optional[torch.Tensor],
        q_norm_weight: Optional[torch.Tensor], k_norm_weight: Optional[torch.Tensor],
        cos_sin_cache: Optional[torch.Tensor], positions: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, slot_mapping: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
        qk_eps: float, spec: str, k_scale: Optional[torch.Tensor] = None,
        v_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``k_scale`` / ``v_scale``: an fp8 cache's scales (None for bf16)."""
    q, res = _op(spec, "qkv")(x, residual, norm_weight, weight, weight_scale, global_scale, q_norm_weight,
                              k_norm_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, bias,
                              eps, qk_eps, **_scales(k_scale, v_scale))
    # Without a residual (first layer) the op returns x itself; an op output may not alias an input.
    return q, (res.clone() if residual is None else res)


@qkv.register_fake
def _(x, residual, norm_weight, weight, weight_scale, global_scale, q_norm_weight, k_norm_weight,
      cos_sin_cache, positions, k_cache, v_cache, slot_mapping, bias, eps, qk_eps, spec, k_scale=None,
      v_scale=None):
    s = _spec(spec)
    return x.new_empty(x.shape[0], s.q_heads_per_rank * s.head_dim), torch.empty_like(x)
