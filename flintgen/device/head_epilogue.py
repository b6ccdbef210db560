"""Per-head epilogue of the fused QKV GEMV (rank 0 of each head's cluster).

Provenance: written for flintgen's fused QKV GEMV.

Rank 0 holds the head's bf16 rows ``head_rows[token][d]`` ([8, D] in shared
memory, gathered from the cluster through DSMEM). Warp ``w`` finishes tokens
``w, w + warps, ...`` (< M); lane ``l`` owns the ``E = D / 64`` elements
``[E l, E l + E)`` and their NeoX partners ``+ D/2``::

    q head: q[n, h D + d]             = rope(rms_norm(row, q_norm_weight))   (as configured)
    k head: k_cache[slot(n)][kv, d]   = rope(rms_norm(row, k_norm_weight))
    v head: v_cache[slot(n)][kv, d]   = row                                  (bits copied)

``slot(n)`` is ``slot_mapping[n]`` for ``n < len(slot_mapping)``, else -1; a
negative slot writes nothing. Cache views are ``[blocks, block_size, kv_heads,
D]`` with runtime strides (element units, last stride 1) of bf16 elements
(``KV_EB`` bytes, flintgen/layout.py): k and v rows are stored as the bf16
words they are computed in.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from flintgen.device import ldst, ptx, rope
from flintgen.device.reduce import warp_sum
from flintgen.layout import kv_dtype

KV_EB = kv_dtype("bf16").elem_bytes  # bytes per cache element: the rows below are bf16 words


def prefetch_tokens(slot_mapping, cos_sin, positions, rank, warp, lane, m, num_slots, *,
                    head_dim: int, warps: int, token_iters: int):
    """Per token this warp finishes: ``(slot,)`` or, with RoPE (``cos_sin`` not
    None), ``(slot, cos[E], sin[E])`` of the lane's elements. Issued right
    after the grid-dependency wait so they land during the GEMV; loads happen
    only in rank 0 and for tokens < M (predicated, no branches)."""
    e = head_dim // 64
    is_rank0 = Int32(rank == 0)
    out = []
    for it in range(token_iters):
        n = warp + it * warps
        has_slot = is_rank0 * Int32(n < num_slots)
        slot = ldst.ldg_i64_pred(slot_mapping.iterator.toint() + Int64(n) * 8, has_slot, Int64(-1))
        if cos_sin is None:
            out.append((slot,))
            continue
        live = is_rank0 * Int32(n < m)
        pos = ldst.ldg_i64_pred(positions.iterator.toint() + Int64(n) * 8, live, Int64(0))
        cs = cos_sin.iterator.toint() + (pos * head_dim + Int64(lane * e)) * 4
        out.append((slot, ldst.ldg_f32_run(cs, e, live), ldst.ldg_f32_run(cs + head_dim // 2 * 4, e, live)))
    return out


@cute.jit
def cache_addr(cache: cute.Tensor, slot: Int64, kv_head: Int32, d: Int32, block_size: Int32,
               stride_block: Int64, stride_token: Int64, stride_head: Int64) -> Int64:
    """Address of element d of a token's row in a cache view, or 0 when the
    token has no slot (past slot_mapping, or a negative slot)."""
    addr = Int64(0)
    if slot >= Int64(0):
        blk = slot // Int64(block_size)
        off = slot - blk * Int64(block_size)
        addr = cache.iterator.toint() + (
            blk * stride_block + off * stride_token + Int64(kv_head) * stride_head + Int64(d)) * KV_EB
    return addr


@cute.jit
def finish_qk(
    head_rows,
    norm_w,
    qk_eps,
    tok,
    q: cute.Tensor,
    k_cache: cute.Tensor,
    head: Int32,
    warp: Int32,
    lane: Int32,
    m: Int32,
    block_size: Int32,
    stride_block: Int64,
    stride_token: Int64,
    stride_head: Int64,
    head_dim: cutlass.Constexpr[int],
    q_heads: cutlass.Constexpr[int],
    warps: cutlass.Constexpr[int],
    token_iters: cutlass.Constexpr[int],
    has_qk_norm: cutlass.Constexpr[bool],
    has_rope: cutlass.Constexpr[bool],
):
    """q or k head: optional per-head RMSNorm (``norm_w`` = the lane's
    (first-half, second-half) weights as fp32), optional RoPE (cos / sin in
    ``tok``), one bf16 rounding; q to ``q``, k to its cache slot."""
    e = head_dim // 64
    half = head_dim // 2
    d = lane * e
    for it in cutlass.range_constexpr(token_iters):
        n = warp + it * warps
        if n < m:
            row = ptx.smem_addr(head_rows) + Int32(n * head_dim * 2)
            x1 = ldst.lds_bf16_run(row + d * 2, e)
            x2 = ldst.lds_bf16_run(row + (d + half) * 2, e)
            if cutlass.const_expr(has_qk_norm):
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(e):
                    ss = ss + x1[i] * x1[i] + x2[i] * x2[i]
                rstd = rope.rms_scale(warp_sum(ss), 1.0 / head_dim, qk_eps)
                for i in cutlass.range_constexpr(e):
                    x1[i] = x1[i] * rstd * norm_w[0][i]
                    x2[i] = x2[i] * rstd * norm_w[1][i]
            if cutlass.const_expr(has_rope):
                c = tok[it][1]
                s = tok[it][2]
                for i in cutlass.range_constexpr(e):
                    x1[i], x2[i] = rope.rope_neox(x1[i], x2[i], c[i], s[i])
            o1 = ldst.pack_bf16_run(x1)
            o2 = ldst.pack_bf16_run(x2)
            if head < q_heads:
                dst = q.iterator.toint() + (Int64(n) * (q_heads * head_dim) + Int64(head * head_dim + d)) * 2
                ldst.stg_words_run(dst, o1, e)
                ldst.stg_words_run(dst + half * 2, o2, e)
            else:
                dst = cache_addr(k_cache, tok[it][0], head - q_heads, d, block_size, stride_block,
                                 stride_token, stride_head)
                if dst != Int64(0):
                    ldst.stg_words_run(dst, o1, e)
                    ldst.stg_words_run(dst + half * 2, o2, e)


@cute.jit
def finish_v(
    head_rows,
    tok,
    v_cache: cute.Tensor,
    kv_head: Int32,
    warp: Int32,
    lane: Int32,
    m: Int32,
    block_size: Int32,
    stride_block: Int64,
    stride_token: Int64,
    stride_head: Int64,
    head_dim: cutlass.Constexpr[int],
    warps: cutlass.Constexpr[int],
    token_iters: cutlass.Constexpr[int],
):
    """v head: the rows' bits go to the cache slot unchanged."""
    e = head_dim // 64
    half = head_dim // 2
    d = lane * e
    for it in cutlass.range_constexpr(token_iters):
        n = warp + it * warps
        if n < m:
            row = ptx.smem_addr(head_rows) + Int32(n * head_dim * 2)
            w1 = ldst.lds_words_run(row + d * 2, e)
            w2 = ldst.lds_words_run(row + (d + half) * 2, e)
            dst = cache_addr(v_cache, tok[it][0], kv_head, d, block_size, stride_block, stride_token,
                             stride_head)
            if dst != Int64(0):
                ldst.stg_words_run(dst, w1, e)
                ldst.stg_words_run(dst + half * 2, w2, e)
