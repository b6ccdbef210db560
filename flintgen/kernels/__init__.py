"""Registry of flintgen's kernels, in the order a decode step runs them."""

from __future__ import annotations

from flintgen.kernels.base import KernelDef
from flintgen.kernels.decode_attention import DecodeAttentionDef
from flintgen.kernels.qkv import QKVDef
from flintgen.kernels.rms_norm import RMSNormDef

KERNELS: dict[str, KernelDef] = {k.name: k for k in (RMSNormDef(), QKVDef(), DecodeAttentionDef())}


def get_def(name: str) -> KernelDef:
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r}: flintgen has {sorted(KERNELS)}; use one of "
                         "those names") from None
