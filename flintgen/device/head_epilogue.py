"""Per-head epilogue of the fused QKV GEMV (rank 0 of each head's cluster).

Provenance: written for flintgen's fused QKV GEMV.

Rank 0 holds the head's bf16 rows ``head_rows[token][d]`` ([max_m, D] in shared
memory, gathered from the cluster through DSMEM). Warp ``w`` finishes tokens
``w, w + warps, ...`` (< M); the lanes split the head as the rendered
``flintgen.layout.EpilogueLanes`` says: lane l owns P
rotary pairs (NeoX: elements [P l, P l + P) and their partners + R/2;
interleaved: [2P l, 2P l + 2P)) and S pass-through elements [R + S l, ..)::

    q head: q[n, h D + d]             = rope(rms_norm(row, q_norm_weight))   (as configured)
    k head: k_cache[slot(n)][kv, d]   = rope(rms_norm(row, k_norm_weight))
    v head: v_cache[slot(n)][kv, d]   = row                                  (bits copied)
    fp8 e4m3 cache: k = e4m3(bf16(k) / k_scale), v = e4m3(row / v_scale)    (kv_quant)

The norm is over all D dims; RoPE rotates dims [0, R) (flintgen.device.rope)
and dims [R, D) pass through (normalized). Lanes past a part's active lanes
(e.g. D = 96: 48 pairs on 24 lanes of 2) address the last active lane's
elements, add nothing to the sum of squares and store nothing.

``slot(n)`` is ``slot_mapping[n]`` for ``n < len(slot_mapping)``, else -1; a
negative slot writes nothing. Cache views are ``[blocks, block_size, kv_heads,
D]`` with runtime strides (element units, last stride 1; ``KvPages``) of
E-byte elements (the rendered flintgen.layout KVDtype): bf16 (2 bytes), k and v rows
stored as the bf16 words they are computed in; fp8 e4m3 (1 byte), each of
those bf16 values divided by the layer's ``kv_scale`` (k_scale / v_scale, a
``kv_quant.Scale``) and converted (flintgen.device.kv_quant: bit-exact with
torch), one E-byte store per run of E. The conversion and its stores come in
two copies, one uniform branch on ``kv_scale.fast()``: the reciprocal-based
quotient, or ``div.rn.f32`` for scales outside its safe range. q is bf16
either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from flintgen.device import kv_quant, ldst, ptx, rope
from flintgen.device.reduce import warp_sum
from flintgen.layout import EpilogueLanes

Q_EB = 2  # bytes per q element (bf16 whatever the cache holds)


def _clamp(lane, active: int):
    """``lane``, or the last active lane for lanes past ``active`` (< 32)."""
    if active >= 32:
        return lane
    return cutlass.min(lane, Int32(active - 1))


def pair_start(lane, lanes: EpilogueLanes):
    """First element of the lane's rotary run: P l (NeoX; its partners start at
    R/2 + P l) or 2P l (interleaved); clamped to the last active lane."""
    p = lanes.pair_e
    return _clamp(lane, lanes.pair_lanes) * (2 * p if lanes.interleaved else p)


def pass_start(lane, lanes: EpilogueLanes):
    """First element of the lane's pass-through run: R + S l (clamped)."""
    return lanes.rope_dim + _clamp(lane, lanes.pass_lanes) * lanes.pass_e


