"""Decode attention with logit soft-capping (Gemma 2's ``attn_logit_softcapping``):
``cap * tanh(s * scale / cap)`` before the softmax, the cap a runtime
argument (``softcap=``), its presence the spec field ``attn_logit_softcap``;
sink logits are not capped.

* CPU: the kernel's tanh formula (``decode_mma.softcap_logit``, run through
  the emulator's PTX mocks) against fp64; the op's rejections; the fp64
  reference against an independent per-token implementation; rendered
  source and variant identity; the CPU emulator (tests/da_emulator.py)
  running generated soft-capping variants (cluster, split-merge and
  single-split launches, one and two head tiles) against the reference with
  logits up to ~3-4x the cap and sinks above it; compiles for sm_90a
  (``compile``).
* GPU (``gpu``): B = 1, 3, 64 with mixed lengths, the emulator's cases on
  the H200, and CUDA-graph replays with changed lengths and two caps.
"""

import random

import numpy as np
import pytest
import torch

from flintgen import cache, codegen
from flintgen.kernels.base import Target
from flintgen.kernels.decode_attention import LOG2E, DecodeAttentionDef, launch_scalars
from flintgen.presets import FLINT
from flintgen.references.decode_attention import (
    decode_attention_ref,
    decode_attention_seed_rounding,
    rel_error,
)

from decode_attention_cases import Case, call_op, check_compiled, cpu_op_args, precompile, record, refill
from test_decode_attention_shapes import EmulatedOp, run_shape, shape_spec

KDEF = DecodeAttentionDef()
T132 = Target("sm_90a", 132)
SOFT = FLINT.replace(name="flint-softcap", attn_logit_softcap=True)


def _no_load(v):
    raise AssertionError("no kernel load expected")


def soft_spec(gqa, head_dim, page, *, sinks=True, kv=1, max_batch=80):
    s = shape_spec(gqa, head_dim, page, sinks=sinks, kv=kv, max_batch=max_batch)
    return s.replace(name=s.name + "-softcap", attn_logit_softcap=True)


# ----------------------------------------------------------------- the tanh
def _emulated_decode_mma():
    """decode_mma as the emulator runs it (PTX wrappers mocked in numpy fp32):
    its ``softcap_logit`` takes numpy arrays."""
    import da_emulator

    v = KDEF.variants(SOFT, T132)[0]
    src = codegen.render(v.kernel, KDEF.template, dict(KDEF.render_params(SOFT, v)))
    return da_emulator.load(src, da_emulator.GlobalMemory(1 << 16))["decode_mma"]


def _logits(rng, cap, scale):
    """fp32 raw logits s whose s * scale covers [-3 cap, 3 cap], near 0 and near +-cap."""
    lim = 3 * cap / scale
    parts = [rng.uniform(-lim, lim, 100_000), np.linspace(-lim, lim, 100_001),
             rng.uniform(-1e-3, 1e-3, 20_000) * cap / scale, np.array([0.0, -0.0])]
    for c in (cap, -cap):
        parts.append((c + rng.uniform(-0.05, 0.05, 40_000) * cap) / scale)
    return np.concatenate(parts).astype(np.float32)


