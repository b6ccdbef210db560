"""TMA (bulk tensor copies) of the streaming QKV GEMV's units into its wgmma
ring (StreamConfig.tma): a unit's weight rows and xn's values of every token.

Provenance: written for flintgen's streaming QKV GEMV (PTX ISA
``cp.async.bulk.tensor``; the CuTe DSL's ``make_tiled_tma_atom`` /
``tma_partition``).

A unit is a block's ``rows`` weight rows x 64 K values, and its operand B the
same 64 values of every token (``max_m`` rows; tokens >= M are the tensor
map's out-of-bounds rows: zero-filled by the copy, their bytes counted like
the others). The host encodes one tensor map per operand, its box one
unit's rows x 128 bytes in the 128-byte swizzle, so one instruction per
operand, issued by one elected lane, writes the stage exactly as wgmma
reads it (flintgen.device.wgmma: row r's 16-byte chunk c at ``128 r + 16 (c ^
(r % 8))`` from a 1024-byte boundary) and counts its bytes on the stage's
mbarrier::

    W [N, hidden] bf16, row-major      -> stage s + 0:            [rows, 64], SW128
    xn [M, hidden] bf16, row-major     -> stage s + 128 rows:     [max_m, 64], SW128
    unit u = (block b = u // steps, step k = u % steps): W box at (row rows b, col 64 k), xn box at (0, 64 k)
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import BFloat16
from cutlass.cute.nvgpu import cpasync, warpgroup

from flintgen.layout import K_STEP
from flintgen.device.wgmma import ROW_BYTES


def unit_layout(rows: int):
    """Shared layout of one operand of a unit: ``[rows, 64]`` bf16, K-major, 128-byte swizzle."""
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    return cute.tile_to_shape(atom, (rows, K_STEP), order=(0, 1))


def make_atom(src: cute.Tensor, rows: int):
    """Host side: the TMA copy atom (its tensor map) of ``src`` ([R, hidden] bf16, row-major) in boxes of
    ``rows`` x 64, and its coordinate tensor."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), src, unit_layout(rows), (rows, K_STEP))


def ring_partition(atom, coords: cute.Tensor, ring, rows: int, stages: int, stage_bytes: int, first_row: int = 0):
    """(stage destinations ``[(vals), stages]``, box sources ``[(vals), row tiles, steps]``) of one operand:
    the ring (``ring``: its shared pointer, 1024-byte aligned) viewed as ``[rows, 64, stages]`` bf16 from row
    ``first_row`` of each stage (a multiple of 8), ``stage_bytes`` apart, in the unit layout's swizzle."""
    # the swizzle rides on the pointer (as SmemAllocator.allocate_tensor attaches it): TMA's lowering takes that form
    ptr = cute.recast_ptr(ring + first_row * ROW_BYTES, unit_layout(rows).inner, dtype=BFloat16)
    view = cute.make_tensor(ptr, cute.make_layout((rows, K_STEP, stages), stride=(K_STEP, 1, stage_bytes // 2)))
    boxes = cute.local_tile(coords, (rows, K_STEP), (None, None))
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(view, 0, 2),
                                 cute.group_modes(boxes, 0, 2))


def issue(atom, dst, src, row_tile, step, stage, mbar):
    """A whole warp (the copy elects its lane): box (``row_tile``, ``step``) into ring stage ``stage``,
    completing on ``mbar`` (armed by the caller with the stage's bytes)."""
    cute.copy(atom, src[(None, row_tile, step)], dst[(None, stage)], tma_bar_ptr=mbar)
