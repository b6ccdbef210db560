"""Warp and CTA reductions."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from flintgen.device import ptx


@cute.jit
def warp_sum(v: Float32) -> Float32:
    for off in cutlass.range_constexpr(5):
        v = v + cute.arch.shuffle_sync_bfly(v, 16 >> off)
    return v


@cute.jit
def block_sum(v: Float32, red_smem, tid, num_warps: cutlass.Constexpr) -> Float32:
    """Sum of ``v`` over the CTA, returned to every thread.

    ``red_smem``: shared address of ``num_warps`` fp32 scratch slots. Warp sums
    are added in warp order, so the result is the same in every thread.
    """
    v = warp_sum(v)
    if cutlass.const_expr(num_warps == 1):
        return v
    if tid % 32 == 0:
        ptx.sts_f32(red_smem + (tid // 32) * 4, v)
    cute.arch.sync_threads()
    total = ptx.lds_f32(red_smem)
    for w in cutlass.range_constexpr(1, num_warps):
        total = total + ptx.lds_f32(red_smem + w * 4)
    return total
