"""The streaming QKV GEMV's work plan (flintgen.configs.qkv_stream_plan; no GPU, no
kernels): the closed forms against brute force (every unit in exactly one CTA
range, segments and slots, the segment bound, the counter target), the merge
rounds, the register path's xn slots and publish schedule, the spread finish's
slices, wgmma's swizzled stages, the TMA ring's shared memory, and the
refusals of each launch option (tests/test_qkv_stream.py: variants, compiled
binaries, GPU numerics)."""

from __future__ import annotations

import pytest

from flintgen.configs import qkv_stream_plan as sp
from flintgen.configs.qkv_stream_plan import StreamConfig


# ----------------------------------------------------------------- plan
PLANS = [(2048, 128, 40, 132, 8), (4096, 128, 48, 132, 64), (2880, 64, 80, 132, 16), (896, 64, 18, 132, 8),
         (16384, 256, 6, 132, 64), (3072, 96, 48, 114, 32), (512, 128, 3, 132, 8), (1024, 64, 2, 7, 8)]


@pytest.mark.parametrize("hidden, d, heads, ctas, mm", PLANS)
def test_plan_closed_forms_match_brute_force(hidden, d, heads, ctas, mm):
    p = sp.StreamPlan(hidden=hidden, head_dim=d, heads=heads, ctas=ctas, max_m=mm)
    assert p.grid == min(ctas, p.units) and p.block_rows * p.blocks_per_head == d
    owner = [None] * p.units
    slots = set()
    head_units = [0] * heads
    for c in range(p.grid):
        lo, hi = p.lo(c), p.lo(c + 1)
        assert hi - lo in (p.units // p.grid, p.max_units)          # balanced: +-1 unit
        segs = p.segments(c)
        assert 1 <= len(segs) <= p.max_segments
        assert segs[0][1] == lo and segs[-1][2] == hi
        for b, a, e in segs:
            assert b * p.steps <= a < e <= (b + 1) * p.steps
            s = p.slot(c, b)
            assert 0 <= s < p.slots and s not in slots
            slots.add(s)
            head_units[b // p.blocks_per_head] += e - a
            for u in range(a, e):
                assert owner[u] is None
                owner[u] = c
    assert all(o is not None for o in owner)
    assert all(p.cta_of_unit(u) == owner[u] for u in range(p.units))
    for b in range(p.blocks):   # the merge's contributors of a block (the template's closed form): its units' CTAs
        assert p.contributors(b) == (owner[b * p.steps], owner[(b + 1) * p.steps - 1])
    assert p.max_contributors == max(len(set(owner[b * p.steps:(b + 1) * p.steps])) for b in range(p.blocks))
    assert head_units == [p.head_units] * heads                     # each head's counter reaches its target
    assert p.workspace_floats == p.slots * p.block_rows * mm
    assert 2 <= p.ring_stages <= sp.MAX_STAGES and p.smem_bytes <= sp.SMEM_PER_CTA_MAX


@pytest.mark.parametrize("hidden, d, heads, ctas, mm", PLANS)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_merge_rounds(hidden, d, heads, ctas, mm, prefetch):
    """A merge round loads merge_ntiles n-tiles of every contributor: a divisor of the tile's n-tiles (the
    template's rounds cover them exactly), within merge_floats loads per thread, and the largest such;
    one n-tile past 6 contributors and on the register path."""
    if prefetch and hidden // 64 < prefetch:
        return
    p = sp.StreamPlan(hidden=hidden, head_dim=d, heads=heads, ctas=ctas, max_m=mm, prefetch=prefetch)
    n_tiles, k = mm // 8, p.merge_ntiles
    assert n_tiles % k == 0 and 1 <= k <= n_tiles
    if prefetch or p.max_contributors > 6:
        assert k == 1 and p.merge_floats == (sp.MERGE_FLOATS_REGISTER_PATH if prefetch else sp.MERGE_FLOATS)
        return
    assert k == 1 or 4 * p.max_contributors * k <= p.merge_floats
    bigger = [n for n in range(k + 1, n_tiles + 1) if n_tiles % n == 0]
    assert all(4 * p.max_contributors * n > p.merge_floats for n in bigger)
    # hidden 4096, 48 heads, 64 tokens: 4 contributors per block, 4 of the 8 n-tiles per round (2 rounds)
    if (hidden, heads, mm) == (4096, 48, 64):
        assert (p.max_contributors, k) == (4, 4)


def test_plan_segment_bound_is_tight():
    """A range of max_units units can touch max_segments blocks, never more."""
    for steps in (1, 2, 5, 14, 64):
        for n in range(1, 3 * steps + 2):
            worst = max((u0 + n - 1) // steps - u0 // steps + 1 for u0 in range(steps))
            assert (n + steps - 2) // steps + 1 == worst, (steps, n)


def test_plan_refusals():
    with pytest.raises(ValueError, match=r"hidden = 100 must be a positive multiple of 64"):
        sp.StreamPlan(hidden=100, head_dim=128, heads=1, ctas=132, max_m=8)
    with pytest.raises(ValueError, match=r"head_dim = 192 must be a multiple of 16, and of 128 above 128"):
        sp.StreamPlan(hidden=1024, head_dim=192, heads=1, ctas=132, max_m=8)
    with pytest.raises(ValueError, match=r"max_m = 12 must be 8, 16, .., 64"):
        sp.StreamPlan(hidden=1024, head_dim=128, heads=1, ctas=132, max_m=12)
    with pytest.raises(ValueError, match=r"stages = 1 must be 0 \(fill shared memory\) or 2..16"):
        StreamConfig(stages=1)
    with pytest.raises(ValueError, match=r"8 stages of 27648 bytes \(max_m 64, head_dim 128\) need 237584 bytes "
                                         r"of shared memory, over the 232448 a CTA may use: use at most 7 stages"):
        sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=64, stages=8)


@pytest.mark.parametrize("hidden, d, heads, ctas, mm", PLANS)
@pytest.mark.parametrize("per_sm", [1, 2])
def test_register_path_xn_slots(hidden, d, heads, ctas, mm, per_sm):
    """Register path: every unit of a range finds its K step in the CTA's staged xn slots (slot j = the
    range's unit j while a range meets each step at most once, else slot s = step s), and a group of
    prefetch units meets at most two blocks (the two accumulator sets)."""
    prefetch = min(4, hidden // 64)
    # the same grid as one CTA per SM on ctas * per_sm SMs: its shared memory, per_sm times, must fit an SM
    same = sp.StreamPlan(hidden=hidden, head_dim=d, heads=heads, ctas=ctas * per_sm, max_m=mm, prefetch=prefetch)
    if (same.smem_bytes + sp.CTA_SMEM_RESERVED) * per_sm > sp.SMEM_PER_SM:
        with pytest.raises(ValueError, match=r"exceed an SM's 233472: use fewer CTAs per SM"):
            sp.StreamPlan(hidden=hidden, head_dim=d, heads=heads, ctas=ctas, max_m=mm, prefetch=prefetch,
                          ctas_per_sm=per_sm)
        return
    p = sp.StreamPlan(hidden=hidden, head_dim=d, heads=heads, ctas=ctas, max_m=mm, prefetch=prefetch,
                      ctas_per_sm=per_sm)
    assert p.grid == min(ctas * per_sm, p.units) and p.ring_stages >= 0
    for c in range(p.grid):
        lo, hi = p.lo(c), p.lo(c + 1)
        staged = {}
        for j in range(hi - lo):
            slot = j if p.xn_by_unit else (lo + j) % p.steps
            assert 0 <= slot < p.xn_slots
            staged.setdefault(slot, (lo + j) % p.steps)
            assert staged[slot] == (lo + j) % p.steps          # one step per slot
        for j0 in range(0, hi - lo, prefetch):
            blocks = {u // p.steps for u in range(lo + j0, min(lo + j0 + prefetch, hi))}
            assert len(blocks) <= 2 and (len(blocks) == 1 or max(blocks) == min(blocks) + 1)
    assert p.smem_bytes == p.xn_slots * mm * 128 + p.head_rows_bytes + sp.FLAG_BYTES


@pytest.mark.parametrize("hidden, d, heads, ctas, mm", PLANS)
@pytest.mark.parametrize("prefetch", [1, 2, 3, 4, 8])
def test_register_path_publish_schedule(hidden, d, heads, ctas, mm, prefetch):
    """The register path's loop (templates/qkv_stream.py.j2, PREFETCH > 0) replayed in Python: groups of
    ``prefetch`` units into one accumulator set; at the next block's first unit the current block's
    partial is stored (and acc restarts); after a group, a completed block is counted (its partial
    stored then if no unit of the next block came yet). Every unit lands in its own block's partial,
    every segment is stored and counted once, in order, with the segment's unit count (=
    plan.segments), into the slot the merge reads."""
    if hidden // 64 < prefetch:
        return
    p = sp.StreamPlan(hidden=hidden, head_dim=d, heads=heads, ctas=ctas, max_m=mm, prefetch=prefetch)
    for c in range(p.grid):
        lo, hi = p.lo(c), p.lo(c + 1)
        n, first = hi - lo, lo // p.steps
        acc, cur, stored, counted = [], first, {}, []

        def store(slot):
            assert slot not in stored
            stored[slot] = list(acc)
            acc.clear()

        for j0 in range(0, n, prefetch):
            for q in range(prefetch):
                j = j0 + q
                if j < n:
                    u = lo + j
                    if u == (cur + 1) * p.steps:
                        store(c * p.max_segments + cur - first)
                    acc.append(u)
            done = min(lo + j0 + prefetch, hi)
            for _ in range(2):
                seg_lo, seg_hi = max(lo, cur * p.steps), min(hi, cur * p.steps + p.steps)
                if seg_lo < done and seg_hi <= done:
                    if seg_hi == done:
                        store(c * p.max_segments + cur - first)
                    slot = c * p.max_segments + cur - first
                    assert stored[slot] == list(range(seg_lo, seg_hi))      # exactly the segment's units
                    counted.append((cur, seg_lo, seg_hi))
                    cur += 1
        assert acc == [] and counted == p.segments(c)
        assert sorted(stored) == sorted(p.slot(c, b) for b, *_ in counted)


def test_register_path_refusals():
    with pytest.raises(ValueError, match=r"prefetch = 9 must be 0 \(the cp.async ring\) or 1..8 units in registers"):
        StreamConfig(prefetch=9)
    with pytest.raises(ValueError, match=r"prefetch = 2 \(the register path\) takes no ring: stages = 6 must be 0"):
        StreamConfig(prefetch=2, stages=6)
    with pytest.raises(ValueError, match=r"ctas_per_sm = 5 must be 1..4"):
        StreamConfig(ctas_per_sm=5)
    with pytest.raises(ValueError, match=r"l2_prefetch = -1 must be 0 \(none\) or 1..65536 units prefetched into L2"):
        StreamConfig(l2_prefetch=-1)
    with pytest.raises(ValueError, match=r"tma = True writes the 128-byte swizzled stages of the wgmma ring: "
                                         r"wgmma = False must be True"):
        StreamConfig(stages=6, tma=True)
    with pytest.raises(TypeError, match=r"StreamConfig.evict_first = 1 must be a bool"):
        StreamConfig(evict_first=1)
    with pytest.raises(ValueError, match=r"evict_first = True applies to the cp.async ring's weight copies: "
                                         r"tma = True, prefetch = 0 must be off"):
        StreamConfig(stages=6, wgmma=True, tma=True, evict_first=True)
    with pytest.raises(ValueError, match=r"evict_first = True applies .*tma = False, prefetch = 3 must be off"):
        StreamConfig(prefetch=3, evict_first=True)
    with pytest.raises(ValueError, match=r"hidden = 192 has 3 K steps, fewer than prefetch = 4 .*prefetch fewer units"):
        sp.StreamPlan(hidden=192, head_dim=128, heads=3, ctas=132, max_m=8, prefetch=4)
    with pytest.raises(ValueError, match=r"2 CTAs of 119568 bytes of shared memory \(6 ring stages of 19584 bytes\) "
                                         r"exceed an SM's 233472: use fewer CTAs per SM or fewer stages"):
        StreamConfig(stages=6, ctas_per_sm=2)
    with pytest.raises(ValueError, match=r"4 CTAs of \d+ bytes of shared memory \(xn of 6 K steps x 64 tokens\) "
                                         r"exceed an SM's 233472: use fewer CTAs per SM"):
        sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=64, prefetch=4, ctas_per_sm=4)


def test_finish_slices_plan_and_refusals():
    """Spread finish: a head's tokens in whole-n-tile slices, slice s to CTA s * grid // total: every CTA
    finishes at most max_owned, consecutive slices of a head go to consecutive CTAs of its contributors'
    neighbourhood, and every slice has exactly one finisher."""
    for heads, hidden, m, ft in ((40, 2048, 64, 16), (40, 2048, 64, 8), (48, 4096, 32, 16), (5, 1024, 16, 8),
                                 (400, 2048, 64, 8)):
        p = sp.StreamPlan(hidden=hidden, head_dim=128, heads=heads, ctas=132, max_m=m, stages=6, wgmma=True,
                          finish_tokens=ft)
        assert p.finish_slices == m // ft and p.slice_tokens == ft and p.finish_total == heads * m // ft
        owners = [p.finisher(s) for s in range(p.finish_total)]
        assert owners == sorted(owners) and max(owners) < p.grid
        assert max(owners.count(c) for c in range(p.grid)) == p.max_owned
        for c in range(p.grid):   # the kernel's closed form of CTA c's slices
            lo, hi = -(-c * p.finish_total // p.grid), -(-(c + 1) * p.finish_total // p.grid)
            assert [s for s, o in enumerate(owners) if o == c] == list(range(lo, hi))
        assert p.merge_ntiles * 8 <= ft and (ft // 8) % p.merge_ntiles == 0
    off = sp.StreamPlan(hidden=2048, head_dim=128, heads=40, ctas=132, max_m=64, stages=6, wgmma=True)
    assert off.finish_slices == 1 and off.max_owned == 0 and off.merge_ntiles == 4
    assert StreamConfig(finish_tokens=16).tokens_for(64) == 16 and StreamConfig(finish_tokens=32).tokens_for(16) == 16
    with pytest.raises(ValueError, match=r"finish_tokens = 12 must be 0 \(the completing CTA finishes a head\) or "
                                         r"8, 16, .., 64"):
        StreamConfig(finish_tokens=12)
    with pytest.raises(ValueError, match=r"finish_tokens = 24 must be a multiple of 8 that divides the 64-token tile"):
        sp.StreamPlan(hidden=2048, head_dim=128, heads=40, ctas=132, max_m=64, finish_tokens=24)
    with pytest.raises(ValueError, match=r"finish_tokens = 8 \(heads finished in slices after the range\) takes the "
                                         r"ring path: prefetch = 2 must be 0"):
        StreamConfig(prefetch=2, finish_tokens=8)


def test_splits_align_ranges_to_blocks():
    """splits > 0: the grid is blocks x splits and CTA b splits + j takes part j of block b's K steps (one
    segment, contributors b splits .. b splits + splits - 1), whatever the SM count."""
    for hidden, heads, d, k, ctas in ((2048, 40, 128, 1, 132), (2048, 40, 128, 3, 132), (4096, 48, 128, 2, 132),
                                      (4096, 20, 256, 5, 114), (1024, 3, 64, 16, 132)):
        p = sp.StreamPlan(hidden=hidden, head_dim=d, heads=heads, ctas=ctas, max_m=16, stages=6, splits=k)
        assert p.grid == p.blocks * k
        for c in range(p.grid):
            (b, lo, hi), = p.segments(c)
            assert b == c // k and (lo, hi) == (b * p.steps + (c % k) * p.steps // k,
                                                   b * p.steps + (c % k + 1) * p.steps // k)
        assert p.lo(p.grid) == p.units
        assert all(p.contributors(b) == (b * k, b * k + k - 1) for b in range(p.blocks))
        assert p.max_contributors == k and p.max_segments == 1
    with pytest.raises(ValueError, match=r"splits = 33 must be 0 \(a CTA per SM\) or 1..32 \(the 32 K steps"):
        sp.StreamPlan(hidden=2048, head_dim=128, heads=40, ctas=132, max_m=16, splits=33)
    with pytest.raises(ValueError, match=r"splits = -1 must be 0 \(a CTA per SM\) or >= 1 CTAs per block"):
        StreamConfig(splits=-1)
    with pytest.raises(ValueError, match=r"splits = 4 makes a grid of 160 CTAs, more than the 132 resident at once, "
                                         r"and finish_tokens = 32 has CTAs wait"):
        sp.StreamPlan(hidden=2048, head_dim=128, heads=40, ctas=132, max_m=64, stages=6, wgmma=True,
                      finish_tokens=32, splits=4)
    assert sp.StreamPlan(hidden=2048, head_dim=128, heads=40, ctas=132, max_m=64, stages=6, wgmma=True,
                         splits=4).grid == 160   # no CTA waits for another: any grid


def test_cluster_plan_and_refusals():
    """cluster: a block's splits CTAs reduce on chip: no workspace slots, a receive buffer of the other ranks'
    partials of a rank's slice in shared memory, each rank a slice of ceil(n-tiles / splits) whole n-tiles."""
    for d, m, k in ((128, 64, 2), (128, 16, 2), (64, 32, 4), (128, 64, 8)):
        p = sp.StreamPlan(hidden=2048, head_dim=d, heads=40, ctas=132, max_m=m, stages=4, wgmma=True, splits=k,
                          cluster=True)
        assert p.slots == 0 and p.workspace_floats == 0
        assert p.finish_slices == k and p.slice_tokens == m // k
        assert p.recv_bytes == (k - 1) * d * (m // k) * 4
        assert p.slice_values * 32 * p.warps * 4 * (k - 1) == p.recv_bytes     # per thread, over the CTA
        assert p.smem_bytes == p.smem_bytes_for(p.ring_stages) and p.recv_bytes < p.smem_bytes
    bad = dict(hidden=2048, head_dim=128, heads=40, ctas=132, max_m=64, stages=4, wgmma=True)
    with pytest.raises(ValueError, match=r"cluster = True reduces the splits CTAs of a block in a cluster: "
                                         r"splits = 1 must be >= 2"):
        StreamConfig(splits=1, cluster=True)
    with pytest.raises(ValueError, match=r"splits = 9 must be 2..8"):
        sp.StreamPlan(**bad, splits=9, cluster=True)
    with pytest.raises(ValueError, match=r"head_dim 256 spans 2 blocks; use cluster = False"):
        sp.StreamPlan(**{**bad, "head_dim": 256, "heads": 20}, splits=2, cluster=True)
    with pytest.raises(ValueError, match=r"finish_tokens = 32 and prefetch = 0 must be 0"):
        sp.StreamPlan(**bad, splits=2, cluster=True, finish_tokens=32)
    # every tile clusters; a rank's slice is ceil(n-tiles / splits) n-tiles, the last ranks' fewer or none
    for m, k, tokens in ((8, 2, 8), (16, 3, 8), (32, 3, 16), (64, 3, 24), (16, 4, 8), (8, 8, 8)):
        p = sp.StreamPlan(**{**bad, "max_m": m}, splits=k, cluster=True)
        assert p.slice_tokens == tokens and p.recv_bytes == (k - 1) * 128 * tokens * 4, (m, k)
        assert p.grid == 40 * k and p.lo(1) == 32 // k     # a block's K steps split over its k ranks


def test_unit_steps_plan_and_refusals():
    """unit_steps = 2: a unit (one ring stage) is two 64-value K steps of a block, each a sub-stage of its
    weight rows then its xn rows: half the units, twice the stage; the wgmma cp.async ring only."""
    one = sp.StreamPlan(hidden=2048, head_dim=128, heads=40, ctas=132, max_m=16, wgmma=True, splits=2, cluster=True)
    two = sp.StreamPlan(hidden=2048, head_dim=128, heads=40, ctas=132, max_m=16, wgmma=True, splits=2, cluster=True,
                        unit_steps=2)
    assert two.unit_k == 128 and two.steps == one.steps // 2 == 16 and two.units == one.units // 2
    assert two.stage_bytes == 2 * one.stage_bytes == 2 * (128 + 16) * 128 and two.grid == one.grid == 80
    assert two.ring_stages == 6 and two.lookahead == 4 and two.smem_bytes <= sp.SMEM_PER_CTA_MAX
    # the persistent grid: ranges across blocks count units of two steps
    p = sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=8, wgmma=True, unit_steps=2)
    assert p.steps == 32 and p.units == 48 * 32 and p.max_segments == 2
    assert StreamConfig(wgmma=True, splits=2, cluster=True, unit_steps=2).unit_steps == 2
    for u in (0, 3, True):
        with pytest.raises(ValueError, match=rf"unit_steps = {u!r} must be 1..2 K steps of 64 values per unit"):
            sp.StreamPlan(hidden=2048, head_dim=128, heads=40, ctas=132, max_m=16, wgmma=True, unit_steps=u)
    with pytest.raises(ValueError, match=r"unit_steps = 2 \(several K steps per ring stage\) takes the wgmma ring "
                                         r"filled by cp.async: wgmma = False must be True and tma = False must be "
                                         r"False"):
        StreamConfig(unit_steps=2)
    with pytest.raises(ValueError, match=r"wgmma = True must be True and tma = True must be False, or use "
                                         r"unit_steps = 1"):
        StreamConfig(wgmma=True, tma=True, unit_steps=2)
    with pytest.raises(ValueError, match=r"hidden = 2880 must be a positive multiple of 128 \(unit_steps = 2 K "
                                         r"steps of 64\): use unit_steps = 1"):
        sp.StreamPlan(hidden=2880, head_dim=64, heads=80, ctas=132, max_m=16, wgmma=True, unit_steps=2)


def test_wgmma_plan_and_refusals():
    """wgmma stages hold unpadded swizzled rows; it takes the ring, one tile per warp and 64-row multiples."""
    from flintgen.device import wgmma

    p = sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=64, stages=6, wgmma=True)
    assert p.stage_bytes == (128 + 64) * 128 == wgmma.core_offset(128 + 64, 0)
    assert sp.StreamPlan(hidden=2880, head_dim=64, heads=80, ctas=132, max_m=16, wgmma=True).warps == 4
    # the 128-byte swizzle: each chunk of each row once, in the row's own 128 bytes; the 8 rows of an atom
    # put a chunk in 8 distinct 16-byte bank groups; atoms fill whole 1024-byte units
    offs = [wgmma.core_offset(r, c) for r in range(64) for c in range(8)]
    assert sorted(offs) == list(range(0, 64 * 128, 16)) and all(o // 128 == i // 8 for i, o in enumerate(offs))
    assert all(len({wgmma.core_offset(r, c) % 128 for r in range(8 * a, 8 * a + 8)}) == 8
               for c in range(8) for a in range(8))
    # = CUTLASS's Swizzle<3, 4, 3> (SW128 K-major atoms: byte address bits 4-6 ^= bits 7-9) of the plain rows
    assert all(wgmma.core_offset(r, c) == (lambda a: a ^ ((a >> 3) & 0x70))(r * 128 + c * 16)
               for r in range(200) for c in range(8))
    assert sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=24, stages=6, wgmma=True).stage_bytes \
        % wgmma.ATOM_ALIGN == 0
    with pytest.raises(ValueError, match=r"wgmma takes the ring path \(prefetch = 2 must be 0\)"):
        StreamConfig(prefetch=2, wgmma=True)
    with pytest.raises(ValueError, match=r"one 16-row tile per warp \(warp_tiles = 2\)"):
        StreamConfig(warp_tiles=2, wgmma=True)
    with pytest.raises(ValueError, match=r"in flight past the next unit's barrier: 2 stages must be at least 3"):
        StreamConfig(stages=2, wgmma=True)
    # copies in flight: one unit fewer than the mma.sync ring (a unit's MMAs run on past the next barrier)
    assert p.lookahead == 4 and sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=64,
                                              stages=6).lookahead == 5
    with pytest.raises(ValueError, match=r"head_dim 96: 96\): use the mma.sync ring \(wgmma=False\)"):
        sp.StreamPlan(hidden=3072, head_dim=96, heads=48, ctas=132, max_m=16, wgmma=True)


def test_tma_ring_plan():
    """The TMA ring: the wgmma ring's stages plus an mbarrier each; refused without wgmma."""
    p = sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=64, stages=6, wgmma=True)
    t = sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=64, stages=6, wgmma=True, tma=True)
    assert t.stage_bytes == p.stage_bytes and t.smem_bytes == p.smem_bytes + 6 * sp.MBARRIER_BYTES
    assert t.lookahead == p.lookahead == 4
    with pytest.raises(ValueError, match=r"tma = True writes the 128-byte swizzled stages of the wgmma ring"):
        sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=64, stages=6, tma=True)
