"""Paged KV pages for decode attention: bulk-copy issue and mma fragments.

Provenance: the hand-written Flint decode kernel (shared/seeds/000_*.txt),
``issue`` and ``load_page``, split out as free functions.

Cache layout (HND, bf16)::

    kv[block, kv_head, token, 0:128]    K
    kv[block, kv_head, token, 128:256]  V

One page of one kv head is 16 tokens x 512 B = 8 KB, contiguous (token
stride 256 elements), so one 1-D bulk copy (TMA) moves it into a ring slot
whose bytes keep that layout: ``slot + token * 512 + dim * 2`` (K),
``slot + 256 + token * 512 + dim * 2`` (V).

Lane ``(g, t) = (lane // 4, lane % 4)`` fragments after ``load_page``
(64 x u32 = 128 bf16 per lane)::

    frag[16 r + 4 i + j]           K token g + 8 r, dims 32 i + 8 t + 2 j, +1
                                   (r < 2, i < 4, j < 4)
    frag[32 + 8 r + 4 h + j]       V token 2 t + r % 2 + 8 (r // 2),
                                   dims 64 h + 8 g + 2 j, +1   (r < 4, h < 2)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from flintgen.device import ptx
from flintgen.device.attn_ptx import selp_u32

PAGE = 16
HEAD_DIM = 128
ROW_BYTES = 2 * HEAD_DIM * 2       # one token: K | V, bf16
PAGE_BYTES = PAGE * ROW_BYTES      # 8 KB


@cute.jit
def issue_page(kv_head, page_stride, blk, dst, mbar, lane):
    """Lane 0 bulk-copies page ``blk`` of this kv head into the slot at shared
    address ``dst``, completing 8 KB on ``mbar``.

    ``kv_head``: global byte address of ``kv[0, kv_head]``; ``page_stride``:
    bytes between blocks (``kv.stride(0) * 2``); ``blk``: block id (Uint32).
    """
    if lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(mbar, PAGE_BYTES)
        ptx.bulk_copy_g2s(
            dst, kv_head + Int64(blk) * page_stride, ptx.smem_addr(mbar), Int32(PAGE_BYTES)
        )


@cute.jit
def block_ids(bt_warp, stride_pages, first, n_w, lane):
    """Block ids of this warp's pages ``first + lane`` (lane < 32): lane ``l``
    holds the block of the warp's page number ``first + l``, 0 past ``n_w``.

    ``bt_warp``: byte address of the block-table entry of the warp's page 0;
    consecutive warp pages are ``stride_pages`` entries apart.
    """
    k = first + lane
    return ptx.ldg_u32_pred(bt_warp + Int64(stride_pages * k) * 4, Int32(k < n_w))


@cute.jit
def load_page(frag, slot, page, start_tok, seq_len, g, t):
    """Fill ``frag`` (64 x Uint32, layout in the module docstring) from the
    ring slot at shared address ``slot`` holding page number ``page``.

    V rows of tokens outside ``[start_tok, seq_len)`` are zeroed: their
    probabilities are 0, but stale cache contents (NaN, Inf) would still turn
    0 * V into NaN in P V. Masked K rows need nothing: their scores are
    replaced by -inf.
    """
    for r in cutlass.range_constexpr(2):
        for i in cutlass.range_constexpr(4):
            w = ptx.lds_u32x4(slot + (g + 8 * r) * ROW_BYTES + (32 * i + 8 * t) * 2)
            for j in cutlass.range_constexpr(4):
                frag[16 * r + 4 * i + j] = w[j]
    vbase = slot + HEAD_DIM * 2
    for r in cutlass.range_constexpr(4):
        tok = 2 * t + (r % 2) + 8 * (r // 2)
        for h in cutlass.range_constexpr(2):
            w = ptx.lds_u32x4(vbase + tok * ROW_BYTES + (64 * h + 8 * g) * 2)
            for j in cutlass.range_constexpr(4):
                frag[32 + 8 * r + 4 * h + j] = w[j]
    p0 = page * PAGE
    if (p0 < start_tok) | (p0 + PAGE > seq_len):
        zero = Uint32(0)
        for r in cutlass.range_constexpr(4):
            pos = p0 + 2 * t + (r % 2) + 8 * (r // 2)
            ok = Int32((pos >= start_tok) & (pos < seq_len))
            for j in cutlass.range_constexpr(8):
                frag[32 + 8 * r + j] = selp_u32(frag[32 + 8 * r + j], zero, ok)