def test_softcap_formula_error():
    """``softcap_logit`` (cap - 2 cap / (ex2(s k) + 1), k = 2 log2(e) scale /
    cap; ex2.approx, rcp.approx, fma) against fp64 cap * tanh(s * scale / cap),
    with ex2 exact in fp32 and off by +-2 ulp and the reciprocal off by +-1
    ulp (the PTX bounds): the absolute error stays below 5.5e-7 * cap (measured
    at most 5.3e-7 * cap),
    the result within [-cap, cap], exactly +-cap once saturated and 0 at 0."""
    m = _emulated_decode_mma()
    exact_ex2 = m.ptx.ex2
    exact_rcp = m.rcp_approx
    rng = np.random.default_rng(7)
    worst = 0.0
    for cap in (1.0, 5.0, 30.0, 50.0):
        for scale in (1 / 16, 1 / 12, 128 ** -0.5, 1.0):
            s = _logits(rng, cap, scale)
            ref = cap * np.tanh(s.astype(np.float64) * scale / cap)
            _, k, c = (np.float32(x) for x in launch_scalars(scale, cap))
            for ulps, rulps in ((0, 0), (2, 1), (-2, -1), (2, -1), (-2, 1)):
                # ex2 off by +-2 ulp, rcp.approx by +-1 (ex2 overflows to inf where s k > 128: expected)
                m.ptx.ex2 = lambda x, u=ulps: np.float32(exact_ex2(x) * (1.0 + u * 2.0 ** -23))
                m.rcp_approx = lambda x, u=rulps: np.float32(exact_rcp(x) * (1.0 + u * 2.0 ** -23))
                with np.errstate(over="ignore"):
                    got = m.softcap_logit(s, k, c)
                assert got.dtype == np.float32
                err = np.abs(got.astype(np.float64) - ref).max() / cap
                worst = max(worst, err)
                assert err < 5.5e-7, (cap, scale, ulps, rulps, err)
                assert np.abs(got).max() <= np.float32(cap)
            m.ptx.ex2, m.rcp_approx = exact_ex2, exact_rcp
            assert m.softcap_logit(np.float32(0.0), k, c) == 0.0
            big = np.float32(60 * cap / scale)    # ex2 overflows to inf / flushes to 0
            with np.errstate(over="ignore"):
                assert m.softcap_logit(big, k, c) == np.float32(cap)
            assert m.softcap_logit(-big, k, c) == -np.float32(cap)
    record(f"softcap_logit: max |error| / cap = {worst:.3e}")


def test_launch_scalars():
    """Without capping exp2's factor is scale log2 e; with it log2 e (the
    logits come out of the tanh scaled), k = 2 log2(e) scale / cap and cap."""
    assert launch_scalars(0.125, None) == (0.125 * LOG2E,)
    lg, k, cap = launch_scalars(0.125, 50.0)
    assert lg == LOG2E and cap == 50.0 and k == pytest.approx(2 * LOG2E * 0.125 / 50.0, rel=1e-15)


# ----------------------------------------------------------------- validation (CPU)
_args = cpu_op_args
_call = call_op


SOFTCAP_REJECTIONS = [
    (SOFT, {}, ValueError, r"spec 'flint-softcap' has attn_logit_softcap=True: pass softcap, the logit cap "
                           r"\(a finite number > 0, e\.g\. 50\.0"),
    (SOFT, dict(softcap=None), ValueError, r"has attn_logit_softcap=True: pass softcap"),
    (SOFT, dict(softcap="50"), TypeError, r"softcap must be a number \(the logit cap\), got str '50': pass e\.g\. "
                                          r"softcap=50\.0"),
    (SOFT, dict(softcap=True), TypeError, r"softcap must be a number \(the logit cap\), got bool True"),
    (SOFT, dict(softcap=torch.tensor(50.0)), TypeError, r"softcap must be a number .*got Tensor"),
    (SOFT, dict(softcap=0.0), ValueError, r"softcap must be a finite number > 0 \(the logit cap\), got 0\.0: pass "
                                          r"e\.g\. softcap=50\.0, or build a spec with attn_logit_softcap=False"),
    (SOFT, dict(softcap=-30.0), ValueError, r"softcap must be a finite number > 0 .*got -30\.0"),
    (SOFT, dict(softcap=float("inf")), ValueError, r"softcap must be a finite number > 0 .*got inf"),
    (SOFT, dict(softcap=float("nan")), ValueError, r"softcap must be a finite number > 0 .*got nan"),
    (SOFT, dict(softcap=1e-38), ValueError, r"softcap=1e-38 with scale=0\.088\d* is outside fp32's range .*"
                                            r"2 log2\(e\) scale / cap = 2\.55e\+37"),
    (FLINT, dict(softcap=50.0), ValueError, r"softcap=50\.0 but spec 'flint' has attn_logit_softcap=False: pass "
                                            r"softcap=None, or build a spec with attn_logit_softcap=True"),
]


