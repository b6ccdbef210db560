"""The fused QKV step's (residual-add) RMSNorm inside the streaming GEMV
(cute DSL): a CTA normalizes whole token rows bit for bit as the standalone
kernel does (templates/rms_norm.py.j2), so the fused step's xn, residual and
outputs are the unfused step's.

The standalone kernel runs ``rt`` threads per row
(flintgen.configs.rms_norm_config.RMSNormConfig.for_hidden); thread ``vt``
owns the 16-byte vectors ``vt + v rt`` (v < ``vecs``), adds its elements'
squares in order, reduces each warp by butterfly (reduce.warp_sum) and adds
the warp sums in warp order. A CTA of ``threads`` threads (both multiples of
32) plays the virtual threads ``vt = tid + k threads`` (k < ceil(rt /
threads)): the same additions in the same order, so the same fp32 sum::

    row [hidden] bf16 = vectors [hidden / 8] of 16 bytes
    vector idx -> virtual thread idx % rt -> thread (idx % rt) % threads, slot k = (idx % rt) // threads

``has_residual`` (Int32, run time): r = bf16(x + residual), written to
``residual_out``; else r = x (``residual`` is then any valid row tensor, read
and not used).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from flintgen.device import ldst, ptx
from flintgen.device.reduce import warp_sum


@dataclass(frozen=True)
class RowNorm:
    """Compile-time geometry: ``hidden`` values a row, the standalone kernel's ``rt`` threads of ``vecs``
    vectors each, this CTA's ``threads``, the weight's ``offset`` (Gemma: 1, added in fp32)."""

    hidden: int
    rt: int
    vecs: int
    threads: int
    offset: int = 0

    @property
    def virtual(self) -> int:
        """Virtual threads per thread."""
        return -(-self.rt // self.threads)

    @property
    def warps(self) -> int:
        """The standalone kernel's warps: the partial sums added in order."""
        return self.rt // 32

    @property
    def num_vecs(self) -> int:
        return self.hidden // 8

    def scale(self, w):
        """The weight's factor: ``w``, or (Gemma) ``w + offset`` in fp32."""
        return w if self.offset == 0 else w + Float32(self.offset)

    def load_weight(self, weight_addr, tid):
        """This thread's weight vectors (its virtual threads'), zeros where none: ``[virtual, vecs, 4]`` words."""
        w = cute.make_rmem_tensor((self.virtual * self.vecs * 4,), Uint32)
        for k in range(self.virtual):
            vt = tid + k * self.threads
            for v in range(self.vecs):
                idx = vt + v * self.rt
                wv = ldst.ldg_weight_u32x4(weight_addr + Int64(idx) * 16,
                                           Int32(vt < self.rt) * Int32(idx < self.num_vecs))
                for j in range(4):
                    w[(k * self.vecs + v) * 4 + j] = wv[j]
        return w

    @cute.jit
    def normalize(self, x_addr, residual_addr, residual_out_addr, xn_addr, w, row, eps: Float32,
                  has_residual: Int32, tid, red_smem):
        """Row ``row``: r (and residual_out), then xn = bf16(r rstd w); ``red_smem`` holds ``warps`` fp32.
        Ends with a barrier (every thread's stores issued, ``red_smem`` free again)."""
        row_off = Int64(row) * (self.hidden * 2)
        r = cute.make_rmem_tensor((self.virtual * self.vecs * 8,), Float32)
        ss = cute.make_rmem_tensor((self.virtual,), Float32)
        for k in cutlass.range_constexpr(self.virtual):
            ss[k] = Float32(0.0)
            vt = tid + k * self.threads
            for v in cutlass.range_constexpr(self.vecs):
                idx = vt + v * self.rt
                if vt < self.rt:
                    if idx < self.num_vecs:
                        off = row_off + Int64(idx) * 16
                        xv = ptx.ldg_u32x4(x_addr + off)
                        rv = ptx.ldg_u32x4(residual_addr + off)
                        packed = [Uint32(0)] * 4
                        for j in cutlass.range_constexpr(4):
                            # bf16 + bf16 in fp32 is exact; one rounding, as torch does (has_residual: else x)
                            s = ptx.bf16x2(ptx.bf16_lo(xv[j]) + ptx.bf16_lo(rv[j]),
                                           ptx.bf16_hi(xv[j]) + ptx.bf16_hi(rv[j]))
                            packed[j] = xv[j] + Uint32(has_residual) * (s - xv[j])
                        if has_residual != 0:
                            ptx.stg_u32x4(residual_out_addr + off, packed[0], packed[1], packed[2], packed[3])
                        e = (k * self.vecs + v) * 8
                        for j in cutlass.range_constexpr(4):
                            r[e + 2 * j] = ptx.bf16_lo(packed[j])
                            r[e + 2 * j + 1] = ptx.bf16_hi(packed[j])
                            ss[k] = ss[k] + r[e + 2 * j] * r[e + 2 * j]
                            ss[k] = ss[k] + r[e + 2 * j + 1] * r[e + 2 * j + 1]
        for k in cutlass.range_constexpr(self.virtual):
            vt = tid + k * self.threads
            tot = warp_sum(ss[k])
            if vt < self.rt:
                if vt % 32 == 0:
                    ptx.sts_f32(red_smem + (vt // 32) * 4, tot)
        cute.arch.sync_threads()
        total = ptx.lds_f32(red_smem)
        for w_ in cutlass.range_constexpr(1, self.warps):
            total = total + ptx.lds_f32(red_smem + w_ * 4)
        rstd = ptx.rsqrt(total * Float32(1.0 / self.hidden) + eps)
        for k in cutlass.range_constexpr(self.virtual):
            vt = tid + k * self.threads
            for v in cutlass.range_constexpr(self.vecs):
                idx = vt + v * self.rt
                if vt < self.rt:
                    if idx < self.num_vecs:
                        e = (k * self.vecs + v) * 8
                        q = (k * self.vecs + v) * 4
                        o = [ptx.bf16x2(r[e + 2 * j] * rstd * self.scale(ptx.bf16_lo(w[q + j])),
                                        r[e + 2 * j + 1] * rstd * self.scale(ptx.bf16_hi(w[q + j])))
                             for j in range(4)]
                        ptx.stg_u32x4(xn_addr + row_off + Int64(idx) * 16, o[0], o[1], o[2], o[3])
        cute.arch.sync_threads()
