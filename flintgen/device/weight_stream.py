"""Device pieces of the streaming QKV GEMV (flintgen.configs.qkv_stream_plan).

Provenance: written for flintgen's streaming QKV GEMV.

* ``cp.async`` 16-byte pieces global -> shared (``.cg``: L2 only, the weights
  are read once), zero-filled where a predicate is 0 (tokens >= M), grouped and
  waited on per ring stage.
* One stage (``stage`` = its shared address) holds a unit: per 64-value K step
  of it (a sub-stage; StreamPlan.unit_steps of them, the template's
  SUB_BYTES apart) ``rows`` weight rows and then ``max_m`` xn token rows, 64
  bf16 values (128 bytes) each, at ``ROW_STRIDE``-byte pitch::

      stage + r * ROW_STRIDE              weight row r of the block, values [64 s, 64 s + 64)
      stage + (rows + n) * ROW_STRIDE     token n of xn, the same values

  or, for wgmma (``swizzled``), the same rows at 128-byte pitch in its
  128-byte swizzle (flintgen.device.wgmma.core_offset).

* Fragments (flintgen.device.gemv's K order): 16-row tile i of the block
  holds rows [16 i, 16 i + 16); thread (g, t) reads rows 16 i + g and
  16 i + g + 8, and token g of each 8-token n-tile, at bytes [32 t, 32 t + 32)
  of the row.
* Register path (no ring): a warp loads its tiles' rows straight into
  registers, thread (g, t) the 16-byte pieces at bytes 16 t and 64 + 16 t of
  the unit's 128 (a quad reads 64 contiguous bytes per instruction); xn is
  staged once per CTA as ``[slot, half, max_m, 64 bytes]`` and read with the
  same pieces (a quarter-warp phase covers two tokens' 128 contiguous bytes:
  no bank conflict). Words 0-3 / 4-7 of a row or token are its pieces at
  16 t / 64 + 16 t, one K order for both operands.
* Partials: ``ws [slots, rows, max_m]`` fp32; the thread's accumulator
  ``acc[nt]`` (c0, c1 = row g, tokens 8 nt + 2t, +1; c2, c3 = row g + 8) is
  two 8-byte pieces per n-tile.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from flintgen.layout import K_STEP, ROW_STRIDE, XN_SLOT_BYTES
from flintgen.device import ldst, ptx, wgmma
from flintgen.device.ptx import _asm

ROW_PIECES = K_STEP * 2 // 16   # 16-byte pieces per staged row


# ---------------------------------------------------------------- cp.async
@dsl_user_op
def cp_async_16(dst_smem, src_gmem, issue, fill, policy=None, *, loc=None, ip=None):
    """16 bytes global -> shared, asynchronous (L2 only), where ``issue``
    (Int32) is nonzero: the bytes at ``src_gmem``, or zeros (nothing read)
    where ``fill`` is 0. Nothing at all where ``issue`` is 0. ``policy``
    (Int64 from ldst.evict_first_policy, or None): the L2 eviction policy of the read."""
    hint, ops = ("", []) if policy is None else (".L2::cache_hint", [(Int64, policy)])
    _asm(
        [], [(Uint32, dst_smem), (Int64, src_gmem), (Int32, issue), (Int32, fill)] + ops,
        "{ .reg .pred p, z; .reg .b32 n; setp.ne.s32 p, $2, 0; setp.ne.s32 z, $3, 0; selp.b32 n, 16, 0, z;\n"
        f"@p cp.async.cg.shared.global{hint} [$0], [$1], 16, n{', $4' if policy is not None else ''}; }}",
        side_effects=True, loc=loc, ip=ip,
    )  # fmt: skip


def prefetch_rows_l2(src0, src_pitch: int, n_rows: int, nbytes, tid, threads: int, enable):
    """``ldst.prefetch_l2`` of ``nbytes`` of each of ``n_rows`` rows (row i at ``src0 + i * src_pitch``),
    thread ``tid`` taking rows tid, tid + threads, ..; nothing where ``enable`` (Int32) is 0."""
    for k in range(-(-n_rows // threads)):
        i = tid + k * threads
        issue = enable if (k + 1) * threads <= n_rows else enable * Int32(i < n_rows)
        ldst.prefetch_l2(src0 + Int64(i) * src_pitch, nbytes, issue)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None):
    _asm([], [], "cp.async.commit_group;", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_wait(pending: int, *, loc=None, ip=None):
    """Wait until at most ``pending`` of this thread's committed groups are in flight."""
    _asm([], [], f"cp.async.wait_group {int(pending)};", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def stg_f32x2(addr, a, b, *, loc=None, ip=None):
    _asm([], [(Int64, addr), (Float32, a), (Float32, b)], "st.global.v2.f32 [$0], {$1, $2};",
         side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def sts_b16(addr, w, *, loc=None, ip=None):
    """The low 16 bits of ``w`` (Uint32) to shared memory."""
    _asm([], [(Uint32, addr), (Uint32, w)],
         "{ .reg .b16 h; cvt.u16.u32 h, $1; st.shared.b16 [$0], h; }", side_effects=True, loc=loc, ip=ip)


# ---------------------------------------------------------------- stage fill
def issue_rows(stage, src0, src_pitch: int, first_row: int, n_rows: int, tid, threads: int, enable,
               live_rows=None, swizzled: bool = False, policy=None):
    """cp.async ``n_rows`` rows of 128 bytes (row i from ``src0 + i * src_pitch``)
    into ``stage`` rows ``first_row + i`` where ``enable`` (Int32) is nonzero;
    thread ``tid`` takes pieces tid, tid + threads, ..; rows ``i >= live_rows``
    (Int32 >= 1; None: all live) are zero-filled, addressed at row
    ``live_rows - 1`` (nothing is read). ``swizzled``: wgmma's 128-byte swizzled
    layout (flintgen.device.wgmma.core_offset; first_row a multiple of 8),
    else rows at ROW_STRIDE pitch. ``policy``: cp_async_16's."""
    pieces = n_rows * ROW_PIECES
    for k in range(-(-pieces // threads)):
        q = tid + k * threads
        i = q // ROW_PIECES
        c = q % ROW_PIECES
        issue = enable if (k + 1) * threads <= pieces else enable * Int32(q < pieces)
        fill, src_row = Int32(1), i
        if live_rows is not None:
            fill = Int32(i < live_rows)
            src_row = cutlass.min(i, live_rows - 1)
        if swizzled:
            dst = stage + Int32(wgmma.core_offset(first_row + i, c))
        else:
            dst = stage + Int32((first_row + i) * ROW_STRIDE + c * 16)
        cp_async_16(dst, src0 + Int64(src_row) * src_pitch + Int64(c * 16), issue, fill, policy)


# ---------------------------------------------------------------- fragments
def load_a_bf16(stage, tile, g, t):
    """Rows 16 tile + g and + 8 of the stage as 8 words each (gemv.a_fragments_bf16's input)."""
    a = stage + Int32((tile * 16 + g) * ROW_STRIDE + t * 32)
    b = a + Int32(8 * ROW_STRIDE)
    return (list(ptx.lds_u32x4(a)) + list(ptx.lds_u32x4(a + 16)),
            list(ptx.lds_u32x4(b)) + list(ptx.lds_u32x4(b + 16)))


def load_b(stage, rows: int, nt: int, g, t):
    """Token 8 nt + g's 16 values of the stage (8 bf16x2 words)."""
    a = stage + Int32((rows + nt * 8 + g) * ROW_STRIDE + t * 32)
    return list(ptx.lds_u32x4(a)) + list(ptx.lds_u32x4(a + 16))


# ---------------------------------------------------------------- register path
@dsl_user_op
def ldg_nc_u32x4_pred(addr, pred, *, loc=None, ip=None):
    """16 weight bytes (read-only for the kernel's lifetime: the non-coherent
    path, not kept in L1); zeros, and no access, where ``pred`` (Int32) is 0."""
    return ptx._ldg_or_zero(Uint32, 4, "ld.global.nc.L1::no_allocate.v4.u32", addr, pred, loc, ip)


def load_unit_pieces(row_src, t, live):
    """The 8 words of a row (``row_src``: its unit's first byte) thread t feeds the MMAs."""
    return list(ldg_nc_u32x4_pred(row_src + Int64(t * 16), live)) + \
        list(ldg_nc_u32x4_pred(row_src + Int64(64 + t * 16), live))


def load_b_staged(xs0, slot, nt: int, g, t, max_m: int):
    """Token 8 nt + g's 8 words of staged xn slot ``slot`` (the pieces of load_unit_pieces)."""
    half = XN_SLOT_BYTES // 2   # a token's 64 bytes of one half of the step
    a = xs0 + Int32((slot * 2 * max_m + nt * 8 + g) * half + t * 16)
    return list(ptx.lds_u32x4(a)) + list(ptx.lds_u32x4(a + Int32(max_m * half)))


# ---------------------------------------------------------------- partials
def partial_offsets(tile, g, t, nt: int, max_m: int):
    """Element offsets in a slot of the thread's (c0, c1) and (c2, c3) pairs of 16-row tile
    ``tile`` (of the block) and n-tile ``nt``."""
    r = tile * 16 + g
    n = nt * 8 + 2 * t
    return r * max_m + n, (r + 8) * max_m + n


def store_partial(ws_slot, acc, tile, g, t, max_m: int):
    """The thread's accumulators of ``tile``, every n-tile, into slot ``ws_slot`` (global address)."""
    for nt in range(len(acc)):
        o0, o8 = partial_offsets(tile, g, t, nt, max_m)
        stg_f32x2(ws_slot + Int64(o0) * 4, acc[nt][0], acc[nt][1])
        stg_f32x2(ws_slot + Int64(o8) * 4, acc[nt][2], acc[nt][3])


@dsl_user_op
def ldg_cg_f32x2_pred(addr, pred, *, loc=None, ip=None):
    """8 bytes from L2 (partials other CTAs of this grid wrote); zeros, and no
    access, where ``pred`` (Int32) is 0."""
    return ptx._ldg_or_zero(Float32, 2, "ld.global.cg.v2.f32", addr, pred, loc, ip)


def sum_partials(slots, live, tile, g, t, n_tiles, max_m: int, init=None):
    """The thread's accumulator positions of n-tiles ``n_tiles`` (a range) summed over workspace slots
    ``slots`` (global addresses) in order, ``live[i]`` (Int32) gating each:
    every load is issued before the first add (one L2 latency, not one per
    slot); a dead slot adds zeros. ``init`` (per n-tile 4 Float32): the sum
    so far, which the slots continue."""
    out = []
    for k, nt in enumerate(n_tiles):
        o0, o8 = partial_offsets(tile, g, t, nt, max_m)
        parts = [(ldg_cg_f32x2_pred(a + Int64(o0) * 4, p), ldg_cg_f32x2_pred(a + Int64(o8) * 4, p))
                 for a, p in zip(slots, live)]
        if init is None:
            y = [parts[0][0][0], parts[0][0][1], parts[0][1][0], parts[0][1][1]]
            parts = parts[1:]
        else:
            y = list(init[k])
        for p0, p8 in parts:
            y = [y[0] + p0[0], y[1] + p0[1], y[2] + p8[0], y[3] + p8[1]]
        out.append(y)
    return out
