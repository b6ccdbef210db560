"""Argument checks shared by the ops: clear errors before any launch."""

from __future__ import annotations

import math


def tensor(name, t, *, dtype, ndim=None, shape=None, last=None, device=None,
           contiguous=True, align=16):
    """Check a torch tensor argument; raises TypeError/ValueError naming it."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}: convert it with .to({dtype})")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}: move it with .cuda()")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if shape is not None:
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    else:
        if ndim is not None and t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if last is not None and t.shape[-1] != last:
            raise ValueError(f"{name} must have last dimension {last} (the spec's size), got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()}): call .contiguous()")
    if align and t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned (data_ptr % {align} = {t.data_ptr() % align}): "
                         "pass a fresh allocation or .clone() it")
    return t


def positive_float(name, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)
