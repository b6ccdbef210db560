"""The streaming QKV GEMV's pool (StreamPlan.pool_steps: the last K steps of
every block handed out one unit at a time by tickets, flintgen.device.tickets).

No GPU: the plan's closed forms against brute force, the merge's K order, and
the ticket protocol run as a model of the template's ring loop (the same
iterations, copies, queue slots and counters) over many interleavings of
the CTAs: every copy a stage receives is the unit consumed from it, every
unit is streamed exactly once, every queue read sees the ticket meant for it
(stored before the barrier that precedes the read, not yet overwritten), the
counters end at zero and a second launch runs the same. Compile checks
(marked compile) and H200 numerics (marked gpu) at the end.
"""

from __future__ import annotations

import random

import pytest

from flintgen.configs import qkv_stream_plan as sp
from flintgen.configs.qkv_stream_plan import POOL_DRAW_AHEAD, POOL_DRAW_LANES as tickets_lanes, POOL_QUEUE, StreamConfig

# (hidden, head_dim, heads, ctas, max_m, pool_steps, wgmma)
POOLED = [(4096, 128, 48, 132, 8, 13, True), (4096, 128, 48, 132, 16, 8, True), (3584, 128, 36, 132, 8, 12, True),
          (2048, 128, 40, 132, 8, 2, True), (8192, 128, 80, 132, 8, 24, True), (4096, 256, 24, 132, 8, 13, True),
          (3072, 96, 48, 114, 8, 6, False), (1024, 64, 10, 7, 8, 3, False), (4096, 128, 48, 132, 64, 1, True)]


def _plan(hidden, d, heads, ctas, mm, pool, wgmma, **kw):
    stages = 8 if mm <= 32 else 6
    return sp.StreamPlan(hidden=hidden, head_dim=d, heads=heads, ctas=ctas, max_m=mm, stages=stages if wgmma else 6,
                         wgmma=wgmma, finish_tokens=8, pool_steps=pool, **kw)


