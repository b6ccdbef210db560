"""Merging decode-attention partials: warps -> CTA -> splits, and the output.

Provenance: the hand-written Flint decode kernel (shared/seeds/000_*.txt):
its CTA combine, ``combine_splits``, ``cluster_reduce`` and ``store_out``.

A partial is (O, m, l) per head: O unnormalized (sum of p * V), m the max of
the unscaled logits, l the sum of p = exp2(s * c - m * c), c = scale * log2 e.
Merging partials r: m = max m_r, w_r = exp2(m_r * c - m * c) (0 for an empty
partial, m_r = -inf), O = sum w_r O_r, l = sum w_r l_r; the output is
O / (l + exp2(sink * log2 e - m * c)). With soft-capped logits
(``decode_mma.softcap_logit``) m is the max of the capped logits, which are
already scaled, and c = log2 e; the sink stays uncapped.

fp8 e4m3 cache: logits are q . K_e4m3 and c carries k_scale (c = scale
log2(e) k_scale; soft-capped: the cap's factor carries it), so m, l and the
merge weights are those of the dequantized cache; O sums p * V_e4m3 and
v_scale enters once, in the output's normalization O * v_scale / (l +
sink term) (``norm_factor``): split partials and DSMEM buffers stay unscaled.

Heads: TH = HEAD_TILE x head tiles (8 for GQA 1..8, 16 for GQA 9..16;
flintgen/layout.py ``AttentionLayout.tile_rows``) are computed; ``G`` below
is the real GQA (TH >= G): heads G..TH-1 are padding (q = 0), combined
across the warps of a CTA but never published, merged across splits or
written. D = head_dim.

Epilogue thread mapping (TH heads x D dims over the CTA): thread ``tid``
owns head ``eh = tid // (D / E)``, dims ``ed .. ed + E - 1`` with
``ed = (tid % (D / E)) * E`` and ``E = TH * D / threads`` (Flint, TH = 8,
D = 128: 8 for 4 warps, 4 for 8 warps; D = 96: 6 for 4 warps); E even:
16-byte fp32 accesses when E is a multiple of 4, else 8-byte ones
(``vec_floats``).

Shared scratch per warp (fp32, ``warp_scratch(TH, D)`` floats)::

    [head * D + dim]     O      (TH * D)
    [TH * D + head]      m      (TH)
    [TH * D + TH + head] l      (TH)

Global split partials, row ``prow = (b * kv_heads + kvh) * splits + split``,
sized by the G real heads (padded heads store, load and merge nothing)::

    part_o[prow * G * D + head * D + dim]    fp32
    part_ml[prow * 2 G + head]               m;  [prow * 2 G + G + head]  l
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from flintgen.device import ptx
from flintgen.device.attn_ptx import (
    lds_f32x2, lds_f32x4, selp_f32, st_cluster_f32x2, stg_b16, stg_f32x2, sts_f32x2,
)
from flintgen.device.decode_mma import pv_dims
from flintgen.layout import HEAD_TILE

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class CombineShape:
    """The compile-time shape every merge step of a variant shares, rendered
    once (the template's ``COMBINE``): ``splits`` (NSPLIT, the variant's
    static splits), ``warps`` (NW per CTA), ``dims`` (E, the epilogue's
    consecutive dims of one head per thread), ``head_dim`` (D),
    ``tile_heads`` (TH, heads computed) and ``gqa`` (G, real heads)."""

    splits: cutlass.Constexpr[int]
    warps: cutlass.Constexpr[int]
    dims: cutlass.Constexpr[int]
    head_dim: cutlass.Constexpr[int]
    tile_heads: cutlass.Constexpr[int]
    gqa: cutlass.Constexpr[int]


def warp_scratch(tile_heads: int, head_dim: int) -> int:
    """fp32 floats of one warp's CTA-combine scratch: O, then m and l per head."""
    return tile_heads * head_dim + 2 * tile_heads