@pytest.mark.parametrize("spec, kw, exc, match", SOFTCAP_REJECTIONS, ids=[m[:40] for *_, m in SOFTCAP_REJECTIONS])
def test_rejects_softcap(spec, kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(KDEF.bind(spec, T132, _no_load), _args(), **kw)


def test_valid_softcap_reaches_the_device_checks():
    """A valid cap (int or float) passes: the next check is the device one."""
    op = KDEF.bind(SOFT, T132, _no_load)
    for cap in (50.0, 30, 1e-3):
        with pytest.raises(ValueError, match="q must be on a CUDA device"):
            _call(op, _args(), softcap=cap)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):   # no cap without capping
        _call(KDEF.bind(FLINT, T132, _no_load), _args(), softcap=None)


def test_softcap_positional_is_refused():
    """``softcap`` is keyword-only: a ninth positional argument is an error."""
    with pytest.raises(TypeError):
        KDEF.bind(SOFT, T132, _no_load)(*_args().values(), 50.0)


# ----------------------------------------------------------------- references
def _independent_ref(q, kv, bt, lens, sinks, window, scale, softcap):
    """Per (request, head, token) in fp64, from the block table directly:
    w_i = exp(c_i - m), c_i = cap tanh(q.k_i scale / cap), the sink's
    exp(sink - m) in the denominator only."""
    b, hq, d = q.shape
    hkv, page = kv.shape[1], kv.shape[2]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for r in range(b):
        n = int(lens[r])
        start = max(n - window, 0) if window is not None else 0
        if n == 0:
            continue
        for h in range(hq):
            kvh = h // (hq // hkv)
            qv = q[r, h].double()
            logits, vs = [], []
            for pos in range(start, n):
                row = kv[int(bt[r, pos // page]), kvh, pos % page].double()
                x = float(qv @ row[:d]) * scale
                logits.append(softcap * np.tanh(x / softcap) if softcap is not None else x)
                vs.append(row[d:])
            sink = float(sinks[h]) if sinks is not None else -np.inf
            mx = max(max(logits), sink)
            w = np.exp(np.array(logits) - mx)
            den = w.sum() + np.exp(sink - mx)
            out[r, h] = (torch.from_numpy(w)[:, None] * torch.stack(vs)).sum(0) / den
    return out


@pytest.mark.parametrize("window, sinks, cap, q_scale, bends", [
    (None, True, 2.0, 1.5, True), (128, True, 50.0, 50.0, True), (None, False, 1.0, 4.0, True),
    (128, False, 50.0, 1.5, False)])   # logits well inside the cap: capping bends them a little
def test_reference_matches_an_independent_implementation(window, sinks, cap, q_scale, bends):
    spec = soft_spec(4, 64, 16, sinks=sinks, kv=2, max_batch=4)
    case = Case(spec, [150, 0, 33, 17], window, seed=int(cap) + (window or 0), device="cpu", softcap=cap,
                q_scale=q_scale)
    if sinks:   # some sinks above the cap: uncapped they outweigh every capped logit
        case.sinks[::2] = cap * (1.1 + torch.rand(4, generator=torch.Generator().manual_seed(1)))
    a = (case.q, case.kv, case.bt, case.lens, case.sinks, window, case.scale)
    ref = decode_attention_ref(*a, softcap=cap)
    ind = _independent_ref(*a, cap)
    assert (ref - ind).abs().max() < 1e-12
    assert rel_error(decode_attention_seed_rounding(*a, softcap=cap), ref) < 1e-2
    # The capping matters (a reference ignoring it, or capping the sinks, is far off).
    assert rel_error(decode_attention_ref(*a), ref) > (0.05 if bends else 1e-3)
    if sinks:
        capped_sinks = cap * torch.tanh(case.sinks / cap)
        assert rel_error(decode_attention_ref(*a[:4], capped_sinks, *a[5:], softcap=cap), ref) > 0.05


# ----------------------------------------------------------------- source and identity
def test_softcap_source_and_variant_identity():
    """Soft-capping variants render SOFTCAP = True and take softcap_k and
    softcap_cap after window; the others render SOFTCAP = False and nothing
    else of it, keep their names, and differ in key from their twins."""
    plain, soft = KDEF.variants(FLINT, T132), KDEF.variants(SOFT, T132)
    assert len(plain) == len(soft)
    for p, s in zip(plain, soft):
        assert "softcap" not in p.name and "-softcap1" in s.name
        assert dict(s.params) == dict(p.params, softcap=True)
        src_p = codegen.render(p.kernel, KDEF.template, dict(KDEF.render_params(FLINT, p)))
        src_s = codegen.render(s.kernel, KDEF.template, dict(KDEF.render_params(SOFT, s)))
        lines = [ln for ln in src_p.splitlines() if "softcap" in ln.lower()]
        assert [ln.split("#")[0].strip() for ln in lines] == ["", "SOFTCAP = False"], lines  # header, constant
        consts = {ln.split("#")[0].strip() for ln in src_s.splitlines()}
        assert "SOFTCAP = True" in consts
        assert "scale_log2, window, softcap_k, softcap_cap" in src_s
        # Tile 0's scores take the cap on both slice paths (K and V at once; K then V).
        assert src_s.count("softcap_k: Float32,") == 2 and src_s.count("HEAD_DIM, 0, cap") == 2
        kp = cache.make_entry(p, KDEF.template, dict(KDEF.render_params(FLINT, p)), T132, "/x").key
        ks = cache.make_entry(s, KDEF.template, dict(KDEF.render_params(SOFT, s)), T132, "/x").key
        assert kp != ks
    two_tiles = soft_spec(16, 128, 16)
    v = KDEF.variants(two_tiles, T132)[0]
    src = codegen.render(v.kernel, KDEF.template, dict(KDEF.render_params(two_tiles, v)))
    assert "HEAD_DIM, 0, cap" in src and "HEAD_DIM, 1, cap" in src


# ----------------------------------------------------------------- emulated (CPU)
# (GQA, head_dim, page, sinks, window, seq_lens, cap, q_scale): s * scale has a
# standard deviation of ~q_scale, so the logits reach ~2-4x the cap. Sinks,
# when on, exceed the cap on every other head (they then outweigh every
# capped logit, which they would not uncapped).
EMULATED = [
    (8, 64, 16, True, 128, [130, 17], 2.0, 1.5),         # 4-rank cluster merge
    (8, 64, 16, True, None, [600, 33], 50.0, 50.0),      # 132 splits merged through partials; logits ~+-150
    (4, 128, 32, False, None, [600], 1.0, 4.0),          # padded tile, 8-warp splits; saturated tanh
    (16, 64, 64, True, None, [600] + [0] * 16, 5.0, 4.0),  # two head tiles, 2 splits
    (16, 128, 16, False, 128, [150] + [0] * 64, 30.0, 20.0),  # two tiles, one split per pair
    (3, 64, 16, True, 128, [145, 0, 1], 3.0, 3.0),       # odd ratio, padded tile; cluster of 4; one token
    (2, 256, 16, False, None, [700, 1], 50.0, 30.0),     # Gemma 2: K then V per slice, split partials
    (2, 256, 16, True, 128, [150], 50.0, 30.0),          # head_dim 256 cluster
    (1, 96, 16, True, None, [600, 17], 5.0, 4.0),        # head_dim 96, MHA
]


def _emulated_case(gqa, head_dim, page, sinks, window, lens, cap, q_scale, device="cpu"):
    spec = soft_spec(gqa, head_dim, page, sinks=sinks, kv=1, max_batch=80)
    case = Case(spec, lens, window, seed=len(lens) + int(cap), device=device, softcap=cap, q_scale=q_scale)
    if sinks:
        g = torch.Generator(device=device).manual_seed(gqa)
        case.sinks[::2] = cap * (1.1 + 0.5 * torch.rand(case.sinks[::2].shape, generator=g, device=device))
    return spec, case


@pytest.mark.parametrize("gqa, head_dim, page, sinks, window, lens, cap, q_scale", EMULATED, ids=lambda x: None)
def test_emulated_softcap_kernel(gqa, head_dim, page, sinks, window, lens, cap, q_scale):
    """The generated soft-capping kernel, run on the CPU by the emulator,
    matches the fp64 reference within the usual bound (<= 1e-2 and <= 2x a
    torch computation with the kernel's roundings), where ignoring the cap
    or capping the sinks too would be far off."""
    spec, case = _emulated_case(gqa, head_dim, page, sinks, window, lens, cap, q_scale)
    op = EmulatedOp(spec)
    out = case.poisoned_out()
    op(*case.args(out), **case.kwargs())
    label = (f"emulated {spec.name} cap={cap} q_scale={q_scale} window={window} b={len(lens)} "
             f"{op.config(len(lens), window is not None).as_params()}")
    ek, _ = case.check(out, label)
    a = (case.q, case.kv, case.bt, case.lens, case.sinks, window, case.scale)
    live = case.lens > 0
    uncapped = rel_error(out[live], decode_attention_ref(*a)[live])
    assert uncapped > max(20 * ek, 0.02), f"{label}: capping does not matter here ({uncapped:.3e})"
    if sinks:
        capped_sinks = decode_attention_ref(*a[:4], cap * torch.tanh(case.sinks / cap), *a[5:], softcap=cap)
        assert rel_error(out[live], capped_sinks[live]) > max(20 * ek, 0.02), f"{label}: sinks do not matter"


# ----------------------------------------------------------------- compile
def _compile_cases():
    out = []
    for spec in (SOFT, soft_spec(16, 128, 16, kv=1), soft_spec(4, 64, 32, kv=2)):
        op = KDEF.bind(spec, T132, _no_load)
        fams = {}
        for sliding in (True, False):
            for b in (1, 3, 64):
                v = op._variants[sliding][b]
                fams.setdefault((sliding, v["cluster"], v["num_splits"] > 1), v)
        out += [pytest.param(spec, v, id=f"{spec.name}-{v.name[len('decode_attention-'):]}") for v in fams.values()]
    return out


@pytest.mark.compile
@pytest.mark.parametrize("spec, variant", _compile_cases())
def test_softcap_variant_compiles_clean(spec, variant):
    """No spills, stack or local memory; the tanh is ex2.approx + rcp.approx, never tanh.approx."""
    from flintgen.runtime import load_variant

    load_variant(KDEF, spec, variant, T132)   # default cache root: reused across runs
    res, ptx = check_compiled(KDEF, spec, variant, T132, need=("rcp.approx.ftz.f32",))
    assert "tanh" not in ptx
    record(f"compile {spec.name} {variant.name}: {res['registers']} registers")


# ================================================================= GPU
SOFT_SHAPES = [(8, 128, 16), (8, 64, 16), (16, 128, 64), (4, 64, 32), (2, 256, 16), (4, 256, 64), (1, 96, 16)]
SOFT_PLAN = [(128, 1), (128, 3), (128, 64), (None, 1), (None, 3), (None, 64)]
GRAPH_PLAN = [(128, 2), (None, 3), (None, 40)]


def planned_plans():
    """(spec, [(window, batch), ...]) of every launch the GPU tests below make."""
    plans = [(soft_spec(*s, sinks=sinks, kv=2), SOFT_PLAN) for s in SOFT_SHAPES for sinks in (True, False)]
    plans += [(soft_spec(*c[:3], sinks=c[3], kv=1, max_batch=80), [(c[4], len(c[5]))]) for c in EMULATED]
    # The graph test warms up (softcap=1.0, seq_len 0) every variant of its spec.
    plans += [(soft_spec(8, 128, 16, kv=2), [(w, b) for w in (128, None) for b in range(1, 81)])]
    return plans


@pytest.fixture(scope="module")
def precompiled():
    """Compile every variant the GPU tests below launch, in parallel, first."""
    from flintgen import toolchain

    record(f"precompiled {precompile(planned_plans(), KDEF, toolchain.resolve_target(), _no_load)} "
           "soft-capping decode-attention variants")


@pytest.mark.gpu
@pytest.mark.parametrize("gqa, head_dim, page", SOFT_SHAPES, ids=lambda x: str(x))
def test_softcap_gpu(precompiled, gqa, head_dim, page):
    """B = 1, 3, 64, window 128 and full, mixed and edge lengths, sinks on
    and off, fresh inputs and poisoned outputs; cap 50 with logits up to
    ~3x it (q_scale 50) and cap 5 with logits mostly inside it."""
    import flintgen

    for sinks in (True, False):
        spec = soft_spec(gqa, head_dim, page, sinks=sinks, kv=2)
        op = flintgen.get_kernel(spec, "decode_attention")
        for cap, q_scale in ((50.0, 50.0), (5.0, 1.5)):
            run_shape(op, spec, "cuda", SOFT_PLAN, seed=gqa + page + int(cap), softcap=cap, q_scale=q_scale,
                      tag=f"softcap {cap} ")


@pytest.mark.gpu
@pytest.mark.parametrize("gqa, head_dim, page, sinks, window, lens, cap, q_scale", EMULATED, ids=lambda x: None)
def test_softcap_emulated_cases_gpu(precompiled, gqa, head_dim, page, sinks, window, lens, cap, q_scale):
    """The H200 twin of test_emulated_softcap_kernel (sinks above the cap)."""
    import flintgen

    spec, case = _emulated_case(gqa, head_dim, page, sinks, window, lens, cap, q_scale, device="cuda")
    out = case.poisoned_out()
    flintgen.get_kernel(spec, "decode_attention")(*case.args(out), **case.kwargs())
    case.check(out, f"gpu {spec.name} cap={cap} window={window} b={len(lens)}")


@pytest.mark.gpu
def test_softcap_cuda_graph_replay(precompiled):
    """After ``warmup`` (every variant run once with softcap=1.0), graphs of
    three launches (B = 2: an 8-rank cluster; B = 3: 22 splits
    merged through partials; B = 40: 3 splits, one active for short lengths)
    captured with cap 30 and again with cap 4 (same buffers, same binaries:
    the cap is a launch argument), replayed alternately 40 times with
    lengths and block tables changed in place: each replay matches the
    reference of its own cap; counters end at 0."""
    import flintgen

    spec = soft_spec(8, 128, 16, kv=2)
    op = flintgen.get_kernel(spec, "decode_attention")
    op.warmup(torch.device("cuda"))
    rnd = random.Random(11)
    page, width = spec.page_size, 40
    cases = []
    for window, b in GRAPH_PLAN:
        case = Case(spec, [width * page] * b, None, seed=b, extra_cols=0, softcap=30.0, q_scale=12.0)
        case.window = window
        cases.append(case)
    outs = {cap: [torch.empty_like(c.q) for c in cases] for cap in (30.0, 4.0)}
    graphs = {}
    for cap, out in outs.items():
        for c, o in zip(cases, out):
            op(*c.args(o), softcap=cap)
        torch.cuda.synchronize()
        graphs[cap] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[cap]):
            for c, o in zip(cases, out):
                op(*c.args(o), softcap=cap)
    for it in range(40):
        cap = (30.0, 4.0)[it % 2]
        for c in cases:
            lens = [rnd.choice([0, 1, page - 1, page + 1, rnd.randint(1, width * page), width * page])
                    for _ in range(c.q.shape[0])]
            refill(c, rnd, lens, page)
        for o in outs[cap]:
            o.fill_(float("nan"))
        graphs[cap].replay()
        if it % 8 < 2 or it >= 38:
            for c, o in zip(cases, outs[cap]):
                c.softcap = cap
                c.check(o, f"softcap graph cap={cap} replay {it} window={c.window} b={c.q.shape[0]}")
    torch.cuda.synchronize()
    ws = op._workspaces[torch.device("cuda", torch.cuda.current_device())]
    assert int(ws.counters.abs().sum()) == 0
