"""TMA (bulk tensor copy) of the streaming QKV GEMV's weight units into its
ring, for the wgmma ring (StreamConfig.tma).

Provenance: written for flintgen's streaming QKV GEMV (PTX ISA
``cp.async.bulk.tensor``; the CuTe DSL's ``make_tiled_tma_atom`` /
``tma_partition``).

One unit is a block's ``rows`` weight rows x 64 K values (128 bytes a row).
The host encodes a tensor map of ``W [N, hidden]`` with a box of one unit and
the 128-byte swizzle, so one instruction, issued by one lane of a warp, writes the
unit into its stage exactly as wgmma reads it (flintgen.device.wgmma: row r's
16-byte chunk c at ``128 r + 16 (c ^ (r % 8))`` of a 1024-byte aligned
stage) and counts its bytes on the stage's mbarrier::

    W [N, hidden] bf16, row-major          global, read through the tensor map
    ring stage s: [rows, 64] bf16, SW128   shared, stage s at s * stage_bytes
    unit u = (block u // steps, step u % steps)  ->  box (rows * block, 64 * step)

The stage's other bytes (xn's rows after the weights) are written by
cp.async as before.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import BFloat16
from cutlass.cute.nvgpu import cpasync, warpgroup

K_STEP = 64   # values of a unit's row (flintgen.configs.qkv_stream_plan.K_STEP)


def unit_layout(rows: int):
    """Shared layout of one unit's weights: ``[rows, 64]`` bf16, K-major, 128-byte swizzle."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    return cute.tile_to_shape(atom, (rows, K_STEP), order=(0, 1))


def make_atom(weight: cute.Tensor, rows: int):
    """Host side: the TMA copy atom (with its tensor map) and the coordinate tensor of ``weight``."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), weight, unit_layout(rows), (rows, K_STEP))


def ring_partition(atom, tma_w: cute.Tensor, ring, rows: int, stages: int, stage_bytes: int):
    """(stage destinations ``[(vals), stages]``, unit sources ``[(vals), blocks, steps]``): the ring
    (``ring``: its shared pointer, 1024-byte aligned) viewed as ``[rows, 64, stages]`` bf16 with the
    unit layout's swizzle and ``stage_bytes`` between stages."""
    # the swizzle on the pointer (as SmemAllocator.allocate_tensor attaches it): TMA's lowering takes that form
    s_w = cute.make_tensor(cute.recast_ptr(ring, unit_layout(rows).inner, dtype=BFloat16),
                           cute.make_layout((rows, K_STEP, stages), stride=(K_STEP, 1, stage_bytes // 2)))
    g_w = cute.local_tile(tma_w, (rows, K_STEP), (None, None))
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_w, 0, 2),
                                 cute.group_modes(g_w, 0, 2))


def issue_unit(atom, dst, src, block, step, stage, mbar):
    """A whole warp (the copy elects one lane): unit (``block``, ``step``) into ring stage ``stage``,
    completing on ``mbar`` (armed by the caller with the unit's bytes)."""
    cute.copy(atom, src[(None, block, step)], dst[(None, stage)], tma_bar_ptr=mbar)