def vec_floats(E: int) -> int:
    """fp32 values per vector access of a thread's E epilogue dims: 16-byte
    accesses when E is a multiple of 4, else 8-byte ones (head_dim 96: E = 6,
    dims 6 k .. are 8-byte aligned)."""
    return 4 if E % 4 == 0 else 2


@cute.jit
def _ld_f32s(dst, off: cutlass.Constexpr, addr, EV: cutlass.Constexpr):
    """``dst[off .. off + EV]`` <- shared ``addr`` (EV = 4 or 2 floats)."""
    if cutlass.const_expr(EV == 4):
        v = lds_f32x4(addr)
    else:
        v = lds_f32x2(addr)
    for j in cutlass.range_constexpr(EV):
        dst[off + j] = v[j]


@cute.jit
def _ldg_cg_f32s(addr, N: cutlass.Constexpr):
    """``N`` (4, 2 or 1) consecutive fp32 at global ``addr``, bypassing L1
    (partials of other CTAs), as a tuple."""
    if cutlass.const_expr(N == 4):
        v = ptx.ldg_cg_f32x4(addr)
    elif cutlass.const_expr(N == 2):
        v = ptx.ldg_cg_f32x2(addr)
    else:
        v = (ptx.ldg_cg_f32(addr),)
    return v