@pytest.mark.parametrize("case", POOLED)
def test_pool_plan_covers_every_unit_once(case):
    """Ranges of range units and the pool together hold every unit once; the segments' slots and the pool's
    are distinct and inside the workspace; each head's counter target is its units; the merge's contributors
    (closed form) are the CTAs whose segments hold the block."""
    p = _plan(*case)
    assert p.range_steps + p.pool_steps == p.steps and p.range_units + p.pool_units == p.units
    assert p.grid == min(case[3], p.range_units) and p.counters == p.heads + sp.LAUNCH_COUNTERS
    seen, slots, head_units, by_block = [0] * p.units, set(), [0] * p.heads, {}
    for c in range(p.grid):
        lo, hi = p.lo(c), p.lo(c + 1)
        assert hi - lo >= p.lookahead + POOL_DRAW_AHEAD          # the first draws precede the pool's copies
        for b, a, e in p.segments(c):
            assert b * p.range_steps <= a < e <= (b + 1) * p.range_steps
            s = p.slot(c, b)
            assert 0 <= s < p.grid * p.slots_per_cta and s not in slots
            slots.add(s)
            by_block.setdefault(b, []).append(c)
            head_units[b // p.blocks_per_head] += e - a
            for h in range(a, e):
                u = p.unit_of_range_unit(h)
                assert u // p.steps == b and u % p.steps < p.range_steps
                seen[u] += 1
    for q in range(p.pool_units):
        u = p.unit_of_pool_unit(q)
        assert u % p.steps >= p.range_steps and u // p.steps == q // p.pool_steps
        seen[u] += 1
        s = p.pool_slot(q)
        assert p.grid * p.slots_per_cta <= s < p.slots and s not in slots
        slots.add(s)
        head_units[u // p.steps // p.blocks_per_head] += 1
    assert seen == [1] * p.units and head_units == [p.head_units] * p.heads
    for b, cs in by_block.items():
        first, last = p.contributors(b)
        assert cs == list(range(first, last + 1))
    assert p.merge_terms == p.max_contributors + p.pool_steps
    assert p.workspace_floats == p.slots * p.block_rows * p.max_m
    assert p.smem_bytes <= sp.SMEM_PER_CTA_MAX


@pytest.mark.parametrize("case", POOLED)
def test_pool_merge_sums_in_k_order(case):
    """An integer GEMV through the plan: segment partials by range, one partial per pool unit, each block
    merged as the template does (contributors in CTA order, then its pool slots) equals the direct sum."""
    p = _plan(*case)
    rng = random.Random(sum(case))
    w = [rng.randrange(-9, 10) for _ in range(p.units)]
    ws = [None] * p.slots
    for c in range(p.grid):
        for b, a, e in p.segments(c):
            ws[p.slot(c, b)] = sum(w[p.unit_of_range_unit(h)] for h in range(a, e))
    for q in range(p.pool_units):
        ws[p.pool_slot(q)] = w[p.unit_of_pool_unit(q)]
    for b in range(p.blocks):
        first, last = p.contributors(b)
        terms = [p.slot(c, b) for c in range(first, last + 1)]
        terms += [p.pool_slot(b * p.pool_steps + k) for k in range(p.pool_steps)]
        assert len(terms) <= p.merge_terms
        # K order: the contributors' steps come before the pool's, each in order
        assert sum(ws[s] for s in terms) == sum(w[b * p.steps:(b + 1) * p.steps]), b


# ----------------------------------------------------------------- the ticket protocol, modelled
class _Queue:
    """The shared-memory ticket queue: each slot remembers which pool copy it holds, the iteration that
    stored it and the last iteration that read it."""

    def __init__(self):
        self.slots = [None] * POOL_QUEUE

    def store(self, q, value, it):
        old = self.slots[q % POOL_QUEUE]
        if old is not None:
            # the slot's previous ticket was last read before this iteration's barrier
            assert old["last_read"] < it, (q, old)
        self.slots[q % POOL_QUEUE] = dict(q=q, value=value, stored=it, last_read=-1)

    def peek(self, q, it):
        """The template's refill reads slot ``q & (QUEUE - 1)`` also for copies inside the range (q < 0), its
        value unused: that slot too must not be stored in the same iteration."""
        s = self.slots[q & (POOL_QUEUE - 1)]
        if s is not None:
            assert s["stored"] < it, (q, s, it)
            s["last_read"] = max(s["last_read"], it)

    def read(self, q, it):
        s = self.slots[q % POOL_QUEUE]
        assert s is not None and s["q"] == q, (q, s)     # the ticket meant for copy q, not another
        assert s["stored"] < it, (q, s, it)                # stored before the barrier of this iteration
        s["last_read"] = max(s["last_read"], it)
        return s["value"]


def _cta(p, c, counters, streamed, log):
    """One CTA of the template's ring path with a pool, as a generator that yields at each barrier of the
    ring (the interleaving points). Mirrors qkv_stream.py.j2: prologue copies, the grid wait, the range's
    segments (refill + tickets.step + consume per iteration), the pool loop, count_segments, tickets.leave."""
    L, S, POOL, LEFT = p.lookahead, p.ring_stages, p.pool_units, p.heads
    T = LEFT + 1                           # counters: heads', then CTAs that left, tickets, rows normalized
    lo, hi = p.lo(c), p.lo(c + 1)
    n = hi - lo
    stage = {}
    queue = _Queue()
    tick = [0] * tickets_lanes            # each drawing lane's pending ticket

    def refill(jn, it):
        live, u = jn < n, p.unit_of_range_unit(lo + jn)
        if jn < n:
            queue.peek(jn - n, it)
        else:
            pu = queue.read(jn - n, it)
            live, u = pu < POOL, p.unit_of_pool_unit(min(pu, POOL - 1))
        prev = stage.get(jn % S)
        assert prev is None or prev[0] == jn - S        # the stage's previous copy, consumed already
        stage[jn % S] = (jn, u if live else None)

    def step(q, it):                       # tickets.step: lane q % LANES draws, lane (q - 2) % LANES stores
        if q < 0:
            return
        if q >= 2:
            queue.store(q - 2, tick[(q - 2) % tickets_lanes], it)
        if tick[q % tickets_lanes] < POOL:
            tick[q % tickets_lanes] = counters[T]
            counters[T] += 1

    def consume(j, unit):
        jj, u = stage[j % S]
        assert jj == j and u == unit, (c, j, stage[j % S], unit)
        streamed[u] += 1

    for k in range(L):                     # before the grid-dependency wait: range units only
        assert k < n
        stage[k % S] = (k, p.unit_of_range_unit(lo + k))
    yield "wait"
    it = 0
    first_block = lo // p.range_steps
    seg_counts = []
    for seg in range(p.max_segments):
        blk = first_block + seg
        a, e = max(lo, blk * p.range_steps), min(hi, blk * p.range_steps + p.range_steps)
        for h in range(a, e):
            j = h - lo
            yield "barrier"
            refill(j + L, it)
            step(j + L + POOL_DRAW_AHEAD - n, it)
            consume(j, p.unit_of_range_unit(h))
            it += 1
        if a < e:
            seg_counts.append((blk, e - a))
    pq = 0
    pu = queue.read(pq, it)
    while pu < POOL:
        j = n + pq
        yield "barrier"
        refill(j + L, it)
        step(j + L + POOL_DRAW_AHEAD - n, it)
        consume(j, p.unit_of_pool_unit(pu))
        log.append((c, pu))
        pq += 1
        pu = queue.read(pq, it)
        it += 1
    for blk, units in seg_counts:          # count_segments: the range's segments, then the pool units, on their heads
        counters[blk // p.blocks_per_head] += units
    for _, pu in (e for e in log if e[0] == c):
        counters[pu // p.pool_steps // p.blocks_per_head] += 1
    counters[LEFT] += 1                    # arrivals.leave (after the finish)
    if counters[LEFT] == p.grid:
        counters[LEFT:LEFT + sp.LAUNCH_COUNTERS] = [0] * sp.LAUNCH_COUNTERS


def _launch(p, counters, rng, slow):
    streamed = [0] * p.units
    log = []
    ctas = {c: _cta(p, c, counters, streamed, log) for c in range(p.grid)}
    for g in ctas.values():                # every CTA before its wait (none touches a counter there)
        assert next(g) == "wait"
    live = list(ctas)
    while live:
        c = rng.choice(live)
        # slow CTAs advance less often: they take fewer pool units
        if c in slow and rng.random() < 0.7:
            continue
        try:
            next(ctas[c])
        except StopIteration:
            live.remove(c)
    return streamed, log


@pytest.mark.parametrize("case", POOLED)
def test_pool_ticket_protocol(case):
    """Three launches of the modelled ring over random interleavings (some CTAs three times slower): each
    unit streamed once per launch, every copy consumed from the stage it was issued to, every queue read the
    right ticket, stored before its barrier and overwritten only after its last read, each head counted to its
    target, the ticket counters back at zero after each launch, and slow CTAs taking fewer pool units."""
    p = _plan(*case)
    rng = random.Random(len(case) * 7 + case[0])
    counters = [0] * p.counters
    for launch in range(3):
        slow = set(rng.sample(range(p.grid), p.grid // 4))
        streamed, log = _launch(p, counters, rng, slow)
        assert streamed == [1] * p.units, launch
        assert counters[:p.heads] == [p.head_units] * p.heads       # every head complete
        assert counters[p.heads:] == [0, 0, 0]                       # reset by the last to leave
        assert sorted(pu for _, pu in log) == list(range(p.pool_units))
        counters[:p.heads] = [0] * p.heads                           # the finishers' departures (arrivals.depart)
        if p.grid > 8 and p.pool_units >= 4 * p.grid:
            taken = [sum(1 for c, _ in log if c == k) for k in range(p.grid)]
            fast = [taken[k] for k in range(p.grid) if k not in slow]
            assert sum(taken[k] for k in slow) / len(slow) < sum(fast) / len(fast)


def test_pool_ticket_protocol_one_slow_cta():
    """A CTA that streams nothing past its range until the others ran the pool dry takes no pool unit (its
    first read is already past the pool) and still leaves: the counters reset."""
    p = _plan(4096, 128, 48, 132, 8, 13, True)
    counters = [0] * p.counters
    streamed = [0] * p.units
    log = []
    gens = {c: _cta(p, c, counters, streamed, log) for c in range(p.grid)}
    for g in gens.values():
        next(g)
    for c in range(1, p.grid):              # everyone but CTA 0 runs to the end, in turn
        for _ in gens[c]:
            pass
    for _ in gens[0]:
        pass
    assert streamed == [1] * p.units and all(c != 0 for c, _ in log)
    assert counters[p.heads:] == [0, 0, 0]


@pytest.mark.parametrize("name, max_m, pool, wgmma", [("bf16_4096", 8, 13, True), ("d96_r24", 8, 6, False),
                                                     ("h16384_bf16", 8, 64, True)])
def test_pool_template_addresses_its_plan(name, max_m, pool, wgmma):
    """The rendered module (plain Python where it computes addresses): its constants are the plan's, its
    ``unit_at`` maps every range unit of every CTA's range, and ``pool_unit`` every ticket (clamped past the
    pool), to the unit the plan says."""
    import types

    from test_qkv_stream import KDEF, T132, _spec

    from flintgen import codegen
    from flintgen.kernels import qkv_stream

    cfg = StreamConfig(stages=8 if wgmma else 6, wgmma=wgmma, finish_tokens=8, pool_steps=pool)
    spec = _spec(name)
    v = KDEF.variant(spec, config=cfg, max_m=max_m, target=T132)
    src = codegen.render(v.kernel, KDEF.template_of(v), dict(KDEF.render_params(spec, v)))
    mod = types.ModuleType("rendered")
    exec(compile(src, "rendered", "exec"), mod.__dict__)
    p = qkv_stream.plan_of(dict(v.params))
    assert (mod.POOL, mod.RANGE_STEPS, mod.POOL_UNITS, mod.POOL_SLOT0) == (True, p.range_steps, p.pool_units,
                                                                         p.pool_slot(0))
    assert (mod.LEFT, mod.TICKETS, mod.N_COUNTERS) == (p.heads, p.heads + 1, p.counters)
    assert (mod.GRID, mod.MERGE_TERMS, mod.LAUNCH_COUNTERS) == (p.grid, p.merge_terms, sp.LAUNCH_COUNTERS)
    assert mod.PHASE_UNITS == (p.range_units,) and mod.LOOKAHEAD == p.lookahead
    k = mod.QKVStream()
    for c in range(p.grid):
        lo, hi = p.lo(c), p.lo(c + 1)
        assert [k.unit_at(j, lo, hi, lo) for j in range(hi - lo)] == [p.unit_of_range_unit(h) for h in range(lo, hi)]
    assert [k.pool_unit(q) for q in range(p.pool_units + 5)] == \
        [p.unit_of_pool_unit(min(q, p.pool_units - 1)) for q in range(p.pool_units + 5)]


# ----------------------------------------------------------------- refusals
def test_pool_refusals():
    with pytest.raises(ValueError, match=r"pool_steps = 64 must be 0 \(no pool\) or 1..63 \(of a block's 64 K steps "
                                         r"at hidden 4096\)"):
        _plan(4096, 128, 48, 132, 8, 64, True)
    with pytest.raises(ValueError, match=r"pool_steps = 8 \(units handed out as CTAs ask\) counts units only and "
                                         r"finishes heads in slices on the cp.async ring: it needs finish_tokens > 0 "
                                         r"\(got 0\)"):
        sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=8, stages=8, wgmma=True, pool_steps=8)
    for kw, msg in ((dict(tma=True), r"tma = False \(got True\)"), (dict(l2_prefetch=4), r"l2_prefetch = 0 \(got 4\)"),
                    (dict(tail_heads=10), r"tail_heads = 0 \(got 10\)")):
        with pytest.raises(ValueError, match=msg):
            _plan(4096, 128, 48, 132, 8, 8, True, **kw)
    with pytest.raises(ValueError, match=r"takes the ring path: prefetch = 2 must be 0"):   # (finish_tokens' refusal)
        sp.StreamPlan(hidden=4096, head_dim=128, heads=48, ctas=132, max_m=8, prefetch=2, finish_tokens=8,
                      pool_steps=8)
    # hidden 2048, 40 heads: 2 pool steps leave ranges of 9 units, 3 leave 8 (the ring keeps 6 in flight)
    with pytest.raises(ValueError, match=r"pool_steps = 3 leaves ranges of 8 units, fewer than the 9 the "
                                         r"pool's first draws need \(the ring's 6 copies in flight \+ 3\): use fewer "
                                         r"pool steps, at most 2$"):
        _plan(2048, 128, 40, 132, 8, 3, True)
    with pytest.raises(ValueError, match=r"needs finish_tokens > 0 \(got 0\)"):
        StreamConfig(stages=8, wgmma=True, pool_steps=8)
    with pytest.raises(ValueError, match=r"StreamConfig: pool_steps = -1 must be 0 \(no pool\) or more"):
        StreamConfig(pool_steps=-1)


def test_pool_queue_depth():
    """The queue's slot is ``q & (QUEUE - 1)`` (a power of two) and outlives the ring's lookahead (at most
    MAX_STAGES - 1 copies in flight): a slot is rewritten only after its last read."""
    assert POOL_QUEUE & (POOL_QUEUE - 1) == 0 and POOL_QUEUE >= sp.MAX_STAGES


def test_pool_counts_in_the_workspace():
    """The op's counters hold the largest plan's: the heads', then the CTAs that left, the pool's tickets and
    the rows normalized."""
    p = _plan(4096, 128, 48, 132, 8, 13, True)
    assert p.counters == 51 and p.pool_slot(0) == p.grid * p.slots_per_cta
    assert _plan(4096, 128, 48, 132, 8, 0, True).counters == 48


# ----------------------------------------------------------------- compiled
# (SPECS name, max_m, config): hidden 4096 at 8 and 16 tokens (the pool's candidates), an e4m3 cache,
# 256-dim heads (two blocks a head), head_dim 96 on the mma.sync ring, 64 tokens in 8 slices a head
POOL8_4096 = StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=13)
COMPILE = [("bf16_4096", 8, POOL8_4096), ("bf16_4096", 16, StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=8)),
           ("glm4_fp8", 8, StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=12)),
           ("h16384_bf16", 8, StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=64)),
           ("d96_r24", 8, StreamConfig(stages=6, finish_tokens=8, pool_steps=6)),
           ("oss_bf16", 64, StreamConfig(stages=6, wgmma=True, finish_tokens=32, pool_steps=3))]


def _cid(c):
    from test_qkv_stream import _cfg_id

    return _cfg_id(c)


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m, cfg", COMPILE, ids=[f"{n}-M{m}-{_cid(c)}" for n, m, c in COMPILE])
def test_pool_compiles_clean(name, max_m, cfg):
    """Spill-free sm_90a binaries; one ticket draw per ring loop (each segment's and the pool's), none before
    the grid-dependency wait; the acq_rel atomics are the segments' and the pool units' counts, the leaving
    count and the finishers' departures; the shared-memory queue is read by the refills and the pool loop."""
    from test_qkv_stream import _compiled, _spec

    p, ptx = _compiled(_spec(name), cfg, max_m)
    assert p["pool_steps"] == cfg.pool_steps and p["n_counters"] == p["q_heads"] + 2 * p["kv_heads"] + 3
    wait = ptx.index("griddepcontrol.wait")
    draws = [i for i in range(len(ptx)) if ptx.startswith("atom.relaxed.gpu.global.inc.u32", i)]
    assert len(draws) == p["max_segments"] + 1 and min(draws) > wait
    assert ptx.count("atom.acq_rel.gpu.global.add.s32") == p["slots_per_cta"] + 1 + 1 + p["max_owned"]
    assert ptx.count("st.relaxed.gpu.global.s32") == 3 + p["max_owned"]   # the launch counters' resets, departures
    assert ptx.count("nanosleep") == p["max_owned"]


# ----------------------------------------------------------------- GPU
def _pool_spec(name, max_tokens):
    from test_qkv import SPECS

    key = f"{name}_m{max_tokens}"
    SPECS.setdefault(key, SPECS[name].replace(max_tokens=max_tokens))
    return key, SPECS[key]


POOL16_4096 = StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=8)
GPU_CASES = ([("bf16_4096", 8, m, POOL8_4096) for m in (1, 5, 8)]
             + [("bf16_4096", 16, m, POOL16_4096) for m in (9, 16)]
             + [("glm4", 8, 7, StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=12)),
                ("h16384_bf16", 8, 3, StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=64)),
                ("d96_r24", 8, 8, StreamConfig(stages=6, finish_tokens=8, pool_steps=6)),
                ("oss_bf16", 64, 63, StreamConfig(stages=6, wgmma=True, finish_tokens=32, pool_steps=3)),
                ("flint_bf16", 8, 2, StreamConfig(stages=8, wgmma=True, finish_tokens=8, pool_steps=2))])


@pytest.mark.gpu
@pytest.mark.parametrize("name, max_tokens, m, cfg", GPU_CASES,
                         ids=[f"{n}-t{t}-M{m}-{_cid(c)}" for n, t, m, c in GPU_CASES])
def test_pool_numerics(name, max_tokens, m, cfg):
    """test_qkv's contract (residual bit-exact, v within 1 ulp of the fp64 product, q / k within 1 ulp of
    the kernel's rows normed and rotated; slot_mapping shorter than M) with the pool, five launches in a row
    (each handing out the pool again: the counters reset), and the counters at zero after."""
    from test_qkv import _numerics
    from test_qkv_stream import _counters_zero, _op

    key, spec = _pool_spec(name, max_tokens)
    op = _op(spec, cfg)
    for _ in range(5):
        _numerics(op, key, m, max(1, m - 1 - m // 8))
    _counters_zero(op)