def load_norm_weights(norm_w, lane, lanes: EpilogueLanes, offset: int):
    """The q/k norm factors of the lane's elements, fp32: ``(w[a] [P], w[b] [P],
    w[pass] [S])`` for pair elements a, b (see ``pair_start``) and the
    pass-through run; ``norm_w`` the bf16 weight's global address. Each is
    ``w`` or, for ``offset`` 1 (Gemma), ``w + 1`` in fp32 (rope.norm_weight)."""
    p, s, r = lanes.pair_e, lanes.pass_e, lanes.rope_dim
    d = pair_start(lane, lanes)
    if lanes.interleaved:
        w1, w2 = rope.deinterleave(ldst.ldg_nc_bf16_run(norm_w + Int64(d) * 2, 2 * p))
    else:
        w1 = ldst.ldg_nc_bf16_run(norm_w + Int64(d) * 2, p)
        w2 = ldst.ldg_nc_bf16_run(norm_w + Int64(d + r // 2) * 2, p)
    wp = []
    if s:
        wp = ldst.ldg_nc_bf16_run(norm_w + Int64(pass_start(lane, lanes)) * 2, s)
    return ([rope.norm_weight(w, offset) for w in w1], [rope.norm_weight(w, offset) for w in w2],
            [rope.norm_weight(w, offset) for w in wp])


def prefetch_tokens(slot_mapping, cos_sin, positions, rank, warp, lane, m, num_slots, *,
                    lanes: EpilogueLanes, warps: int, token_iters: int, tok0=None):
    """Per token this warp finishes (``tok0 + warp + it warps``; ``tok0`` None:
    0): ``(slot,)`` or, with RoPE (``cos_sin`` not
    None: fp32 ``[max_pos, R]`` cos | sin), ``(slot, cos[P], sin[P])`` of the
    lane's pairs (table columns [P l, P l + P) and R/2 + those). Issued right
    after the grid-dependency wait so they land during the GEMV; loads happen
    only in rank 0 and for tokens < M (predicated, no branches)."""
    e, r = lanes.pair_e, lanes.rope_dim
    lp = _clamp(lane, lanes.pair_lanes)
    is_rank0 = Int32(rank == 0)
    out = []
    for it in range(token_iters):
        n = warp + it * warps if tok0 is None else tok0 + warp + it * warps
        has_slot = is_rank0 * Int32(n < num_slots)
        slot = ldst.ldg_i64_pred(slot_mapping.iterator.toint() + Int64(n) * 8, has_slot, Int64(-1))
        if cos_sin is None:
            out.append((slot,))
            continue
        live = is_rank0 * Int32(n < m)
        pos = ldst.ldg_i64_pred(positions.iterator.toint() + Int64(n) * 8, live, Int64(0))
        cs = cos_sin.iterator.toint() + (pos * r + Int64(lp * e)) * 4
        out.append((slot, ldst.ldg_f32_run(cs, e, live), ldst.ldg_f32_run(cs + r // 2 * 4, e, live)))
    return out


@dataclass(frozen=True)
class KvPages:
    """The paged KV cache the epilogue writes, k and v views alike: ``[blocks,
    block_size, kv_heads, D]`` with runtime strides in elements (last stride
    1) of ``elem_bytes``-byte elements (the rendered flintgen.layout KVDtype:
    bf16 2, fp8 e4m3 1, ``fp8`` True). Built once per kernel from its
    launch arguments (k_cache's strides: the host checks v_cache's match)."""

    block_size: Int32
    stride_block: Int64
    stride_token: Int64
    stride_head: Int64
    elem_bytes: cutlass.Constexpr[int]
    fp8: cutlass.Constexpr[bool]

    def row(self, slot):
        """Element offset of a slot's token row (``blk * stride_block + off *
        stride_token``), or -1 for a negative slot: branch-free, so a group's
        64-bit divisions overlap."""
        live = Int64(Int32(slot >= Int64(0)))
        s = slot * live
        blk = s // Int64(self.block_size)
        row = blk * self.stride_block + (s - blk * Int64(self.block_size)) * self.stride_token
        return row * live + (live - Int64(1))

    @cute.jit
    def addr(self, cache: cute.Tensor, row: Int64, kv_head: Int32, d: Int32) -> Int64:
        """Address of element d of a token's row (``row``) in ``cache``, or 0
        when the token has no slot (past slot_mapping, or a negative slot)."""
        addr = Int64(0)
        if row >= Int64(0):
            addr = cache.iterator.toint() + (row + Int64(kv_head) * self.stride_head + Int64(d)) * self.elem_bytes
        return addr


@cute.jit
def _store_run(dst, words, e: cutlass.Constexpr[int], eb: cutlass.Constexpr[int]):
    """``e`` elements at ``dst``: bf16 words (``eb`` 2) or e4m3 bytes (``eb`` 1)."""
    if cutlass.const_expr(eb == 1):
        kv_quant.stg_bytes_run(dst, words, e)
    else:
        ldst.stg_words_run(dst, words, e)


def _e4m3_head(o1, o2, op, scale, fast: bool, lanes: EpilogueLanes):
    """The lane's bf16 words of a k row (``finish_qk``) as e4m3 words of
    value / ``scale`` (a ``kv_quant.Scale``; ``kv_quant.e4m3_run``), same runs."""
    p, s = lanes.pair_e, lanes.pass_e
    if lanes.interleaved:
        k1 = kv_quant.e4m3_run(kv_quant.bf16_words_to_f32(o1, 2 * p), scale, fast)
        k2 = None
    else:
        k1 = kv_quant.e4m3_run(kv_quant.bf16_words_to_f32(o1, p), scale, fast)
        k2 = kv_quant.e4m3_run(kv_quant.bf16_words_to_f32(o2, p), scale, fast)
    kp = kv_quant.e4m3_run(kv_quant.bf16_words_to_f32(op, s), scale, fast) if s else None
    return k1, k2, kp


@cute.jit
def _store_pairs(dst, o1, o2, lanes: cutlass.Constexpr, eb: cutlass.Constexpr[int]):
    """The lane's rotary run(s) at ``dst`` (element ``pair_start``): NeoX two
    runs of P (+ R/2 for the second), interleaved one run of 2P."""
    if cutlass.const_expr(lanes.interleaved):
        _store_run(dst, o1, 2 * lanes.pair_e, eb)
    else:
        _store_run(dst, o1, lanes.pair_e, eb)
        _store_run(dst + lanes.rope_dim // 2 * eb, o2, lanes.pair_e, eb)


@cute.jit
def _store_head(dst, o1, o2, op, lane, d, dp, lanes: cutlass.Constexpr, eb: cutlass.Constexpr[int]):
    """Store the lane's words of one head row (``eb``-byte elements: bf16
    words, or e4m3 bytes from ``_e4m3_head``), ``dst`` = address of its
    element ``d`` (``pair_start``); ``dp`` = ``pass_start``. Inactive lanes
    store nothing."""
    if cutlass.const_expr(lanes.pair_lanes == 32):
        _store_pairs(dst, o1, o2, lanes, eb)
    else:
        if lane < lanes.pair_lanes:
            _store_pairs(dst, o1, o2, lanes, eb)
    if cutlass.const_expr(lanes.pass_e > 0):
        dst_p = dst + Int64(dp - d) * eb
        if cutlass.const_expr(lanes.pass_lanes == 32):
            _store_run(dst_p, op, lanes.pass_e, eb)
        else:
            if lane < lanes.pass_lanes:
                _store_run(dst_p, op, lanes.pass_e, eb)


def _store_e4m3_head(dst, o1, o2, op, scale, fast: bool, lane, d, dp, lanes: EpilogueLanes):
    """``_store_head`` of a k row's e4m3 bytes (``_e4m3_head``)."""
    k1, k2, kp = _e4m3_head(o1, o2, op, scale, fast, lanes)
    _store_head(dst, k1, k2, kp, lane, d, dp, lanes, 1)


def _store_e4m3_v(dst, x1, x2, scale, fast: bool, e: int, half: int):
    """A v lane's two runs of ``e`` values (elements d and d + D/2, ``dst``
    = element d's address) as e4m3 bytes."""
    _store_run(dst, kv_quant.e4m3_run(x1, scale, fast), e, 1)
    _store_run(dst + half, kv_quant.e4m3_run(x2, scale, fast), e, 1)


@cute.jit
def finish_qk(
    head_rows,
    norm_w,
    qk_eps,
    tok,
    q: cute.Tensor,
    k_cache: cute.Tensor,
    kv_scale,
    pages: KvPages,
    head: Int32,
    warp: Int32,
    lane: Int32,
    m: Int32,
    q_heads: cutlass.Constexpr[int],
    warps: cutlass.Constexpr[int],
    token_iters: cutlass.Constexpr[int],
    has_qk_norm: cutlass.Constexpr[bool],
    has_rope: cutlass.Constexpr[bool],
    lanes: cutlass.Constexpr,
    tok0=None,
):
    """q or k head: optional per-head RMSNorm over all D dims (``norm_w`` =
    ``load_norm_weights``), optional RoPE of the rotary pairs (cos / sin in
    ``tok``), one bf16 rounding; q to ``q``, k to its slot of ``pages`` (fp8:
    those bf16 values / ``kv_scale``, a ``kv_quant.Scale``, as e4m3; else
    the bf16 words, ``kv_scale`` None).
    Warp w takes tokens ``tok0 + w + it warps`` (``tok0`` None: 0), rows of
    ``head_rows`` that hold the tokens' values from ``tok0`` on."""
    head_dim = lanes.head_dim
    e = lanes.pair_e
    half = lanes.rope_dim // 2
    d = pair_start(lane, lanes)
    dp = None
    if cutlass.const_expr(lanes.pass_e > 0):
        dp = pass_start(lane, lanes)
    # Tokens in groups: the values of every token of a group first (no branch: a token >= M reads
    # row min(n, M - 1) and is not stored), then the group's stores of tokens < M. More than two
    # tokens per warp (the streaming design's 32 / 64-token tiles) form one group, so the tokens'
    # reductions and RoPE overlap; up to two go one at a time (the cluster design's registers).
    group = token_iters if token_iters > 2 else 1
    for g0 in cutlass.range_constexpr(0, token_iters, group):
        outs = []
        for it in cutlass.range_constexpr(g0, g0 + group):
            if cutlass.const_expr(tok0 is None):
                n = cutlass.max(cutlass.min(warp + it * warps, m - 1), 0)
            else:   # a token past M reads a row of this slice
                n = cutlass.max(cutlass.min(tok0 + warp + it * warps, m - 1), tok0)
            row = ptx.smem_addr(head_rows) + Int32(n * head_dim * 2)
            if cutlass.const_expr(lanes.interleaved):
                x1, x2 = rope.deinterleave(ldst.lds_bf16_run(row + d * 2, 2 * e))
            else:
                x1 = ldst.lds_bf16_run(row + d * 2, e)
                x2 = ldst.lds_bf16_run(row + (d + half) * 2, e)
            xp = []
            if cutlass.const_expr(lanes.pass_e > 0):
                xp = ldst.lds_bf16_run(row + dp * 2, lanes.pass_e)
            if cutlass.const_expr(has_qk_norm):
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(e):
                    ss = ss + x1[i] * x1[i] + x2[i] * x2[i]
                if cutlass.const_expr(lanes.pair_lanes < 32):
                    ss = ptx.select_f32(Int32(lane < lanes.pair_lanes), ss, Float32(0.0))
                if cutlass.const_expr(lanes.pass_e > 0):
                    sp = Float32(0.0)
                    for i in cutlass.range_constexpr(lanes.pass_e):
                        sp = sp + xp[i] * xp[i]
                    if cutlass.const_expr(lanes.pass_lanes < 32):
                        sp = ptx.select_f32(Int32(lane < lanes.pass_lanes), sp, Float32(0.0))
                    ss = ss + sp
                rstd = rope.rms_scale(warp_sum(ss), 1.0 / head_dim, qk_eps)
                for i in cutlass.range_constexpr(e):
                    x1[i] = x1[i] * rstd * norm_w[0][i]
                    x2[i] = x2[i] * rstd * norm_w[1][i]
                for i in cutlass.range_constexpr(lanes.pass_e):
                    xp[i] = xp[i] * rstd * norm_w[2][i]
            if cutlass.const_expr(has_rope):
                c = tok[it][1]
                s = tok[it][2]
                for i in cutlass.range_constexpr(e):
                    x1[i], x2[i] = rope.rope_neox(x1[i], x2[i], c[i], s[i])
            o2 = None
            if cutlass.const_expr(lanes.interleaved):
                o1 = ldst.pack_bf16_run(rope.interleave(x1, x2))
            else:
                o1 = ldst.pack_bf16_run(x1)
                o2 = ldst.pack_bf16_run(x2)
            op = None
            if cutlass.const_expr(lanes.pass_e > 0):
                op = ldst.pack_bf16_run(xp)
            outs.append((o1, o2, op))
        # the k head's cache rows (a 64-bit division per token, independent of each other); q heads skip them
        krows = cute.make_rmem_tensor((group,), Int64)
        for i in cutlass.range_constexpr(group):
            krows[i] = Int64(-1)
        if head >= q_heads:
            for it in cutlass.range_constexpr(g0, g0 + group):
                krows[it - g0] = pages.row(tok[it][0])
        for it in cutlass.range_constexpr(g0, g0 + group):
            n = warp + it * warps if tok0 is None else tok0 + warp + it * warps
            o1, o2, op = outs[it - g0]
            krow = krows[it - g0]
            if n < m:
                if head < q_heads:
                    dst = q.iterator.toint() + (Int64(n) * (q_heads * head_dim) + Int64(head * head_dim + d)) * Q_EB
                    _store_head(dst, o1, o2, op, lane, d, dp, lanes, Q_EB)
                else:
                    dst = pages.addr(k_cache, krow, head - q_heads, d)
                    if dst != Int64(0):
                        if cutlass.const_expr(pages.fp8):
                            if kv_scale.fast():   # uniform: the same scale in every thread
                                _store_e4m3_head(dst, o1, o2, op, kv_scale, True, lane, d, dp, lanes)
                            else:
                                _store_e4m3_head(dst, o1, o2, op, kv_scale, False, lane, d, dp, lanes)
                        else:
                            _store_head(dst, o1, o2, op, lane, d, dp, lanes, pages.elem_bytes)


@cute.jit
def finish_v(
    head_rows,
    tok,
    v_cache: cute.Tensor,
    kv_scale,
    pages: KvPages,
    kv_head: Int32,
    warp: Int32,
    lane: Int32,
    m: Int32,
    warps: cutlass.Constexpr[int],
    token_iters: cutlass.Constexpr[int],
    lanes: cutlass.Constexpr,
    tok0=None,
):
    """v head: the rows' bits go to the slot of ``pages`` unchanged (fp8:
    their values / ``kv_scale``, a ``kv_quant.Scale``, as e4m3); lane l <
    v_lanes owns [E l, E l + E) and [D/2 + E l, ..) (E = v_e). Tokens as
    ``finish_qk``'s."""
    head_dim = lanes.head_dim
    e = lanes.v_e
    half = head_dim // 2
    d = _clamp(lane, lanes.v_lanes) * e
    for it in cutlass.range_constexpr(token_iters):
        n = warp + it * warps if tok0 is None else tok0 + warp + it * warps
        if n < m:
            row = ptx.smem_addr(head_rows) + Int32(n * head_dim * 2)
            if cutlass.const_expr(pages.fp8):
                w1 = ldst.lds_bf16_run(row + d * 2, e)             # Float32 values, converted below
                w2 = ldst.lds_bf16_run(row + (d + half) * 2, e)
            else:
                w1 = ldst.lds_words_run(row + d * 2, e)
                w2 = ldst.lds_words_run(row + (d + half) * 2, e)
            dst = pages.addr(v_cache, pages.row(tok[it][0]), kv_head, d)
            if cutlass.const_expr(lanes.v_lanes < 32):
                if lane >= lanes.v_lanes:
                    dst = Int64(0)
            if dst != Int64(0):
                if cutlass.const_expr(pages.fp8):
                    if kv_scale.fast():   # uniform: the same scale in every thread
                        _store_e4m3_v(dst, w1, w2, kv_scale, True, e, half)
                    else:
                        _store_e4m3_v(dst, w1, w2, kv_scale, False, e, half)
                else:
                    _store_run(dst, w1, e, pages.elem_bytes)
                    _store_run(dst + half * pages.elem_bytes, w2, e, pages.elem_bytes)