@cute.jit
def _store_f32s(dst, o, E: cutlass.Constexpr, store4: cutlass.Constexpr, store2: cutlass.Constexpr):
    """``o[0 .. E]`` -> ``dst`` through ``store4`` (16-byte) or, when E is not
    a multiple of 4, ``store2`` (8-byte) accesses (global or DSMEM stores)."""
    if cutlass.const_expr(vec_floats(E) == 4):
        for i in cutlass.range_constexpr(E // 4):
            store4(dst + 16 * i, o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3])
    else:
        for i in cutlass.range_constexpr(E // 2):
            store2(dst + 8 * i, o[2 * i], o[2 * i + 1])


@cute.jit
def _weight(m_r, scale_log2, m_s):
    """exp2(m_r * c - m * c), 0 for an empty partial (m_r = -inf; also when
    m = -inf, where the fma alone would give NaN)."""
    return selp_f32(ptx.ex2(ptx.fma(m_r, scale_log2, -m_s)), Float32(0.0), Int32(m_r != ptx.neg_inf()))


def inv_norm(den, v_scale=None):
    """The output's factor ``1 / den``, or ``v_scale / den`` for an e4m3
    cache (v_scale applied once, here; chosen while tracing: nothing is
    emitted for bf16)."""
    return Float32(1.0) / den if v_scale is None else v_scale / den


def norm_factor(l, m_s, sink_s, v_scale=None):
    """The output's factor ``inv_norm(l + 2^(sink_s - m_s))`` for a head with
    sum ``l``, max ``m_s`` (m * c) and sink logit ``sink_s`` (log2 units;
    -inf without sinks): the one normalization of every output site.

    fp32 with flush-to-zero bounds it: a head whose sink outweighs all its
    logits by 2^126 or more (87 nats) gets a factor <= 2^-126, flushed, so
    its output is 0 where the exact one is below 2^-126 |V| (1 / inf = 0
    where the exponent passes 128: never NaN). Scaling numerator and
    denominator by 2^(m_s - sink_s) gains nothing: that factor is the same
    subnormal number. head_errors' floor states this contract."""
    return inv_norm(l + ptx.ex2(sink_s - m_s), v_scale)


@cute.jit
def cta_combine(acc, ml, scratch, warp, g, t, eh, ed, scale_log2, o, shape: cutlass.Constexpr):
    """Merge the warps' partials through shared memory (``scratch``: the ring,
    free once every warp has consumed its slices). ``acc`` per the
    ``decode_mma`` layout; ``ml`` = (m0, m1, l0, l1) per head tile, ``l``
    already summed over the warp. Fills ``o`` (E floats) and returns
    ``(m_cta, l_cta)`` for head ``eh``."""
    NW, E, D = shape.warps, shape.dims, shape.head_dim
    T = len(ml) // 4
    TH = HEAD_TILE * T
    WS = warp_scratch(TH, D)
    MO = TH * D          # m offset in a warp's scratch; l follows at MO + TH
    cute.arch.sync_threads()
    wbuf = scratch + warp * (WS * 4)
    for tl in cutlass.range_constexpr(T):
        h0 = HEAD_TILE * tl + 2 * t
        ao = tl * (D // 4)
        for j in cutlass.range_constexpr(D // 16):
            base, stride = pv_dims(j, D)
            d0 = base + stride * g
            sts_f32x2(wbuf + (h0 * D + d0) * 4, acc[ao + 4 * j], acc[ao + 4 * j + 2])
            sts_f32x2(wbuf + ((h0 + 1) * D + d0) * 4, acc[ao + 4 * j + 1], acc[ao + 4 * j + 3])
        if g == 0:
            sts_f32x2(wbuf + (MO + h0) * 4, ml[4 * tl], ml[4 * tl + 1])
            sts_f32x2(wbuf + (MO + TH + h0) * 4, ml[4 * tl + 2], ml[4 * tl + 3])
    cute.arch.sync_threads()

    m_cta = ptx.neg_inf()
    for w in cutlass.range_constexpr(NW):
        m_cta = cute.arch.fmax(m_cta, ptx.lds_f32(scratch + (w * WS + MO + eh) * 4))
    m_cta_s = m_cta * scale_log2
    l_cta = Float32(0.0)
    for e in cutlass.range_constexpr(E):
        o[e] = Float32(0.0)
    EV = vec_floats(E)
    v = [Float32(0.0)] * E
    for w in cutlass.range_constexpr(NW):
        base = scratch + w * (WS * 4)
        wgt = _weight(ptx.lds_f32(base + (MO + eh) * 4), scale_log2, m_cta_s)
        l_cta = l_cta + wgt * ptx.lds_f32(base + (MO + TH + eh) * 4)
        for i in cutlass.range_constexpr(E // EV):
            _ld_f32s(v, EV * i, base + (eh * D + ed + EV * i) * 4, EV)
        for e in cutlass.range_constexpr(E):
            o[e] = o[e] + wgt * v[e]
    return m_cta, l_cta


@cute.jit
def store_out(out_row, ed, o, inv, E: cutlass.Constexpr):
    """bf16(o * inv) -> ``out_row`` (byte address of out[b, head, 0]) dims
    ed.. (``ed`` a multiple of E: 16-byte stores when E is a multiple of 8,
    8-byte ones for E = 4 or 12, 4-byte ones for E = 6)."""
    w = [ptx.bf16x2(o[2 * j] * inv, o[2 * j + 1] * inv) for j in range(E // 2)]
    _store_words(out_row + ed * 2, w, E)


@cute.jit
def _store_words(dst, w, E: cutlass.Constexpr):
    """Store the E / 2 words ``w`` (bf16 pairs) at global ``dst`` in the
    widest accesses E's alignment allows."""
    if cutlass.const_expr(E % 8 == 0):
        for i in cutlass.range_constexpr(E // 8):
            ptx.stg_u32x4(dst + 16 * i, w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3])
    elif cutlass.const_expr(E % 4 == 0):
        for i in cutlass.range_constexpr(E // 4):
            ptx.stg_u32x2(dst + 8 * i, w[2 * i], w[2 * i + 1])
    else:
        for i in cutlass.range_constexpr(E // 2):
            ptx.stg_u32(dst + 4 * i, w[i])


@cute.jit
def store_zeros(out_row, ed, E: cutlass.Constexpr):
    """seq_len 0: exact zeros (nothing to attend, no sink-only output)."""
    _store_words(out_row + ed * 2, [cutlass.Uint32(0)] * (E // 2), E)


@cute.jit
def store_head(out_row, eh, ed, o, inv, shape: cutlass.Constexpr):
    """``store_out`` for head ``eh`` of a TH-head tile: heads ``>= G`` are mma
    padding (GQA 4 in a tile of 8) and are not written."""
    E, G, TH = shape.dims, shape.gqa, shape.tile_heads
    if cutlass.const_expr(TH > G):
        if eh < G:
            store_out(out_row, ed, o, inv, E)
    else:
        store_out(out_row, ed, o, inv, E)


@cute.jit
def store_head_zeros(out_row, eh, ed, shape: cutlass.Constexpr):
    """``store_zeros`` for head ``eh`` of a TH-head tile (padded heads skipped)."""
    E, G, TH = shape.dims, shape.gqa, shape.tile_heads
    if cutlass.const_expr(TH > G):
        if eh < G:
            store_zeros(out_row, ed, E)
    else:
        store_zeros(out_row, ed, E)


@cute.jit
def publish_partial(po_row, pml_row, eh, ed, o, m_cta, l_cta, shape: cutlass.Constexpr):
    """Store this split's partial (``po_row``/``pml_row``: byte addresses of
    its part_o / part_ml rows, sized by the G real heads: padded heads
    ``eh >= G`` store nothing)."""
    E, D, G, TH = shape.dims, shape.head_dim, shape.gqa, shape.tile_heads
    if cutlass.const_expr(TH > G):
        if eh < G:
            _publish(po_row, pml_row, eh, ed, o, m_cta, l_cta, E, D, G)
    else:
        _publish(po_row, pml_row, eh, ed, o, m_cta, l_cta, E, D, G)


@cute.jit
def _publish(po_row, pml_row, eh, ed, o, m_cta, l_cta, E: cutlass.Constexpr, D: cutlass.Constexpr,
             G: cutlass.Constexpr):
    _store_f32s(po_row + (eh * D + ed) * 4, o, E, ptx.stg_f32x4, stg_f32x2)
    if ed == 0:
        ptx.stg_f32(pml_row + eh * 4, m_cta)
        ptx.stg_f32(pml_row + (G + eh) * 4, l_cta)


@cute.jit
def arrive(counter, flag, tid):
    """Count this CTA's arrival on the (request, kv head) ``counter`` (global
    byte address) once all its partial stores are issued; returns the number
    of splits that arrived before it (same value in every thread). The
    acq_rel atomic after the barrier releases the CTA's stores and, in the
    last CTA, acquires everyone else's (CUTLASS's semaphore pattern)."""
    cute.arch.sync_threads()
    if tid == 0:
        ptx.sts_i32(flag, ptx.atomic_add_acq_rel(counter, Int32(1)))
    cute.arch.sync_threads()
    return ptx.lds_i32(flag)


@cute.jit
def _load_round(vs, o_base, r0: cutlass.Constexpr, num_loads, RCH: cutlass.Constexpr, E: cutlass.Constexpr,
                ROW: cutlass.Constexpr):
    """Load splits ``r0 .. r0 + RCH`` of this thread's E dims into ``vs``
    (``ROW``: bytes per split row); rows past ``num_loads`` (the active
    splits, 0 for a padded head) are zero and issue no load."""
    EV = vec_floats(E)
    for r in cutlass.range_constexpr(RCH):
        for k in cutlass.range_constexpr(E):
            vs[r * E + k] = Float32(0.0)
        if r0 + r < num_loads:
            for i in cutlass.range_constexpr(E // EV):
                v = _ldg_cg_f32s(o_base + Int64(r0 + r) * ROW + 4 * EV * i, EV)
                for j in cutlass.range_constexpr(EV):
                    vs[r * E + EV * i + j] = v[j]


@cute.jit
def _sum_round(o, vs, ml_smem, r0: cutlass.Constexpr, num_splits, h, MLR: cutlass.Constexpr, G: cutlass.Constexpr,
               RCH: cutlass.Constexpr, E: cutlass.Constexpr):
    """o += weight(split) x partial for the RCH splits from ``r0`` held in
    ``vs`` (weights of real head ``h`` from the shared m / l table; 0 past
    ``num_splits``). The splits exist in the table: r0 + RCH <= the static
    split count."""
    for r in cutlass.range_constexpr(RCH):
        row = (r0 + r) * MLR
        wgt = selp_f32(ptx.lds_f32(ml_smem + (row + G + h) * 4), Float32(0.0),
                       Int32(r0 + r < num_splits))  # fmt: skip
        for e in cutlass.range_constexpr(E):
            o[e] = o[e] + wgt * vs[r * E + e]


@cute.jit
def _real_head(h, G: cutlass.Constexpr, TH: cutlass.Constexpr):
    """``(min(h, G - 1), G if h < G else 0)``: the real head whose partial rows a
    (possibly padded) head ``h`` may address, and the loads it issues per split
    (padded heads: none)."""
    if cutlass.const_expr(TH > G):
        return cutlass.min(h, Int32(G - 1)), Int32(h < G)
    return h, Int32(1)


@cute.jit
def stage_weights(pml_base, num_splits, tid, ml_smem, scale_log2, NSPLIT: cutlass.Constexpr,
                  NW: cutlass.Constexpr, G: cutlass.Constexpr):
    """Stage the pair's m / l table (rows of the G real heads) in ``ml_smem``
    (``2 G * NSPLIT + 2 G`` floats), replace each split's l by its merge
    weight and append the merged m * c and l per head. Ends with a CTA
    barrier."""
    MLR = 2 * G         # floats per split row of the m / l table
    THREADS = 32 * NW
    QV = 4 if G % 2 == 0 else 2     # floats per load: rows are 2 G floats
    QN = MLR // QV                  # loads per split row
    # Unrolled (at most 9 guarded iterations) so that all of a thread's loads
    # are in flight at once; a runtime loop would wait one L2 round trip per
    # iteration.
    for i in cutlass.range_constexpr((NSPLIT * QN + THREADS - 1) // THREADS):
        idx = tid + i * THREADS
        if idx < num_splits * QN:
            v = _ldg_cg_f32s(pml_base + Int64(idx) * (4 * QV), QV)
            for j in cutlass.range_constexpr(QV):
                ptx.sts_f32(ml_smem + (idx * QV + j) * 4, v[j])
    cute.arch.sync_threads()

    # Warp w merges real heads w, w + NW, ..; its lanes cover the splits. Each
    # split's weight replaces its l in the table.
    warp = tid // 32
    lane = tid % 32
    NL = (NSPLIT + 31) // 32
    for hh in cutlass.range_constexpr((G + NW - 1) // NW):
        h = warp + hh * NW
        if h < G:
            _head_weights(ml_smem, num_splits, lane, h, scale_log2, NSPLIT, MLR, G, NL)
    cute.arch.sync_threads()


@cute.jit
def _head_weights(ml_smem, num_splits, lane, h, scale_log2, NSPLIT: cutlass.Constexpr, MLR: cutlass.Constexpr,
                  G: cutlass.Constexpr, NL: cutlass.Constexpr):
    """One warp: merged m * c and l of head ``h`` over the splits; split r's l
    entry becomes its weight. A lane reads and writes only its own splits'
    entries (lanes past the splits read row NSPLIT - 1's m, which nobody
    writes here)."""
    mloc = [Float32(0.0)] * NL
    for r in cutlass.range_constexpr(NL):
        sidx = lane + 32 * r
        row = cutlass.min(sidx, Int32(NSPLIT - 1)) * MLR
        mloc[r] = selp_f32(ptx.lds_f32(ml_smem + (row + h) * 4), ptx.neg_inf(),
                           Int32(sidx < num_splits))  # fmt: skip
    mh = mloc[0]
    for r in cutlass.range_constexpr(1, NL):
        mh = cute.arch.fmax(mh, mloc[r])
    for off in cutlass.range_constexpr(5):
        mh = cute.arch.fmax(mh, cute.arch.shuffle_sync_bfly(mh, 1 << off))
    mh_s = mh * scale_log2
    lh = Float32(0.0)
    for r in cutlass.range_constexpr(NL):
        sidx = lane + 32 * r
        if sidx < num_splits:
            lw = ml_smem + (sidx * MLR + G + h) * 4
            wgt = _weight(mloc[r], scale_log2, mh_s)
            lh = lh + wgt * ptx.lds_f32(lw)
            ptx.sts_f32(lw, wgt)
    for off in cutlass.range_constexpr(5):
        lh = lh + cute.arch.shuffle_sync_bfly(lh, 1 << off)
    if lane == 0:
        ptx.sts_f32(ml_smem + (NSPLIT * MLR + h) * 4, mh_s)
        ptx.sts_f32(ml_smem + (NSPLIT * MLR + G + h) * 4, lh)


@cute.jit
def combine_splits(po_base, pml_base, num_splits, eh, ed, tid, ml_smem, scale_log2, sink_s, out_row,
                   o, shape: cutlass.Constexpr, v_scale=None):
    """Last CTA of a (request, kv head): merge the ``num_splits`` fp32 partials
    at ``po_base``/``pml_base`` (rows of split 0, G real heads each) and write
    the output of the real heads (padded heads ``eh >= G`` load nothing and
    store nothing).

    ``ml_smem``: shared scratch of ``2 G * NSPLIT + 2 G`` floats (m, l table,
    then the per-head merged m * c and l); ``v_scale``: ``inv_norm``."""
    NSPLIT, NW, E, D, TH, G = shape.splits, shape.warps, shape.dims, shape.head_dim, shape.tile_heads, shape.gqa
    MLR = 2 * G         # floats per split row of the m / l table
    ROW = G * D * 4     # bytes per split row of part_o
    # Rounds of RCH splits keep 128 / E x E = 128 floats of loads in flight per
    # thread; the first round is issued before the m / l staging to hide its
    # L2 latency behind it.
    RCH = min(NSPLIT, max(1, 128 // E))
    hr, real = _real_head(eh, G, TH)
    num_loads = num_splits * real
    o_base = po_base + (hr * D + ed) * 4
    vs = cute.make_rmem_tensor((RCH * E,), Float32)
    # Loads of splits past ``num_splits`` are skipped, not clamped: with a
    # 66-split variant and 8 active splits, clamped loads cost ~1.3 us at
    # B=1, L=1k (66 vs 8 static splits, same active count; H200 sweep).
    _load_round(vs, o_base, 0, num_loads, RCH, E, ROW)
    stage_weights(pml_base, num_splits, tid, ml_smem, scale_log2, NSPLIT, NW, G)

    m_all_s = ptx.lds_f32(ml_smem + (NSPLIT * MLR + hr) * 4)
    l_all = ptx.lds_f32(ml_smem + (NSPLIT * MLR + G + hr) * 4)
    for e in cutlass.range_constexpr(E):
        o[e] = Float32(0.0)
    # Rounds unrolled (straight-line code lets ptxas issue a round's loads
    # early), each skipped entirely past ``num_splits``: summing every static
    # split with zero weights made the merge's time grow with the grid, not
    # the work (gpt-oss 8/1 B=1 L=1k, 16 of 264 splits active: 7.76 -> 5.28
    # us with a runtime loop; H200 sweep). A runtime loop over the rounds in
    # turn cost ~1.2 us at 16/2 B=1 L=32k (66 active splits: 12.7 vs 11.3-11.6
    # us), the loads of one round no longer overlapping the previous one.
    for r0 in cutlass.range_constexpr(0, NSPLIT, RCH):
        if r0 < num_splits:
            if cutlass.const_expr(r0 > 0):
                _load_round(vs, o_base, r0, num_loads, RCH, E, ROW)
            _sum_round(o, vs, ml_smem, r0, num_splits, hr, MLR, G, min(RCH, NSPLIT - r0), E)
    inv = norm_factor(l_all, m_all_s, sink_s, v_scale)
    store_head(out_row, eh, ed, o, inv, shape)


# ---------------------------------------------------------------- merge by several CTAs
# At long contexts one CTA reading every split's partial is bound by one SM's
# L2 bandwidth (16/2 heads, B=1, L=32k: 66 x 4 KB per kv head; the merge is
# 2.75 of 11.6 us, H200 ablation). The last ``R = min(MERGE_CTAS, splits)``
# CTAs to arrive each merge a group of heads instead; all but the very last
# wait for the counter to reach ``splits`` (every CTA of the grid has started
# by then: dependents launch only after every CTA streamed, and the CTAs
# still to arrive are running), then count again; the last to finish resets
# the counter for the next launch (flintgen.device.arrivals).
@cute.jit
def merge_groups(po_base, pml_base, num_splits, tid, ml_smem, scale_log2, sinks, head0, out_b, so1, rank, r_eff,
                 shape: cutlass.Constexpr, MC: cutlass.Constexpr, EM: cutlass.Constexpr, v_scale=None):
    """Merger ``rank`` of ``r_eff``: merge head groups ``rank, rank + r_eff, ..``
    (``MC`` groups of ``TH / MC`` heads) and write their real heads (padded
    heads load nothing). Thread ``tid`` owns ``EM`` (1, 2 or 4) consecutive
    dims of a group (``TH / MC * D == 32 * NW * EM``); a warp's loads are one
    coalesced row segment per split. The first group's loads (every split
    while ``NSPLIT * EM <= 128``) are issued before the m / l table is
    staged, so both share one L2 round trip."""
    NSPLIT, NW, D, TH, G = shape.splits, shape.warps, shape.head_dim, shape.tile_heads, shape.gqa
    HG = TH // MC
    MLR = 2 * G
    ROW = G * D * 4
    RCH = min(NSPLIT, 128 // EM)      # splits per round: 128 floats in flight per thread
    for k in cutlass.range_constexpr(MC):
        grp = rank + k * r_eff
        if grp < MC:
            h = grp * HG + (tid * EM) // D
            hr, real = _real_head(h, G, TH)
            num_loads = num_splits * real
            d0 = (tid * EM) % D
            o_base = po_base + Int64((hr * D + d0) * 4)
            o = [Float32(0.0)] * EM
            for r0 in cutlass.range_constexpr(0, NSPLIT, RCH):
                if r0 < num_splits:
                    vs = [Float32(0.0)] * (RCH * EM)
                    for r in cutlass.range_constexpr(min(RCH, NSPLIT - r0)):
                        if r0 + r < num_loads:
                            v = _ldg_cg_f32s(o_base + Int64(r0 + r) * ROW, EM)
                            for e in cutlass.range_constexpr(EM):
                                vs[EM * r + e] = v[e]
                    if cutlass.const_expr(k == 0 and r0 == 0):
                        stage_weights(pml_base, num_splits, tid, ml_smem, scale_log2, NSPLIT, NW, G)
                    for r in cutlass.range_constexpr(min(RCH, NSPLIT - r0)):
                        row = (r0 + r) * MLR
                        wgt = selp_f32(ptx.lds_f32(ml_smem + (row + G + hr) * 4), Float32(0.0),
                                       Int32(r0 + r < num_splits))  # fmt: skip
                        for e in cutlass.range_constexpr(EM):
                            o[e] = o[e] + wgt * vs[r * EM + e]
            m_all_s = ptx.lds_f32(ml_smem + (NSPLIT * MLR + hr) * 4)
            l_all = ptx.lds_f32(ml_smem + (NSPLIT * MLR + G + hr) * 4)
            sink_s = Float32(sinks[head0 + hr]) * LOG2E
            inv = norm_factor(l_all, m_all_s, sink_s, v_scale)
            dst = out_b + Int64(head0 + h) * so1 * 2 + Int64(d0 * 2)
            if h < G:
                if cutlass.const_expr(EM == 4):
                    ptx.stg_u32x2(dst, ptx.bf16x2(o[0] * inv, o[1] * inv), ptx.bf16x2(o[2] * inv, o[3] * inv))
                elif cutlass.const_expr(EM == 2):
                    ptx.stg_u32(dst, ptx.bf16x2(o[0] * inv, o[1] * inv))
                else:
                    stg_b16(dst, ptx.bf16x2(o[0] * inv, o[0] * inv))


@cute.jit
def cluster_reduce(cbuf, rank, tid, eh, ed, o, m_cta, l_cta, sinks, head0, scale_log2, out_b, so1,
                   shape: cutlass.Constexpr, v_scale=None):
    """Merge the splits of a (request, kv head) inside its cluster: every CTA
    sends rank r the dims ``[r * DPR, (r + 1) * DPR)`` of its partial O (plus
    m and l) through DSMEM; after one cluster barrier each rank merges all
    splits for its dims and writes them (heads < G: TH - G heads are padding).

    ``cbuf`` (shared, per rank): ``[split][head][DPR]`` O, then m
    ``[split][head]``, then l ``[split][head]`` (fp32, TH heads). The caller
    has done ``cluster_arrive_relaxed`` early; the wait here makes sure every
    peer is running before its shared memory is written."""
    NSPLIT, NW, E, D, TH, G = shape.splits, shape.warps, shape.dims, shape.head_dim, shape.tile_heads, shape.gqa
    DPR = D // NSPLIT
    M_OFF = NSPLIT * TH * DPR
    L_OFF = M_OFF + TH * NSPLIT
    peer = ptx.mapa(cbuf, Int32(ed // DPR))
    cute.arch.cluster_wait()
    _store_f32s(peer + ((rank * TH + eh) * DPR + ed % DPR) * 4, o, E, ptx.st_cluster_f32x4, st_cluster_f32x2)
    if ed % DPR == 0:
        ptx.st_cluster_f32(peer + (M_OFF + rank * TH + eh) * 4, m_cta)
        ptx.st_cluster_f32(peer + (L_OFF + rank * TH + eh) * 4, l_cta)
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()

    # This rank owns dims [rank * DPR, (rank + 1) * DPR) of all TH heads: OPT
    # consecutive dims of one head per thread.
    OPT = TH * DPR // (32 * NW)
    h = tid * OPT // DPR
    dl = tid * OPT % DPR
    m_all = ptx.neg_inf()
    for r in cutlass.range_constexpr(NSPLIT):
        m_all = cute.arch.fmax(m_all, ptx.lds_f32(cbuf + (M_OFF + r * TH + h) * 4))
    m_all_s = m_all * scale_log2
    l_all = Float32(0.0)
    oo = [Float32(0.0)] * OPT
    for r in cutlass.range_constexpr(NSPLIT):
        wgt = _weight(ptx.lds_f32(cbuf + (M_OFF + r * TH + h) * 4), scale_log2, m_all_s)
        l_all = l_all + wgt * ptx.lds_f32(cbuf + (L_OFF + r * TH + h) * 4)
        for e in cutlass.range_constexpr(OPT):
            oo[e] = oo[e] + wgt * ptx.lds_f32(cbuf + ((r * TH + h) * DPR + dl + e) * 4)
    if cutlass.const_expr(TH > G):
        if h < G:
            _cluster_store(oo, m_all_s, l_all, sinks, head0 + h, out_b, so1, rank, dl, DPR, OPT, v_scale)
    else:
        _cluster_store(oo, m_all_s, l_all, sinks, head0 + h, out_b, so1, rank, dl, DPR, OPT, v_scale)


@cute.jit
def _cluster_store(oo, m_all_s, l_all, sinks, head, out_b, so1, rank, dl, DPR: cutlass.Constexpr,
                   OPT: cutlass.Constexpr, v_scale=None):
    """Normalize (sink included; ``v_scale``: ``inv_norm``) and write OPT dims
    from ``rank * DPR + dl`` of q head ``head``."""
    sink_s = Float32(sinks[head]) * LOG2E
    inv = norm_factor(l_all, m_all_s, sink_s, v_scale)
    dst_g = out_b + (Int64(head) * so1 + rank * DPR + dl) * 2
    if cutlass.const_expr(OPT % 2):
        # Odd OPT (head_dim 96 over 2 ranks: 3 dims): dl is not 4-byte aligned.
        for e in cutlass.range_constexpr(OPT):
            stg_b16(dst_g + e * 2, ptx.bf16x2(oo[e] * inv, oo[e] * inv))
    else:
        for e in cutlass.range_constexpr(0, OPT, 2):
            ptx.stg_u32(dst_g + e * 2, ptx.bf16x2(oo[e] * inv, oo[e + 1] * inv))
