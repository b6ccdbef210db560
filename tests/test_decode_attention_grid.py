"""Decode attention over the grid of attention shapes real models use.

Grid (per rank): GQA 1, 2, 3, 5, 6, 7, 8, 12, 16 x head_dim 64, 96, 128, 256
(256 for GQA <= 8; two head tiles at 256 are refused at build time) x full
attention / short window (the cluster path) / long window (4096: the split
path) x kv heads 1 and 8 x pages 16 and 64, max_batch 256.

* CPU: every grid point's launch configurations validate (shared memory,
  epilogue, merge and cluster mappings), and the refusal at 256 x GQA > 8.
* ``compile`` (CI, sm_90a): the grid's code-path families compile with the
  design's PTX and no spills, stack or local memory. A family is what a
  binary's code paths depend on: GQA, head_dim, whether a page holds several
  slices, sliding, cluster, warps, split or not, the merge (merge_ctas,
  merge_from > 0); each is compiled at its fewest splits, and per (head_dim,
  head tiles, merge, cluster) the most-split launch too (its merge loops are
  unrolled over the static split count: the register-heaviest). kv heads
  change only the grid's y extent and which families a batch picks, so the
  families of both kv counts are compiled once each. Soft-capping is on with
  pages of 64 and off with 16 (a pairwise cover: capping touches only the
  scores, the page only the block-id path). The full product (about 11000
  launch variants at max_batch 256) differs from these only in constants.
  fp8 e4m3 caches add a pairwise cover (``fp8_families``, 42 binaries):
  per head_dim a padded one-tile GQA (3) and a second GQA (12, two tiles;
  8 at head_dim 256), one kv head, pages and soft-capping alternating, every
  epilogue family of both (cluster, one split, split partials merged by
  one or several CTAs) at its fewest splits plus the most-split launches;
  their PTX has cvt.rn.f16x2.e4m3x2 and the f16 mma, not the bf16 one.
* ``gpu`` (H200): every (GQA, head_dim) at B = 1, 3 and 64, full attention
  and window 128, mixed lengths (0, 1, slice / page / window edges, up to
  5k) against the fp64 reference with the existing bound; long windows 512,
  1024, 2047 and 4096 on the split path at W - 1, W, W + 1.
"""

import random

import pytest

from flintgen import cache, codegen
from flintgen.configs import decode_attention_config as dac
from flintgen.kernels.base import Target
from flintgen.kernels.decode_attention import DecodeAttentionDef
from flintgen.presets import FLINT

from decode_attention_cases import Case, check_compiled, lens_for, precompile, record

KDEF = DecodeAttentionDef()
T132 = Target("sm_90a", 132)
GRID_GQA = (1, 2, 3, 5, 6, 7, 8, 12, 16)
GRID_DIMS = (64, 96, 128, 256)
PAIRS = [(g, d) for d in GRID_DIMS for g in GRID_GQA if not (d == 256 and g > 8)]
WINDOWS = (None, 128, 4096)          # full; short (cluster path); long (split path)
LONG_WINDOWS = (512, 1024, 2047, 4096)


def grid_spec(gqa, head_dim, *, kv=8, page=16, window=None, sinks=True, max_batch=256, softcap=False):
    kinds = ("full",) if window is None else ("sliding", "full")
    return FLINT.replace(name=f"grid-g{gqa}-d{head_dim}-kv{kv}-p{page}-w{window}-{'s' if sinks else 'n'}"
                              + ("-cap" if softcap else ""),
                         num_q_heads=gqa * kv, num_kv_heads=kv, head_dim=head_dim, page_size=page,
                         sinks=sinks, sliding_window=window, layer_types=kinds, max_batch=max_batch,
                         attn_logit_softcap=softcap)


def _no_load(v):
    raise AssertionError("no kernel load expected")


def _pid(pair):
    return "g{}-d{}".format(*pair)


# ----------------------------------------------------------------- heuristics
@pytest.mark.parametrize("gqa, head_dim", PAIRS, ids=[_pid(p) for p in PAIRS])
def test_grid_configs_valid(gqa, head_dim):
    for kv in (1, 8):
        for window in WINDOWS + LONG_WINDOWS:
            for sms in (132, 114):
                cfgs = dac.all_configs(max_batch=256, num_kv_heads=kv, sliding=window is not None, window=window,
                                       head_dim=head_dim, gqa=gqa, page_size=16, num_sms=sms)
                for b, c in cfgs.items():        # __post_init__ validated smem, epilogue, merge, cluster
                    assert (c.head_dim, c.gqa) == (head_dim, gqa)
                    short = window is not None and dac.is_short_window(window)
                    assert c.cluster == (short and b * kv <= 64 and 2 * b * kv <= sms)   # one wave of clusters
                    if c.cluster and b * kv > 8:
                        assert c.num_splits in ((2, 4) if b * kv <= 16 else (2,))   # 4 unless _fit_cluster shrinks it
                    assert c.early_release == (not c.cluster)      # the release rule (DecodeAttentionConfig)
                    if short and sms < b * kv <= 2 * sms:          # one to two single-split pairs per SM
                        assert (c.num_splits, c.num_stages, c.ctas_per_sm) == (1, 2, dac.SHORT_WINDOW_CTAS_PER_SM)
                    assert c.kv_parts == (2 if head_dim == 256 else 1)
                    assert c.ring_bytes + 4 * c.cluster_floats <= dac.SMEM_PER_CTA_MAX
                assert dac.max_partials(cfgs, kv) <= 3 * sms   # head_dim 64: 3 splits x 88 pairs


