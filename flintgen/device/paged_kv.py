"""Paged KV slices for decode attention: bulk-copy issue and mma fragments.

Provenance: the hand-written Flint decode kernel (shared/seeds/000_*.txt),
``issue`` and ``load_page``, split out as free functions and generalized over
head_dim ``D`` (64, 96, 128, 256) and the cache page size (16, 32, 64 tokens).

Cache layout (HND, bf16: ``EB`` = 2 bytes per element; the numbers and
shapes live in flintgen/layout.py), ``PAGE`` tokens per block::

    kv[block, kv_head, token, 0:D]     K
    kv[block, kv_head, token, D:2D]    V

The streaming unit is a *slice* of SLICE_TOKENS = 16 tokens (the mma's M):
16 x 2D x EB bytes, 8 KB at D = 128, 4 KB at D = 64. One (block, kv head)
page is PAGE x 2D contiguous elements, so a page of 32 or 64 tokens is 2 or
4 consecutive slices: slice ``s`` of a sequence lives in block
``block_tables[s // SPP]`` at byte offset ``(s % SPP) * slice_bytes``
(SPP = PAGE // 16). One 1-D bulk copy (TMA) moves a slice into a ring slot
whose bytes keep that layout: ``slot + token * 2D EB + dim * EB`` (K),
``slot + D EB + token * 2D EB + dim * EB`` (V).

Lane ``(g, t) = (lane // 4, lane % 4)`` fragments after ``load_page``
(D / 2 x u32 = D bf16 per lane; KO = D / 8, VO = D / 4, VR = D / 16)::

    frag[KO r + 4 i + j]           K token g + 8 r, dims 32 i + 8 t + 2 j, +1
                                   (r < 2, i < D / 32, j < 4)
    frag[VO + VR r + 4 h + j]      V token 2 t + r % 2 + 8 (r // 2),
                                   dims 64 h + 8 g + 2 j, +1   (r < 4, h < D / 64)
    frag[VO + VR r + 4 h + j]      the trailing 32 dims of D = 96 (h = 1):
                                   dims 64 + 4 g + 2 j, +1     (j < 2)

head_dim 256 holds K and V in turn (``load_k``, then ``load_v`` into the same
D / 4 words once the scores are done): D / 2 words of both would not leave
room for the accumulators in 255 registers.

At D = 128 that is ``frag[16 r + 4 i + j]`` and ``frag[32 + 8 r + 4 h + j]``.

fp8 e4m3 cache (``FP8``: 1 byte per element, the same HND layout; the ring
slot holds the slice's bytes as they are, ``slot + token * 2D + dim``): the
fragments above are the same words as f16 pairs, converted from the e4m3
bytes as they are loaded (``attn_ptx.e4m3x4_to_f16x2x2``, exact): a K
group of 8 dims is one 8-byte load (2 words of 4 e4m3 -> 4 f16x2 words),
a V 64-dim group's 8 dims one 8-byte load, the trailing 32-dim group's 4
dims (D = 96) one 4-byte load. Registers and the mma side are those of
bf16 (the f16 mma, ``decode_mma``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from flintgen.device import ptx
from flintgen.device.attn_ptx import e4m3x4_to_f16x2x2, lds_u32, lds_u32x2, selp_u32
from flintgen.layout import SLICE_TOKENS, kv_dtype

# The fragments below are 16-bit pairs (one u32 = 2 elements): bf16 from a
# bf16 cache, f16 converted from an e4m3 one (``FP8``, EB8 bytes per element).
EB = kv_dtype("bf16").elem_bytes
EB8 = kv_dtype("fp8_e4m3").elem_bytes


@cute.jit
def issue_page(kv_head, page_stride, blk, dst, mbar, lane, NBYTES: cutlass.Constexpr,
               EVICT_FIRST: cutlass.Constexpr = False):
    """Lane 0 bulk-copies the slice at ``kv_head + blk * page_stride`` into
    the slot at shared address ``dst``, completing ``NBYTES`` on ``mbar``;
    ``EVICT_FIRST``: read with the L2 evict-first policy (each slice is read
    once per launch).

    ``kv_head``: global byte address of ``kv[0, kv_head]`` (plus the slice's
    offset inside its page when pages hold several slices); ``page_stride``:
    bytes between blocks (``kv.stride(0) * 2``); ``blk``: block id (Uint32).
    """
    if lane == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(mbar, NBYTES)
        policy = None
        if cutlass.const_expr(EVICT_FIRST):
            policy = ptx.evict_first_policy()
        ptx.bulk_copy_g2s(
            dst, kv_head + Int64(blk) * page_stride, ptx.smem_addr(mbar), Int32(NBYTES), policy
        )


@cute.jit
def block_ids(bt_warp, stride_pages, first, n_w, lane):
    """Block ids of this warp's slices ``first + lane`` (lane < 32) when every
    slice is a whole page (16-token pages): lane ``l`` holds the block of the
    warp's slice number ``first + l``, 0 past ``n_w``.

    ``bt_warp``: byte address of the block-table entry of the warp's slice 0;
    consecutive warp slices are ``stride_pages`` entries apart.
    """
    k = first + lane
    return ptx.ldg_u32_pred(bt_warp + Int64(stride_pages * k) * 4, Int32(k < n_w))


@cute.jit
def block_ids_sliced(bt_row, slice0, stride, first, n_w, lane, SPP: cutlass.Constexpr):
    """``block_ids`` for pages of ``SPP`` > 1 slices: lane ``l`` holds the
    block of the warp's slice number ``k = first + l``, i.e. of sequence slice
    ``slice0 + stride * k``: table entry ``(slice0 + stride * k) // SPP``.

    ``bt_row``: byte address of ``block_tables[b, 0]``. Neighbouring lanes
    often read the same entry (stride < SPP); those loads coalesce.
    """
    k = first + lane
    entry = (slice0 + stride * k) // SPP
    return ptx.ldg_u32_pred(bt_row + Int64(entry) * 4, Int32(k < n_w))


@cute.jit
def load_k(frag, slot, g, t, D: cutlass.Constexpr, FP8: cutlass.Constexpr = False):
    """K fragments of the slice in the ring slot at shared address ``slot``:
    ``frag[KO r + 4 i + j]`` (D / 4 x Uint32, layout in the module docstring;
    ``FP8``: f16 pairs converted from an e4m3 slice)."""
    KO = D // 8
    if cutlass.const_expr(FP8):
        ROW8 = 2 * D * EB8
        for r in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(D // 32):
                w = lds_u32x2(slot + (g + 8 * r) * ROW8 + (32 * i + 8 * t) * EB8)
                for u in cutlass.range_constexpr(2):
                    lo, hi = e4m3x4_to_f16x2x2(w[u])
                    frag[KO * r + 4 * i + 2 * u] = lo
                    frag[KO * r + 4 * i + 2 * u + 1] = hi
    else:
        ROW = 2 * D * EB    # one token's K | V row
        for r in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(D // 32):
                w = ptx.lds_u32x4(slot + (g + 8 * r) * ROW + (32 * i + 8 * t) * EB)
                for j in cutlass.range_constexpr(4):
                    frag[KO * r + 4 * i + j] = w[j]


@cute.jit
def load_v(frag, VO: cutlass.Constexpr, slot, slc, start_tok, seq_len, g, t, D: cutlass.Constexpr,
           FP8: cutlass.Constexpr = False):
    """V fragments of slice ``slc`` (tokens ``16 slc ..``) in the ring slot at
    ``slot``: ``frag[VO + VR r + j]`` (D / 4 x Uint32 from ``VO``; word ``j``
    of a token holds dims ``decode_mma.pv_dims(j, D)``). A 64-dim group is one
    16-byte load per token (dims ``64 h + 8 g ..``), a trailing 32-dim group
    (head_dim 96) one 8-byte load (dims ``64 h + 4 g ..``).

    V rows of tokens outside ``[start_tok, seq_len)`` are zeroed: their
    probabilities are 0, but stale cache contents (NaN, Inf) would still turn
    0 * V into NaN in P V. Masked K rows need nothing: their scores are
    replaced by -inf.
    """
    VR = D // 16
    if cutlass.const_expr(FP8):
        # e4m3: 8 bytes (4-byte for the trailing 32-dim group) per token and
        # group, converted to the same f16 words.
        ROW8 = 2 * D * EB8
        vbase8 = slot + D * EB8
        for r in cutlass.range_constexpr(4):
            tok = 2 * t + (r % 2) + 8 * (r // 2)
            for h in cutlass.range_constexpr(D // 64):
                w = lds_u32x2(vbase8 + tok * ROW8 + (64 * h + 8 * g) * EB8)
                for u in cutlass.range_constexpr(2):
                    lo, hi = e4m3x4_to_f16x2x2(w[u])
                    frag[VO + VR * r + 4 * h + 2 * u] = lo
                    frag[VO + VR * r + 4 * h + 2 * u + 1] = hi
            if cutlass.const_expr(D % 64):
                h = D // 64
                lo, hi = e4m3x4_to_f16x2x2(lds_u32(vbase8 + tok * ROW8 + (64 * h + 4 * g) * EB8))
                frag[VO + VR * r + 4 * h] = lo
                frag[VO + VR * r + 4 * h + 1] = hi
    else:
        ROW = 2 * D * EB
        vbase = slot + D * EB
        for r in cutlass.range_constexpr(4):
            tok = 2 * t + (r % 2) + 8 * (r // 2)
            for h in cutlass.range_constexpr(D // 64):
                w = ptx.lds_u32x4(vbase + tok * ROW + (64 * h + 8 * g) * EB)
                for j in cutlass.range_constexpr(4):
                    frag[VO + VR * r + 4 * h + j] = w[j]
            if cutlass.const_expr(D % 64):
                h = D // 64
                w2 = lds_u32x2(vbase + tok * ROW + (64 * h + 4 * g) * EB)
                for j in cutlass.range_constexpr(2):
                    frag[VO + VR * r + 4 * h + j] = w2[j]
    p0 = slc * SLICE_TOKENS
    if (p0 < start_tok) | (p0 + SLICE_TOKENS > seq_len):
        zero = Uint32(0)
        for r in cutlass.range_constexpr(4):
            pos = p0 + 2 * t + (r % 2) + 8 * (r // 2)
            ok = Int32((pos >= start_tok) & (pos < seq_len))
            for j in cutlass.range_constexpr(VR):
                frag[VO + VR * r + j] = selp_u32(frag[VO + VR * r + j], zero, ok)


@cute.jit
def load_page(frag, slot, slc, start_tok, seq_len, g, t, D: cutlass.Constexpr, FP8: cutlass.Constexpr = False):
    """Fill ``frag`` (D / 2 x Uint32: K from 0, V from D / 4) from the ring
    slot at shared address ``slot`` holding sequence slice ``slc``."""
    load_k(frag, slot, g, t, D, FP8)
    load_v(frag, D // 4, slot, slc, start_tok, seq_len, g, t, D, FP8)
