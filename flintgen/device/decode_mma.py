"""One warp's attention over one 16-token slice: S = K q and O += P V with
``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate) and an online softmax.

Provenance: the hand-written Flint decode kernel (shared/seeds/000_*.txt),
``compute``, as a free function, generalized over head_dim ``D`` (64, 96,
128, 256) and head tiles.

The q heads of a kv head are the mma's N = HEAD_TILE = 8 columns, one *tile*
of 8 heads per mma (flintgen/layout.py, ``AttentionLayout``): GQA 8 is one
tile; GQA 4 is one tile whose columns 4..7 have q = 0 (their results are
computed and never stored); GQA 16 is two tiles that share the slice's K/V
fragments. Lane ``(g, t) = (lane // 4, lane % 4)``.

* S^T[token, head] = K Q^T: M = 16 tokens, N = 8 heads, K = D dims in D / 16
  k-steps (D a multiple of 32). Any permutation of the dims works if A and B
  agree: k-step ``c = 2 i + h`` covers dims ``32 i + 8 t' + 4 h + 0..3``
  (t' < 4), which is what 16-byte shared/global loads give each lane. ``qf[QW tile + 4 i + j]``
  (QW = D / 8) = q head 8 tile + g, dims ``32 i + 8 t + 2 j, +1``. Results:
  s0, s1 = token g, heads 2t, 2t+1; s2, s3 = token g + 8.
* Softmax (fp32): p = exp2(s * c - m * c), c = scale * log2(e), m the running
  max of the *unscaled* logits per head (so m0 / l0 belong to head 2t, m1 / l1
  to head 2t + 1 of the tile); l sums the fp32 p, P is rounded to bf16 for P V.
  Soft-capped logits (``softcap``, Gemma 2) are replaced by
  ``cap * tanh(s * scale / cap)`` before masking, so they are already scaled:
  the caller passes c = log2(e) and m is the max of the capped logits.
* O^T[dim, head] += V^T P^T: M = D dims in D / 16 m-tiles, N = 8 heads, K = 16
  tokens. m-tile j, rows g / g + 8 are dims d0 / d0 + 1 with
  ``d0 = 64 (j // 4) + 8 g + 2 (j % 4)`` (the trailing 32 dims of D = 96:
  ``64 + 4 g + 2 (j - 4)``; ``pv_dims``), so with AW = D / 4 accumulators per
  tile ``acc[AW tile + 4 j + 0..3]`` = O[head 2t, d0], O[2t+1, d0],
  O[2t, d0+1], O[2t+1, d0+1].

fp8 e4m3 cache (``F16``; paged_kv's ``FP8`` fragments): the same layouts in
f16 words and ``mma.sync.m16n8k16.f32.f16.f16.f32``. K and V are exact
(e4m3 -> f16); q is converted once per CTA, bf16 -> f16 with ``.satfinite``
(exact for |q| in [2^-14, 65504], saturated to +-65504 beyond, f16
subnormals below: ``attn_ptx.bf16x2_to_f16x2_sat``); P is rounded to f16
(p <= 1: 11 significant bits where bf16 keeps 8; p below 2^-14 keeps an
absolute precision of 2^-25). The per-layer scales are folded outside
(k_scale into the score factor, v_scale into the final normalization), so
the fragments hold the raw e4m3 values.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from flintgen.device import ptx
from flintgen.device.attn_ptx import bf16x2_to_f16x2_sat, f16x2, mma_f16_16816, rcp_approx, selp_f32
from flintgen.layout import HEAD_TILE, SLICE_TOKENS


@cute.jit
def _load_q_head(qf, row, t, base: cutlass.Constexpr, D: cutlass.Constexpr):
    for i in cutlass.range_constexpr(D // 32):
        w = ptx.ldg_u32x4(row + (32 * i + 8 * t) * 2)
        for j in cutlass.range_constexpr(4):
            qf[base + 4 * i + j] = w[j]


@cute.jit
def load_q(qf, q_row, head_bytes, g, t, D: cutlass.Constexpr, GQA: cutlass.Constexpr,
           F16: cutlass.Constexpr = False):
    """Every head tile of one kv head: tile ``tl`` of ``qf`` (D / 8 words from
    ``tl * D / 8``) <- q head ``HEAD_TILE tl + g``, dims ``32 i + 8 t .. +7``
    (``q_row``: byte address of head g; ``head_bytes``: bytes between heads).
    Coherent loads: q is written by the previous kernel. In a tile that GQA
    does not fill (GQA 3: heads 3..7 of tile 0; GQA 12: heads 12..15 of tile 1)
    the lanes of padded heads hold zeros and load nothing: the row past the kv
    head's last q head may lie past the end of q. ``F16``: the bf16 pairs are
    converted to f16 pairs once loaded (``bf16x2_to_f16x2_sat``; zeros stay
    zeros)."""
    for tl in cutlass.range_constexpr(-(-GQA // HEAD_TILE)):
        real = GQA - HEAD_TILE * tl  # heads of this tile that exist
        head = q_row + Int64(HEAD_TILE * tl) * head_bytes
        if cutlass.const_expr(real >= HEAD_TILE):
            _load_q_head(qf, head, t, tl * (D // 8), D)
        else:
            for k in cutlass.range_constexpr(D // 8):
                qf[tl * (D // 8) + k] = Uint32(0)
            if g < real:
                _load_q_head(qf, head, t, tl * (D // 8), D)
    if cutlass.const_expr(F16):
        for k in cutlass.range_constexpr(-(-GQA // HEAD_TILE) * (D // 8)):
            qf[k] = bf16x2_to_f16x2_sat(qf[k])


def pv_dims(j: int, D: int) -> tuple[int, int]:
    """O^T m-tile ``j`` (of D / 16): rows g / g + 8 hold dims ``d0`` / ``d0 + 1``
    with ``d0 = base + stride * g``; returns ``(base, stride)``. Whole 64-dim
    groups: ``d0 = 64 (j // 4) + 8 g + 2 (j % 4)``; the trailing 32 dims of
    D = 96: ``d0 = 64 + 4 g + 2 (j - 4)``. Word ``j`` of a V token row in
    ``paged_kv.load_v``'s fragments holds the same dims."""
    full = D // 64
    if j < 4 * full:
        return 64 * (j // 4) + 2 * (j % 4), 8
    return 64 * full + 2 * (j - 4 * full), 4


def _mma(F16):
    """The m16n8k16 of the fragments' type: f16 (e4m3 cache) or bf16."""
    return mma_f16_16816 if F16 else ptx.mma_bf16_16816


@cute.jit
def slice_scores(frag, qf, acc, slc, start_tok, seq_len, scale_log2, m0, m1, l0, l1, g, t,
                 D: cutlass.Constexpr, TILE: cutlass.Constexpr, softcap=None, F16: cutlass.Constexpr = False):
    """First half of ``attend_page``: S = K q from the K fragments at
    ``frag[0 ..]`` (soft-capped when ``softcap`` is ``(k, cap)``: Float32,
    ``k = 2 log2(e) scale / cap``, ``scale_log2`` then log2(e);
    ``softcap_logit``), the online softmax (running m, l; head tile
    ``TILE``'s accumulators rescaled) and P^T as the B operand of P V
    (``F16``: f16 fragments and P, else bf16).
    Returns ``(m0, m1, l0, l1, b0, b1)``."""
    mma = _mma(F16)
    KO = D // 8
    QO = TILE * (D // 8)
    AO = TILE * (D // 4)
    # Two accumulator chains (even / odd k-steps) halve the mma dependency chain.
    sa = [cutlass.Float32(0.0)] * 4
    sb = [cutlass.Float32(0.0)] * 4
    for c in cutlass.range_constexpr(D // 16):
        i = c // 2
        h = c % 2
        a = (frag[4 * i + 2 * h], frag[KO + 4 * i + 2 * h],
             frag[4 * i + 2 * h + 1], frag[KO + 4 * i + 2 * h + 1])  # fmt: skip
        if cutlass.const_expr(h == 0):
            sa = mma(sa, a, qf[QO + 4 * i + 2 * h], qf[QO + 4 * i + 2 * h + 1])
        else:
            sb = mma(sb, a, qf[QO + 4 * i + 2 * h], qf[QO + 4 * i + 2 * h + 1])
    ninf = ptx.neg_inf()
    pos = slc * SLICE_TOKENS + g
    ok_lo = Int32((pos >= start_tok) & (pos < seq_len))
    ok_hi = Int32((pos + 8 >= start_tok) & (pos + 8 < seq_len))
    s0 = selp_f32(_capped(sa[0] + sb[0], softcap), ninf, ok_lo)
    s1 = selp_f32(_capped(sa[1] + sb[1], softcap), ninf, ok_lo)
    s2 = selp_f32(_capped(sa[2] + sb[2], softcap), ninf, ok_hi)
    s3 = selp_f32(_capped(sa[3] + sb[3], softcap), ninf, ok_hi)

    # Max over the slice's 16 tokens: tokens g live in lanes 4 g + t.
    mx0 = cute.arch.fmax(s0, s2)
    mx1 = cute.arch.fmax(s1, s3)
    for off in cutlass.range_constexpr(3):
        mx0 = cute.arch.fmax(mx0, cute.arch.shuffle_sync_bfly(mx0, 4 << off))
        mx1 = cute.arch.fmax(mx1, cute.arch.shuffle_sync_bfly(mx1, 4 << off))
    # Every slice of the range holds an attended token, so mn is finite and
    # alpha = exp2(-inf) = 0 on the first slice.
    mn0 = cute.arch.fmax(m0, mx0)
    mn1 = cute.arch.fmax(m1, mx1)
    ms0 = mn0 * scale_log2
    ms1 = mn1 * scale_log2
    alpha0 = ptx.ex2(ptx.fma(m0, scale_log2, -ms0))
    alpha1 = ptx.ex2(ptx.fma(m1, scale_log2, -ms1))
    p0 = ptx.ex2(ptx.fma(s0, scale_log2, -ms0))
    p1 = ptx.ex2(ptx.fma(s1, scale_log2, -ms1))
    p2 = ptx.ex2(ptx.fma(s2, scale_log2, -ms0))
    p3 = ptx.ex2(ptx.fma(s3, scale_log2, -ms1))
    l0 = l0 * alpha0 + (p0 + p2)
    l1 = l1 * alpha1 + (p1 + p3)
    for j in cutlass.range_constexpr(D // 16):
        acc[AO + 4 * j] = acc[AO + 4 * j] * alpha0
        acc[AO + 4 * j + 1] = acc[AO + 4 * j + 1] * alpha1
        acc[AO + 4 * j + 2] = acc[AO + 4 * j + 2] * alpha0
        acc[AO + 4 * j + 3] = acc[AO + 4 * j + 3] * alpha1

    # P^T as the B operand: lane (g, t) needs P[head g][tokens 2t, 2t+1] (b0)
    # and [2t+8, 2t+9] (b1). Token 2t's heads 2t', 2t'+1 sit in lane
    # 4 (2t) + t' with t' = g // 2; the half is g % 2.
    pack = f16x2 if F16 else ptx.bf16x2
    x = pack(p0, p1)
    y = pack(p2, p3)
    src = 8 * t + (g >> 1)
    x0 = cute.arch.shuffle_sync(x, src)
    x1 = cute.arch.shuffle_sync(x, src + 4)
    y0 = cute.arch.shuffle_sync(y, src)
    y1 = cute.arch.shuffle_sync(y, src + 4)
    sel = Uint32(0x5410) + Uint32(g & 1) * Uint32(0x7632 - 0x5410)  # low or high halves
    b0 = ptx.prmt(x0, x1, sel)
    b1 = ptx.prmt(y0, y1, sel)
    return mn0, mn1, l0, l1, b0, b1


@cute.jit
def slice_pv(frag, VO: cutlass.Constexpr, acc, b0, b1, D: cutlass.Constexpr, TILE: cutlass.Constexpr,
             F16: cutlass.Constexpr = False):
    """Second half of ``attend_page``: O^T += V^T P^T from the V fragments at
    ``frag[VO ..]`` (word j of a token: dims ``pv_dims(j, D)``; ``F16``: f16)."""
    mma = _mma(F16)
    VR = D // 16
    AO = TILE * (D // 4)
    for j in cutlass.range_constexpr(D // 16):
        va = frag[VO + j]               # V token 2t,   dims d0, d0 + 1
        vb = frag[VO + VR + j]          # V token 2t+1
        vc = frag[VO + 2 * VR + j]      # V token 2t+8
        vd = frag[VO + 3 * VR + j]      # V token 2t+9
        a = (ptx.prmt(va, vb, Uint32(0x5410)), ptx.prmt(va, vb, Uint32(0x7632)),
             ptx.prmt(vc, vd, Uint32(0x5410)), ptx.prmt(vc, vd, Uint32(0x7632)))  # fmt: skip
        r = mma(
            (acc[AO + 4 * j], acc[AO + 4 * j + 1], acc[AO + 4 * j + 2], acc[AO + 4 * j + 3]), a, b0, b1
        )
        for k in cutlass.range_constexpr(4):
            acc[AO + 4 * j + k] = r[k]


@cute.jit
def attend_page(frag, qf, acc, slc, start_tok, seq_len, scale_log2, m0, m1, l0, l1, g, t,
                D: cutlass.Constexpr, TILE: cutlass.Constexpr, softcap=None, F16: cutlass.Constexpr = False):
    """Fold sequence slice ``slc`` (fragments from ``paged_kv.load_page``: K
    from 0, V from D / 4) into head tile ``TILE``'s accumulators and running
    (m, l); returns the new ``(m0, m1, l0, l1)``. ``l`` is this lane's share
    (tokens g, g + 8); the caller sums it over g at the end. ``softcap``: as
    in ``slice_scores``."""
    m0, m1, l0, l1, b0, b1 = slice_scores(frag, qf, acc, slc, start_tok, seq_len, scale_log2, m0, m1, l0, l1,
                                          g, t, D, TILE, softcap, F16)
    slice_pv(frag, D // 4, acc, b0, b1, D, TILE, F16)
    return m0, m1, l0, l1


def _capped(s, softcap):
    """``s``, or ``softcap_logit(s, *softcap)``: chosen while tracing, so
    nothing is emitted without soft-capping."""
    return s if softcap is None else softcap_logit(s, *softcap)


@cute.jit
def softcap_logit(s, k, cap):
    """Gemma 2's soft-capping ``cap * tanh(s * scale / cap)`` of a raw logit
    ``s`` (q . k), with ``k = 2 log2(e) scale / cap`` (host-computed):

        cap tanh(x) = cap - 2 cap / (e^2x + 1),   e^2x = ex2(s k)

    one ``ex2.approx.ftz`` (MUFU.EX2, relative error <= 2 ulp), one
    ``rcp.approx.ftz`` (MUFU.RCP, <= 1 ulp; with the IEEE ``rcp.rn`` some
    variants spilled: ``attn_ptx.rcp_approx``) and an fma. Not
    ``tanh.approx.f32``: its ~2^-11 relative error is ~0.025 of a logit at
    cap 50. The result lies in
    [-cap, cap]: exactly cap once ex2 overflows to inf, -cap once it flushes
    to 0; NaN stays NaN (masked lanes are replaced by -inf afterwards).

    Error (fp32 against fp64 ``cap * tanh(s * scale / cap)`` for the same fp32
    ``s``; s * scale over [-3 cap, 3 cap], near 0 and near +-cap; cap 1..50,
    scale 1 / 16..1; ex2 exact or off by +-2 ulp, the reciprocal by +-1): at
    most 5.3e-7 * cap absolute in the test's sweep (bounded there by 5.5e-7),
    i.e. 2.7e-5 at cap 50 (tests/test_decode_attention_softcap.py,
    ``test_softcap_formula_error``). An absolute logit error is the relative
    error of its softmax weight; near 0 the absolute error stays 1.2e-7 * cap
    (one ulp of 1 in the tanh) while the relative one grows to O(1)
    (1 - 2 / (e^2x + 1) cancels), which the softmax does not see.
    """
    return ptx.fma(cap * cutlass.Float32(-2.0), rcp_approx(ptx.ex2(s * k) + cutlass.Float32(1.0)), cap)