def test_early_release_rule_and_override():
    """None resolves to the rule (every launch but clusters); an explicit value stays and names the binary."""
    one, clu = dac.DecodeAttentionConfig(1, 4, 2, 1, False, 2), dac.DecodeAttentionConfig(4, 4, 3, 1, True, 0)
    assert one.early_release is True and clu.early_release is False
    late = dac.DecodeAttentionConfig(1, 4, 2, 1, False, 2, early_release=False)
    assert late.early_release is False and late != one and late.as_params()["early_release"] is False
    spec = grid_spec(8, 128, kv=8, window=128, max_batch=33)
    names = {v.name for v in KDEF.variants(spec, T132)}
    assert any("-early_release1-" in n and "-cluster0-" in n for n in names)
    assert any("-early_release0-" in n and "-cluster1-" in n for n in names)
    for v in KDEF.variants(spec, T132):
        src = codegen.render(v.kernel, KDEF.template, dict(KDEF.render_params(spec, v)))
        assert f"EARLY_RELEASE = {not v['cluster']}" in src
        assert ("dependents are released at entry" in src) == (not v["cluster"])


@pytest.mark.parametrize("gqa", [9, 12, 16])
def test_head_dim_256_with_two_tiles_is_refused(gqa):
    with pytest.raises(NotImplementedError, match=rf"head_dim = 256 with GQA {gqa} is not supported"):
        KDEF.variants(grid_spec(gqa, 256, kv=2), T132)


# ----------------------------------------------------------------- compile (CI)
def family(v):
    return (v["gqa"], v["head_dim"], v["page_size"] > 16, v["sliding"], v["cluster"], v["num_warps"],
            v["num_splits"] > 1, v["merge_ctas"], v["merge_from"] > 0, bool(dict(v.params).get("softcap")))


def grid_families():
    """{key: (spec, variant)}: each code-path family of the grid (both kv
    counts, pages 16 and 64, every window kind) at its fewest splits, plus the
    register-heaviest launches: per (head_dim, head tiles, merge, cluster) the
    most splits (the merge loops are unrolled over the static split count)."""
    fams, heavy = {}, {}
    for gqa, d in PAIRS:
        for kv in (1, 8):
            for page in (16, 64):
                for window in WINDOWS:
                    # Soft-capping pairs with the page size (on with pages of 64): each
                    # family of both is compiled, not the product (capping changes only
                    # the scores; the page only the block-id path).
                    spec = grid_spec(gqa, d, kv=kv, page=page, window=window, softcap=page == 64)
                    for v in KDEF.variants(spec, T132):
                        k = family(v)
                        if k not in fams or fams[k][1]["num_splits"] > v["num_splits"]:
                            fams[k] = (spec, v)
                        k = ("heaviest", d, gqa > 8, v["merge_ctas"], v["cluster"], page == 64)
                        if k not in heavy or heavy[k][1]["num_splits"] < v["num_splits"]:
                            heavy[k] = (spec, v)
    return {**fams, **heavy}


def fp8_families():
    """{key: (spec, variant)} of the fp8 cover (module docstring): what the
    e4m3 path changes is the K / V loads (head_dim), q's conversion (padded
    and two-tile q), the scales' folding (soft-capping) and v_scale's way
    through every epilogue, so the key is (head_dim, GQA, softcap, cluster,
    split, merge); page and window length are bf16's business."""
    fams, heavy = {}, {}
    for d in GRID_DIMS:
        for i, gqa in enumerate((3, 12) if d != 256 else (3, 8)):
            page = (16, 64)[(i + d // 32) % 2]
            spec = grid_spec(gqa, d, kv=1, page=page, window=128, softcap=(i + d // 64) % 2 == 0)
            spec = spec.replace(name=spec.name + "-fp8", kv_cache_dtype="fp8_e4m3")
            for v in KDEF.variants(spec, T132):
                k = ("fp8", d, gqa, bool(dict(v.params).get("softcap")), v["cluster"], v["num_splits"] > 1,
                     v["merge_ctas"], v["merge_from"] > 0)
                if k not in fams or fams[k][1]["num_splits"] > v["num_splits"]:
                    fams[k] = (spec, v)
                k = ("fp8-heaviest", d, gqa > 8, v["merge_ctas"], v["cluster"])
                if k not in heavy or heavy[k][1]["num_splits"] < v["num_splits"]:
                    heavy[k] = (spec, v)
    return {**fams, **heavy}


_FAMILIES = {**grid_families(), **fp8_families()}


@pytest.fixture(scope="module")
def built_families():
    """Compile every family in parallel (one process per CPU core) into the
    default cache root; returns {variant name: entry dir, or the build's
    exception (a spill is refused: KernelResourceError)}."""
    from flintgen.cli import _build_one
    from flintgen.procutil import run_spawned

    todo = {v.name: (spec, v) for spec, v in _FAMILIES.values()}
    done = run_spawned(_build_one, [(spec, "decode_attention", v, T132, cache.default_root())
                                    for spec, v in todo.values()], return_exceptions=True)
    # an exception is reported by the family's test
    return {name: r if isinstance(r, BaseException) else r[4] for name, r in zip(todo, done)}


@pytest.mark.compile
@pytest.mark.parametrize("key", sorted(_FAMILIES, key=str), ids=lambda k: "-".join(map(str, k)))
def test_grid_family_compiles_clean(built_families, key):
    spec, v = _FAMILIES[key]
    built = built_families[v.name]
    if isinstance(built, Exception):
        raise built
    assert cache.make_entry(v, KDEF.template, dict(KDEF.render_params(spec, v)), T132).dir == built
    _, ptx = check_compiled(KDEF, spec, v, T132)
    assert ("mapa.shared::cluster" in ptx) == v["cluster"]
    fp8 = bool(dict(v.params).get("kv_fp8"))
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == fp8 and (KDEF.BF16_MMA in ptx) != fp8


# ----------------------------------------------------------------- GPU
GPU_PLAN = [(None, 1), (None, 3), (None, 64), (128, 1), (128, 3), (128, 64)]
LEN_CAP = 5000


def _edges(page, window):
    return [0, 1, 2, 15, 16, 17, page - 1, page, page + 1, window - 1, window, window + 1, 4999]


def _gpu_spec(gqa, d):
    return grid_spec(gqa, d, kv=2, window=128, sinks=gqa % 2 == 1, max_batch=64)


def _long_specs():
    return [grid_spec(g, d, kv=2, window=4096, max_batch=4) for g, d in ((1, 96), (7, 128), (2, 256), (16, 64))]


@pytest.fixture(scope="module")
def precompiled_grid():
    from flintgen import toolchain

    plans = [(_gpu_spec(g, d), GPU_PLAN) for g, d in PAIRS] + [(s, [(4096, 4)]) for s in _long_specs()]
    record(f"precompiled {precompile(plans, KDEF, toolchain.resolve_target(), _no_load)} grid variants")


@pytest.mark.gpu
@pytest.mark.parametrize("gqa, head_dim", PAIRS, ids=[_pid(p) for p in PAIRS])
def test_grid_shape(precompiled_grid, gqa, head_dim):
    """B = 1, 3, 64 x full / window 128: lengths that activate every split of
    the batch's launch, the edge lengths in the B = 64 launch, fresh inputs,
    poisoned outputs (sinks on for odd GQA)."""
    import flintgen

    spec = _gpu_spec(gqa, head_dim)
    op = flintgen.get_kernel(spec, "decode_attention")
    rnd = random.Random(gqa * 1000 + head_dim)
    for window, b in GPU_PLAN:
        cfg = op.config(b, window is not None)
        lens = lens_for(cfg, b, window is not None, 128, rnd, spec.page_size, LEN_CAP)
        if b == 64:
            edges = _edges(spec.page_size, 128)
            lens[1:1 + len(edges)] = edges
        case = Case(spec, lens, window, seed=rnd.randint(0, 2**31))
        out = case.poisoned_out()
        op(*case.args(out))
        case.check(out, f"grid {spec.name} window={window} b={b} {cfg.as_params()}")


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(4))
def test_long_windows_on_the_split_path(precompiled_grid, idx):
    """A spec window of 4096 takes the split path; runtime windows 512, 1024,
    2047 and 4096 (same binary) at W - 1, W, W + 1 and 5000 tokens."""
    import flintgen

    spec = _long_specs()[idx]
    op = flintgen.get_kernel(spec, "decode_attention")
    assert not op.config(4, True).cluster
    for w in LONG_WINDOWS:
        case = Case(spec, [w - 1, w, w + 1, 5000], w, seed=w + idx)
        out = case.poisoned_out()
        op(*case.args(out))
        case.check(out, f"long window {spec.name} W={w} {op.config(4, True).as_params()}")


# short windows at one to two single-split pairs per SM (133..264 with 8 kv heads): 2 slots, at most 2 CTAs
# per SM (SHORT_WINDOW_CTAS_PER_SM), dependents released at entry; bf16 here, fp8 in test_decode_attention_fp8
CAP_SPECS = [grid_spec(g, d, kv=8, window=128, sinks=g != 4, softcap=d == 256, max_batch=33)
             for g, d in ((8, 128), (1, 64), (4, 256), (3, 96))]
CAP_PLAN = [17, 32, 33]


@pytest.fixture(scope="module")
def precompiled_cap():
    from flintgen import toolchain

    n = precompile([(s, [(128, b) for b in CAP_PLAN]) for s in CAP_SPECS], KDEF, toolchain.resolve_target(), _no_load)
    record(f"precompiled {n} capped-window variants")


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(CAP_SPECS)))
def test_short_window_two_ctas_per_sm(precompiled_cap, idx):
    """8 kv heads x B = 17, 32, 33 (136, 256, 264 pairs) with window 128: the capped single-split launch;
    window, slice and page edge lengths, fresh inputs, poisoned outputs."""
    import flintgen

    spec = CAP_SPECS[idx]
    op = flintgen.get_kernel(spec, "decode_attention")
    rnd = random.Random(270 + idx)
    cap = 50.0 if spec.attn_logit_softcap else None
    for b in CAP_PLAN:
        cfg = op.config(b, True)
        assert (cfg.num_splits, cfg.num_stages, cfg.ctas_per_sm, cfg.early_release) == (1, 2, 2, True), cfg
        lens = [rnd.randint(0, 3000) for _ in range(b)]
        edges = _edges(spec.page_size, 128)
        lens[:len(edges)] = edges
        case = Case(spec, lens, 128, seed=rnd.randint(0, 2**31), softcap=cap, q_scale=30.0 if cap else 1.5)
        out = case.poisoned_out()
        op(*case.args(out), **case.kwargs())
        case.check(out, f"capped window {spec.name} b={b} {cfg.as_params()}")


# short windows of 9..16 pairs (8 kv heads x B = 2): 4-CTA clusters (2 at head_dim 96, _fit_cluster); 17..64
# pairs (B = 3..8): 2-CTA clusters; bf16 here, fp8 in test_decode_attention_fp8
CLUSTER_PLAN = [2, 3, 8]


def precompile_windows(specs, batches, what):
    """The window-128 launches of ``batches`` for every spec of ``specs``, compiled before the tests run."""
    from flintgen import toolchain

    n = precompile([(s, [(128, b) for b in batches]) for s in specs], KDEF, toolchain.resolve_target(), _no_load)
    record(f"precompiled {n} {what} variants")


def check_cluster_plan(spec, seed, make_case, what):
    """The CLUSTER_PLAN launches of ``spec``'s op (window 128): configs as the rule has them, window / slice / page
    edge lengths, fresh inputs, poisoned outputs; ``make_case(lens, seed, b, softcap, q_scale)`` builds the case."""
    import flintgen

    op = flintgen.get_kernel(spec, "decode_attention")
    rnd = random.Random(seed)
    cap = 50.0 if spec.attn_logit_softcap else None
    for b in CLUSTER_PLAN:
        cfg = op.config(b, True)
        assert cfg.cluster and cfg.num_splits == (2 if b > 2 or spec.head_dim == 96 else 4), cfg
        lens = [rnd.randint(0, 3000) for _ in range(b)]
        lens[:min(b, 3)] = [0, 129, 1][:min(b, 3)]              # empty, window + 1 (an unaligned start), one token
        if b == 8:
            lens[3:8] = [15, 16, 17, 127, 128]
        case = make_case(lens, rnd.randint(0, 2**31), b, cap, 30.0 if cap else 1.5)
        out = case.poisoned_out()
        op(*case.args(out), **case.kwargs())
        case.check(out, f"{what} {spec.name} b={b} {cfg.as_params()}")


@pytest.fixture(scope="module")
def precompiled_cluster():
    precompile_windows(CAP_SPECS, CLUSTER_PLAN, "short-window cluster")


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(CAP_SPECS)))
def test_short_window_cluster_sizes(precompiled_cluster, idx):
    """8 kv heads x B = 2, 3, 8 (16, 24, 64 pairs) with window 128: 4- then 2-CTA clusters."""
    spec = CAP_SPECS[idx]
    check_cluster_plan(spec, 330 + idx, lambda lens, seed, b, cap, qs: Case(spec, lens, 128, seed=seed, softcap=cap,
                                                                              q_scale=qs), "cluster window")
