"""Decode attention beyond Flint's shape: GQA 4 / 8 / 16, head_dim 64 / 128,
pages of 16 / 32 / 64 tokens, sinks on / off, window on / off.

* CPU: heuristics for every shape, per-rank GQA, rejections, rendered
  source, compiles of a representative variant set per (GQA, head_dim,
  page) (``compile``), and the CPU emulator (tests/da_emulator.py) running
  the generated kernel on small cases of the new shapes.
* GPU (``gpu``): every (GQA, head_dim, page) x sinks x window with a small
  and a large batch, edge and mixed lengths, permuted block tables and
  poisoned outputs; gpt-oss-20b at TP 1 / 2 / 8; CUDA-graph replay, strided
  q / out with padded heads. The variants they use are compiled up front in
  parallel (``precompiled``), so the GPU sits idle for as short as possible.

gpt-oss-20b (the spec below): hidden 2880, 64 q / 8 kv heads of 64, sinks,
window 128 on alternating layers: per rank 64/8, 32/4 and 8/1 heads at TP 1,
2 and 8 (all GQA 8).
"""

import random

import pytest
import torch

from flintgen import codegen
from flintgen.configs import decode_attention_config as dac
from flintgen.kernels.base import Target
from flintgen.kernels.decode_attention import DecodeAttentionDef, _check_softcap
from flintgen.layout import SMEM_PER_SM, AttentionLayout
from flintgen.presets import FLINT

from decode_attention_cases import Case, check_compiled, lens_for, precompile, record, refill

KDEF = DecodeAttentionDef()
T132 = Target("sm_90a", 132)
SHAPES = [(g, d, p) for g in (4, 8, 16) for d in (64, 128) for p in (16, 32, 64)]
# Every other GQA ratio of real models (MHA 1; Qwen3 / Gemma 2; Llama-3.2-3B 3; Qwen2.5 5 / 6 / 7; GLM-4.5
# 12): one or two head tiles, partly padded, at both head dims.
SHAPES += [(g, d, 16) for g in (1, 2, 3, 5, 6, 7, 12) for d in (64, 128)]
# gpt-oss-20b's attention shape (other fields are Flint's: decode attention
# reads only heads, head_dim, page size, sinks and the layer kinds).
GPT_OSS = FLINT.replace(name="gpt-oss-20b", hidden_size=2880, num_q_heads=64, num_kv_heads=8, head_dim=64,
                        sinks=True, sliding_window=128)
GPT_OSS_TP = {tp: GPT_OSS.replace(name=f"gpt-oss-20b-tp{tp}", tp_size=tp) for tp in (1, 2, 8)}


def shape_spec(gqa, head_dim, page, *, sinks=True, kv=2, max_batch=64):
    return FLINT.replace(name=f"g{gqa}-d{head_dim}-p{page}-{'sinks' if sinks else 'nosinks'}-kv{kv}",
                         num_q_heads=gqa * kv, num_kv_heads=kv, head_dim=head_dim, page_size=page, sinks=sinks,
                         max_batch=max_batch)


def _sid(shape):
    return "g{}-d{}-p{}".format(*shape)


def _no_load(v):
    raise AssertionError("no kernel load expected")


# ----------------------------------------------------------------- heuristics
@pytest.mark.parametrize("gqa, head_dim, page", SHAPES, ids=[_sid(s) for s in SHAPES])
def test_configs_valid_for_every_shape(gqa, head_dim, page):
    for kv in (1, 2, 4, 8):
        for sms in (132, 114):
            for sliding, window in ((True, 128), (True, 4096), (False, None)):
                cfgs = dac.all_configs(max_batch=256, num_kv_heads=kv, sliding=sliding, window=window,
                                       head_dim=head_dim, gqa=gqa, page_size=page, num_sms=sms)
                for b, c in cfgs.items():       # __post_init__ validated smem, epilogue and merge mapping
                    assert (c.head_dim, c.gqa) == (head_dim, gqa)
                    assert c.cluster == (sliding and window == 128 and b * kv <= 64 and 2 * b * kv <= sms)   # one wave
                    assert c.scratch_bytes <= c.ring_bytes and c.dims_per_thread >= 4
                    if c.ctas_per_sm:
                        assert c.ring_bytes <= SMEM_PER_SM // c.ctas_per_sm
                assert dac.max_partials(cfgs, kv) <= 3 * sms   # head_dim 64: 3 splits x 88 pairs


@pytest.mark.parametrize("gqa, page", [(4, 16), (8, 32), (8, 64), (4, 64)])
def test_head_dim_128_keeps_the_flint_choices(gqa, page):
    """GQA 4 and page size do not change what a launch streams (16-token,
    8 KB slices) or merges (one 8-head tile), so head_dim 128 keeps the
    measured Flint rule."""
    for kv in (1, 4, 8):
        for sliding in (True, False):
            kw = dict(max_batch=256, num_kv_heads=kv, sliding=sliding, window=128 if sliding else None,
                      head_dim=128, num_sms=132)
            flint = dac.all_configs(gqa=8, page_size=16, **kw)
            other = dac.all_configs(gqa=gqa, page_size=page, **kw)
            assert [c.as_params() for c in other.values()] == [c.as_params() for c in flint.values()]


def test_gqa_16_rule():
    """GQA 16 (two head tiles, partials twice as large): at <= 8 pairs and
    head_dim 128 the last 4 CTAs to arrive merge (4 heads each), head_dim 64
    halves the splits instead; 8-warp CTAs one per SM while that gives >= 2
    splits (measured, see the config module); sliding windows unchanged."""
    def cfg(batch, kv, d, gqa, sliding=False):
        c = dac.launch_config(batch=batch, num_kv_heads=kv, sliding=sliding, window=128 if sliding else None,
                              head_dim=d, gqa=gqa, page_size=64, num_sms=132)
        return c.num_splits, c.num_warps, c.num_stages, c.min_pages, c.cluster, c.merge_ctas
    assert cfg(1, 2, 128, 16) == (66, 8, 2, 1, False, 4) and cfg(1, 2, 128, 8) == (66, 8, 2, 1, False, 4)
    assert cfg(4, 2, 128, 16) == (16, 8, 2, 1, False, 4) and cfg(5, 2, 128, 16)[-1] == 1
    assert cfg(32, 2, 128, 16) == (2, 8, 2, 2, False, 1) and cfg(32, 2, 128, 8) == (4, 4, 3, 2, False, 1)
    assert cfg(64, 2, 128, 16) == cfg(64, 2, 128, 8) == (2, 4, 3, 2, False, 1)    # 1 split per SM: 4-warp rule
    assert cfg(1, 2, 64, 16) == (33, 4, 6, 1, False, 1) and cfg(1, 2, 64, 8) == (132, 4, 4, 1, False, 1)
    assert cfg(16, 2, 64, 16) == cfg(16, 2, 64, 8)
    assert cfg(1, 2, 128, 16, True) == cfg(1, 2, 128, 8, True)


def test_merge_from_rule():
    """One head tile (GQA 4 / 8), head_dim 128, full attention: pairs with
    more than MERGE_FROM_ACTIVE splits get 4 merging CTAs from 40 active
    splits on (the last CTA alone below); fewer splits, GQA 16 (always 4
    mergers), head_dim 64 and windows do not switch (sweep run 10)."""
    def cfg(batch, kv, d=128, gqa=8, sliding=False):
        c = dac.launch_config(batch=batch, num_kv_heads=kv, sliding=sliding, window=128 if sliding else None,
                              head_dim=d, gqa=gqa, page_size=16, num_sms=132)
        return c.num_splits, c.merge_ctas, c.merge_from
    assert dac.MERGE_FROM_ACTIVE == 40
    assert cfg(1, 2) == cfg(1, 2, gqa=4) == (66, 4, 40) and cfg(1, 1) == (132, 4, 40) and cfg(1, 3) == (44, 4, 40)
    assert cfg(2, 2) == (33, 1, 0) and cfg(1, 4) == (33, 1, 0) and cfg(8, 1) == (16, 1, 0)
    assert cfg(1, 2, gqa=16) == (66, 4, 0) and cfg(1, 2, d=64)[1:] == (1, 0) and cfg(1, 2, sliding=True)[1:] == (1, 0)


def _cfg64(batch, kv, sliding, gqa=8):
    c = dac.launch_config(batch=batch, num_kv_heads=kv, sliding=sliding, window=128 if sliding else None,
                          head_dim=64, gqa=gqa, page_size=16, num_sms=132)
    return c.num_splits, c.num_warps, c.num_stages, c.min_pages, c.cluster, c.ctas_per_sm


def test_head_dim_64_rule():
    """head_dim 64 (4 KB slices): 4-warp CTAs, twice the stages of the
    head_dim-128 rule, min_pages 1 (measured), clusters of 4 where 8 ranks
    cannot split 64 dims."""
    # gpt-oss TP 1 (8 kv heads): batch 1 = 8 pairs
    assert _cfg64(1, 8, False) == (33, 4, 4, 1, False, 2)
    assert _cfg64(2, 8, False) == (16, 4, 4, 1, False, 2)      # 16 pairs: 4 stages
    assert _cfg64(8, 8, False) == (4, 4, 6, 1, False, 2)       # 64 pairs: 6 stages
    assert _cfg64(64, 8, False) == (1, 4, 6, 1, False, 2)
    assert _cfg64(1, 1, False) == (66, 4, 6, 1, False, 2)      # gpt-oss TP 8, batch 1 (measured exception)
    assert _cfg64(2, 1, False) == (132, 4, 4, 1, False, 2)
    assert _cfg64(1, 8, True) == (4, 4, 2, 1, True, 0)         # 8 ranks -> 4: 8 dims x 8 heads < 128 threads
    assert _cfg64(2, 8, True) == (4, 4, 3, 1, True, 0)
    assert _cfg64(8, 8, True) == (2, 4, 3, 1, True, 0)         # 64 pairs: 2-CTA clusters
    assert _cfg64(9, 8, True) == (1, 4, 3, 1, False, 0)
    assert _cfg64(1, 8, True, gqa=16) == (8, 4, 2, 1, True, 0)  # 16 heads: 8 ranks fit


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="2 dims per thread for 8 heads x 64 dims; the epilogue needs an even "
                                         "number >= 4"):
        dac.DecodeAttentionConfig(16, 8, 2, 1, False, 1, 64, 8)
    with pytest.raises(ValueError, match="3 dims per thread for 8 heads x 96 dims"):
        dac.DecodeAttentionConfig(16, 8, 2, 1, False, 1, 96, 8)
    assert dac.DecodeAttentionConfig(16, 4, 2, 1, False, 1, 96, 8).dims_per_thread == 6   # 8-byte accesses
    with pytest.raises(ValueError, match="needs 2 K / V parts with 2 head tiles"):
        dac.DecodeAttentionConfig(16, 4, 2, 1, False, 1, 256, 12)
    assert dac.DecodeAttentionConfig(16, 4, 2, 1, False, 1, 256, 8).kv_parts == 2
    assert dac.DecodeAttentionConfig(16, 8, 2, 1, False, 1, 128, 16).kv_parts == 1
    with pytest.raises(ValueError, match="cluster merge needs 2, 4 or 8 splits whose 64 / splits dims"):
        dac.DecodeAttentionConfig(8, 4, 2, 1, True, 0, 64, 8)
    assert dac.DecodeAttentionConfig(8, 4, 2, 1, True, 0, 64, 16).cluster


# ----------------------------------------------------------------- variants and validation
@pytest.mark.parametrize("spec, q, kv, gqa", [
    (GPT_OSS_TP[1], 64, 8, 8), (GPT_OSS_TP[2], 32, 4, 8), (GPT_OSS_TP[8], 8, 1, 8),
    (FLINT.replace(tp_size=8), 4, 1, 4),         # kv replicated: 4 q heads per kv head on a rank
    (FLINT.replace(num_q_heads=64, num_kv_heads=4, tp_size=8), 8, 1, 8),
])
def test_per_rank_gqa(spec, q, kv, gqa):
    assert (spec.q_heads_per_rank, spec.kv_heads_per_rank) == (q, kv)
    vs = KDEF.variants(spec, T132)
    assert {(v["gqa"], v["kv_heads"], v["head_dim"]) for v in vs} == {(gqa, kv, spec.head_dim)}
    op = KDEF.bind(spec, T132, _no_load)
    for sliding in (True, False):
        assert set(op._variants[sliding]) == set(range(1, spec.max_batch + 1))


def test_rejects_wrong_cache_shape_for_the_spec():
    spec = shape_spec(16, 64, 32)
    op = KDEF.bind(spec, T132, _no_load)
    q = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    a = [q, torch.zeros(8, 2, 16, 128, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.int32),
         torch.zeros(2, dtype=torch.int32), torch.zeros(32), 128, 0.125, torch.zeros_like(q)]
    with pytest.raises(ValueError, match=r"kv_cache must be the HND cache \[num_blocks, 2, 32, 128\] \(kv heads, "
                                         r"page size, K \| V of head_dim 64\), got \(8, 2, 16, 128\)"):
        op(*a)
    a[1] = torch.zeros(8, 2, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        op(*a)


@pytest.mark.parametrize("gqa, head_dim, page", SHAPES, ids=[_sid(s) for s in SHAPES])
def test_rendered_source_follows_the_shape(gqa, head_dim, page):
    spec = shape_spec(gqa, head_dim, page)
    for v in KDEF.variants(spec, T132)[:3] + KDEF.variants(spec, T132)[-2:]:
        src = codegen.render(v.kernel, KDEF.template, dict(KDEF.render_params(spec, v)))
        assert f"HEAD_DIM = {head_dim}\n" in src and f"GQA = {gqa}\n" in src and f"PAGE = {page}\n" in src
        # Code paths branch (cutlass.const_expr) on the layout's constants.
        consts = {ln.split("#")[0].strip() for ln in src.splitlines()}
        assert f"SLICES_PER_PAGE = {page // 16}" in consts
        assert f"NUM_TILES = {2 if gqa > 8 else 1}" in consts
        assert f"TILE_HEADS = {16 if gqa > 8 else 8}" in consts
        assert f"SLICE_BYTES = {64 * head_dim}" in consts   # 16 tokens x (K | V) x head_dim x 2 bytes
        if v["ctas_per_sm"]:
            ring = v["num_warps"] * v["num_stages"] * AttentionLayout(head_dim=head_dim, gqa=gqa).slice_bytes
            pad = KDEF.render_params(spec, v)["pad_bytes"]
            assert (ring + pad) * (v["ctas_per_sm"] + 1) > SMEM_PER_SM


# ----------------------------------------------------------------- compile
def _compile_cases():
    """Per (GQA, head_dim, page): the first (smallest-batch) variant of each
    family (sliding / full, cluster, warps, split or not) at 4 kv heads, plus
    the register-heaviest split counts (1 kv head, batch 1)."""
    out = []
    for shape in SHAPES:
        spec = shape_spec(*shape, kv=4)
        op = KDEF.bind(spec, T132, _no_load)
        fams = {}
        for sliding in (True, False):
            for v in op._variants[sliding].values():
                fams.setdefault((sliding, v["cluster"], v["num_warps"], v["num_splits"] > 1), v)
        out += [pytest.param(spec, v, id=f"{_sid(shape)}-{v.name[len('decode_attention-'):]}")
                for v in fams.values()]
    for spec in (GPT_OSS_TP[8], shape_spec(16, 128, 16, kv=1), shape_spec(16, 64, 64, kv=1)):
        v = KDEF.bind(spec, T132, _no_load)._variants[False][1]
        out.append(pytest.param(spec, v, id=f"{spec.name}-b1-{v.name[len('decode_attention-'):]}"))
    return out


@pytest.mark.compile
@pytest.mark.parametrize("spec, variant", _compile_cases())
def test_variant_compiles_clean(spec, variant):
    """No spills, no stack, no local memory; the design's instructions are there."""
    from flintgen.runtime import load_variant

    load_variant(KDEF, spec, variant, T132)   # default cache root: reused across runs
    res, ptx = check_compiled(KDEF, spec, variant, T132)
    assert ("mapa.shared::cluster" in ptx) == variant["cluster"]
    assert ("atom.acq_rel.gpu.global.add.s32" in ptx) == (variant["num_splits"] > 1 and not variant["cluster"])
    record(f"compile {spec.name} {variant.name}: {res['registers']} registers")


# ----------------------------------------------------------------- shared GPU / emulator body
def edge_lens(page, window=128):
    """seq_len 0, 1, slice and page boundaries, window boundaries."""
    raw = [0, 1, 2, 15, 16, 17, page - 1, page, page + 1, 2 * page + 1, window - 1, window, window + 1,
           window + page - 1, window + page, window + page + 1, 255, 256, 257, 1000, 1025]
    return list(dict.fromkeys(raw))


def run_shape(op, spec, device, plan, *, seed=0, cap=None, tag="", softcap=None, q_scale=1.5):
    """Launch ``op`` for every (window, batch) of ``plan``: mixed lengths that
    activate every split of the batch's config, the edge lengths in the
    larger batches, fresh inputs and a poisoned output each time
    (``softcap``: the logit cap of a soft-capping spec; ``q_scale``: the
    logits' spread, see ``Case``)."""
    rnd = random.Random(seed)
    edges = edge_lens(spec.page_size)
    for window, b in plan:
        cfg = op.config(b, window is not None)
        lens = lens_for(cfg, b, window is not None, 128, rnd, spec.page_size, cap)
        if b > len(edges):
            lens[1:1 + len(edges)] = edges
        case = Case(spec, lens, window, seed=seed + b + (window or 0), device=device, softcap=softcap,
                    q_scale=q_scale)
        out = case.poisoned_out()
        op(*case.args(out), **case.kwargs())
        case.check(out, f"{tag}{spec.name} window={window} b={b} {cfg.as_params()}")


SHAPE_PLAN = [(128, 3), (128, 24), (128, 40), (None, 3), (None, 24)]


def _shape_plans():
    """(spec, plan) of test_shape, for every shape and sinks on / off."""
    return [(shape_spec(*s, sinks=sinks), SHAPE_PLAN) for s in SHAPES for sinks in (True, False)]


GPT_OSS_PLAN = [(128, 1), (128, 8), (128, 64), (None, 1), (None, 8), (None, 64)]


# ----------------------------------------------------------------- emulated (CPU)
class EmulatedOp:
    """The op's launch choice for a batch, run by the CPU emulator."""

    def __init__(self, spec):
        self.spec = spec
        self.op = KDEF.bind(spec, T132, _no_load)

    def config(self, batch, sliding):
        return self.op.config(batch, sliding)

    def __call__(self, q, kv, bt, lens, sinks, window, scale, out, *, softcap=None):
        import da_emulator

        _check_softcap(self.spec, softcap, scale)   # the op's rule (its other checks need CUDA tensors)
        v = self.op._variants[window is not None][q.shape[0]]
        res = da_emulator.run(KDEF, self.spec, v, q, kv, bt, lens, sinks, window, scale,
                              num_partials=self.op._max_partials, softcap=softcap)
        out.copy_(torch.from_numpy(res))


# (GQA, head_dim, page, sinks, [(window, seq_lens)]): every config family of
# the new shapes on small inputs (the emulator runs ~1 ms per warp and slice).
EMULATED = [
    (8, 64, 16, True, [(128, [130, 17]), (None, [600, 33])]),      # gpt-oss: 4-rank cluster; 132 splits, merged
    (4, 128, 32, False, [(128, [145, 31, 0]), (None, [600])]),     # padded tile: cluster 8; 8-warp splits
    (16, 64, 64, True, [(128, [193]), (None, [600] + [0] * 16)]),  # two tiles: cluster 8; 6-stage ring, 2 splits
    (16, 128, 16, True, [(128, [150] + [0] * 64)]),                # two tiles, one split per pair
    (1, 128, 16, True, [(128, [145, 0]), (None, [600, 1])]),       # MHA: 7 padded heads of 8
    (3, 64, 16, False, [(128, [130, 17]), (None, [700])]),         # odd ratio, one tile
    (6, 128, 64, True, [(None, [600, 33, 0])]),                    # one tile, 2 padded, pages of 64
    (12, 64, 32, True, [(128, [193]), (None, [600] + [0] * 16)]),  # two tiles, 4 padded heads in the second
    (1, 96, 16, True, [(128, [145, 0]), (None, [600, 1])]),        # Phi-3: trailing 32-dim group; cluster 2
    (12, 96, 16, False, [(None, [500, 17])]),                      # head_dim 96, two tiles (E = 12)
    (2, 256, 16, True, [(128, [150, 1]), (None, [700, 0])]),       # Gemma: K then V per slice; cluster 8
    (8, 256, 64, False, [(None, [600] + [0] * 16)]),               # head_dim 256, pages of 64, one split
]


@pytest.mark.parametrize("gqa, head_dim, page, sinks, launches", EMULATED, ids=lambda x: None)
def test_emulated_kernel(gqa, head_dim, page, sinks, launches):
    """The generated kernel, run on the CPU by tests/da_emulator.py, matches
    the reference (index arithmetic of head tiles, padded heads, head_dim
    64, slices of larger pages, cluster and global merges)."""
    spec = shape_spec(gqa, head_dim, page, sinks=sinks, kv=1, max_batch=80)
    op = EmulatedOp(spec)
    for window, lens in launches:
        case = Case(spec, lens, window, seed=len(lens), device="cpu")
        out = case.poisoned_out()
        op(*case.args(out))
        case.check(out, f"emulated {spec.name} window={window} b={len(lens)} "
                        f"{op.config(len(lens), window is not None).as_params()}")


# (GQA, head_dim, warps, splits, merge_ctas, merge_from, seq_lens): the last
# merge_ctas CTAs to arrive merge a group of heads each; fewer active splits
# than mergers (R = active), padded heads, two tiles, a request with one
# active split, and requests on both sides of merge_from (below it the last
# CTA alone merges) in one launch.
MERGE_CASES = [
    (8, 128, 8, 8, 4, 0, [16 * 8 * 8 + 5, 16 * 8 * 3]),      # 8 active splits; 3 active (R = 3)
    (4, 128, 4, 6, 4, 0, [16 * 4 * 6, 40]),                   # padded tile; 1 active split: no merge
    (16, 64, 4, 5, 4, 0, [16 * 4 * 5 + 1, 16 * 4 * 2]),       # two tiles, head_dim 64; R = 2
    (8, 64, 4, 4, 2, 0, [16 * 4 * 4]),                        # 2 mergers of 4 heads
    (8, 128, 8, 8, 4, 5, [16 * 8 * 8, 16 * 8 * 4 + 9]),       # 8 active: 4 merge; 4 active: the last alone
    (16, 128, 8, 8, 4, 6, [16 * 8 * 5 + 3, 16 * 8 * 7]),      # two tiles: alone (5), then 4 mergers (7)
    (2, 256, 4, 6, 4, 0, [16 * 4 * 6 + 7, 16 * 4 * 3]),       # head_dim 256: 4 dims per thread; 6 padded heads
    (1, 96, 4, 6, 1, 0, [16 * 4 * 6, 16 * 4 * 2 + 3]),        # head_dim 96, MHA: the last CTA alone (E = 6)
]


def test_merge_ctas_rejections():
    """merge_ctas needs global partials and 1 or 2 dims per thread per group;
    merge_from (when several CTAs take over) needs merge_ctas > 1."""
    with pytest.raises(ValueError, match="merge_ctas = 3 needs global split partials"):
        dac.DecodeAttentionConfig(8, 8, 2, 1, False, 1, merge_ctas=3)
    with pytest.raises(ValueError, match="merge_ctas = 2 needs"):
        dac.DecodeAttentionConfig(1, 8, 2, 1, False, 1, merge_ctas=2)          # one split: no partials
    with pytest.raises(ValueError, match="merge_ctas = 8 needs"):
        dac.DecodeAttentionConfig(8, 8, 2, 1, False, 1, merge_ctas=8)          # 128 dims over 256 threads
    assert dac.DecodeAttentionConfig(8, 8, 2, 1, False, 1, merge_ctas=4).merge_dims == 1
    with pytest.raises(ValueError, match="merge_from = 16 needs merge_ctas > 1"):
        dac.DecodeAttentionConfig(8, 8, 2, 1, False, 1, merge_from=16)             # nobody to switch to
    with pytest.raises(ValueError, match="merge_from = -1 needs"):
        dac.DecodeAttentionConfig(8, 8, 2, 1, False, 1, merge_ctas=4, merge_from=-1)


@pytest.mark.parametrize("gqa, head_dim, warps, splits, merge, merge_from, lens", MERGE_CASES, ids=lambda x: None)
def test_emulated_merge_by_several_ctas(monkeypatch, gqa, head_dim, warps, splits, merge, merge_from, lens):
    """Split partials merged by the last ``merge_ctas`` CTAs to arrive (one
    group of heads each, all but the last waiting on the counter) match the
    reference, and the counters are reset (checked by the emulator)."""
    cfg = dac.DecodeAttentionConfig(splits, warps, 2, 1, False, 0, head_dim, gqa, merge_ctas=merge,
                                    merge_from=merge_from)
    monkeypatch.setattr(dac, "launch_config", lambda **kw: cfg)
    spec = shape_spec(gqa, head_dim, 16, kv=2, max_batch=len(lens)).replace(
        name=f"merge{merge}-from{merge_from}-g{gqa}-d{head_dim}")
    case = Case(spec, lens, None, seed=sum(lens), device="cpu")
    out = case.poisoned_out()
    EmulatedOp(spec)(*case.args(out))
    case.check(out, f"emulated merge_ctas={merge} merge_from={merge_from} {cfg.as_params()} lens={lens}")


# K/V slices read with the L2 evict-first policy (DecodeAttentionConfig.kv_evict_first; selected by no rule):
# a split merge by one CTA and by several, the two-tile GQA 16
EVICT_CASES = [(8, 128, 8, 8, 1, 0, [16 * 8 * 8 + 5, 16 * 8 * 3, 0, 1]),
               (16, 64, 4, 5, 4, 0, [16 * 4 * 5 + 1, 16 * 4 * 2])]


def _evict_cfg(gqa, head_dim, warps, splits, merge, merge_from):
    return dac.DecodeAttentionConfig(splits, warps, 2, 1, False, 0, head_dim, gqa, merge_ctas=merge,
                                     merge_from=merge_from, kv_evict_first=True)


def test_kv_evict_first_names_the_binary_and_its_template():
    """kv_evict_first: a bool, in the params (and the binary's name) only when set, rendered as KV_EVICT_FIRST."""
    with pytest.raises(TypeError, match=r"DecodeAttentionConfig.kv_evict_first = 1 must be a bool"):
        dac.DecodeAttentionConfig(1, 4, 2, 1, False, 2, kv_evict_first=1)
    off = dac.DecodeAttentionConfig(4, 4, 2, 1, False, 0)
    on = dac.DecodeAttentionConfig(4, 4, 2, 1, False, 0, kv_evict_first=True)
    assert "kv_evict_first" not in off.as_params() and on.as_params()["kv_evict_first"] is True
    spec = shape_spec(8, 128, 16, kv=2)
    for cfg, flag in ((off, False), (on, True)):
        v = _forced_variant(spec, cfg)
        assert ("-kv_evict_first1-" in v.name) == flag
        src = codegen.render(v.kernel, KDEF.template, dict(KDEF.render_params(spec, v)))
        assert f"KV_EVICT_FIRST = {flag}" in src


def _forced_variant(spec, cfg):
    from flintgen.kernels import decode_attention as da

    return da._variant(spec, False, cfg)


@pytest.mark.compile
def test_kv_evict_first_compiles_clean():
    """Every K/V bulk copy carries the evict-first cache hint; the default binary has none."""
    from flintgen.runtime import load_variant

    spec = shape_spec(8, 128, 16, kv=2)
    cfg = _evict_cfg(*EVICT_CASES[0][:6])
    for c, hinted in ((cfg, True), (dac.DecodeAttentionConfig(**{**cfg.__dict__, "kv_evict_first": False}), False)):
        v = _forced_variant(spec, c)
        load_variant(KDEF, spec, v, T132)
        ptx = check_compiled(KDEF, spec, v, T132)[1]
        copies = [ln for ln in ptx.splitlines() if "cp.async.bulk.shared::cluster.global" in ln]
        assert copies and all((".L2::cache_hint" in ln) == hinted for ln in copies), copies
        assert ("createpolicy.fractional.L2::evict_first.b64" in ptx) == hinted


@pytest.mark.parametrize("gqa, head_dim, warps, splits, merge, merge_from, lens", EVICT_CASES, ids=lambda x: None)
def test_emulated_kv_evict_first(monkeypatch, gqa, head_dim, warps, splits, merge, merge_from, lens):
    """The evict-first copies' code path computes what the default one does (the emulator copies the bytes)."""
    cfg = _evict_cfg(gqa, head_dim, warps, splits, merge, merge_from)
    monkeypatch.setattr(dac, "launch_config", lambda **kw: cfg)
    spec = shape_spec(gqa, head_dim, 16, kv=2, max_batch=len(lens)).replace(name=f"evict-g{gqa}-d{head_dim}")
    case = Case(spec, lens, None, seed=sum(lens), device="cpu")
    out = case.poisoned_out()
    EmulatedOp(spec)(*case.args(out))
    case.check(out, f"emulated kv_evict_first {cfg.as_params()} lens={lens}")


def test_emulator_refuses_a_device_module_it_does_not_load():
    """A kernel importing a device module the emulator does not run against its
    mocks is refused (it would run the real cute module, or JIT it from the
    emulator's threads), naming the module."""
    import da_emulator

    with pytest.raises(AssertionError, match=r"does not load: \['gemv'\]; add them to da_emulator._DEVICE_MODULES"):
        da_emulator.load("from flintgen.device import arrivals, gemv, paged_kv, ptx\n", da_emulator.GlobalMemory(1024))
    # the device modules' own imports count too (``from flintgen.device.x import ...``)
    assert da_emulator._device_imports("from flintgen.device.reduce import warp_sum\n"
                                       "from flintgen.device import (\n    ptx,\n    rope,\n)\n") == {"reduce", "ptx", "rope"}


def test_emulated_block_id_window_of_long_pages():
    """A warp with more than 32 slices of 32-token pages refreshes its
    block-id window (slice -> table entry slice // 2) and starts mid-page."""
    spec = shape_spec(8, 128, 32, kv=1, max_batch=80)
    lens = [2200] + [0] * 64                # 65 pairs: one 4-warp split, 35 slices per warp
    case = Case(spec, lens, 2100, seed=5, device="cpu")
    out = case.poisoned_out()
    EmulatedOp(spec)(*case.args(out))
    case.check(out, "emulated p32 window 2100 (block-id window refresh)")


# ----------------------------------------------------------------- GPU
def planned_plans():
    """(spec, [(window, batch), ...]) of every launch the GPU tests below make."""
    plans = _shape_plans() + [(s, GPT_OSS_PLAN) for s in GPT_OSS_TP.values()] + _graph_plans()
    plans += [(s, [(w, len(edge_lens(16)) + 4) for w in (128, None)]) for s in GPT_OSS_TP.values()]
    plans += [(shape_spec(4, 64, 32), PADDED_PLAN)]
    return plans


@pytest.fixture(scope="module")
def precompiled():
    """Every variant the GPU tests below launch, compiled up front in parallel."""
    from flintgen import toolchain

    record(f"precompiled {precompile(planned_plans(), KDEF, toolchain.resolve_target(), _no_load)} "
           "decode-attention variants")


@pytest.mark.gpu
@pytest.mark.parametrize("gqa, head_dim, page", SHAPES, ids=[_sid(s) for s in SHAPES])
def test_shape(precompiled, gqa, head_dim, page):
    """One shape x sinks on / off x window on / off (2 kv heads): batch 3 (a
    cluster merge; many splits merged through global partials), 24 (4-rank
    clusters; a few splits) and, windowed, 40 (one split per pair), with edge
    and mixed lengths."""
    import flintgen

    for sinks in (True, False):
        spec = shape_spec(gqa, head_dim, page, sinks=sinks)
        run_shape(flintgen.get_kernel(spec, "decode_attention"), spec, "cuda", SHAPE_PLAN, seed=gqa + page)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_gpt_oss(precompiled, tp):
    """gpt-oss-20b per rank (64/8, 32/4, 8/1 heads of 64): batches 1, 8, 64
    both layer kinds, then the edge lengths with the spec's window, full
    attention and runtime windows 1, 17 and 200 (same binaries)."""
    import flintgen

    spec = GPT_OSS_TP[tp]
    op = flintgen.get_kernel(spec, "decode_attention")
    run_shape(op, spec, "cuda", GPT_OSS_PLAN, seed=tp)
    lens = edge_lens(16) + [129, 3000, 40, 7]
    for window in (128, None, 1, 17, 200):
        case = Case(spec, lens, window, seed=len(lens) + (window or 0))
        out = case.poisoned_out()
        op(*case.args(out))
        case.check(out, f"{spec.name} edges window={window}")


def _graph_plans():
    return [(shape_spec(4, 64, 32, kv=2), [(128, 2), (None, 3)]),
            (shape_spec(16, 128, 64, kv=2), [(None, 1), (128, 20)]),
            (shape_spec(1, 96, 16, kv=2), [(None, 1), (128, 3)]),
            (shape_spec(2, 256, 16, kv=2), [(None, 2), (128, 20)])]


@pytest.mark.gpu
@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_cuda_graph_replay(precompiled, which):
    """Graphs of a cluster launch and a global-partials launch of padded
    (GQA 4, d64, page 32; MHA at d96), two-tile (GQA 16, d128, page 64) and
    K-then-V (GQA 2, d256) shapes, one per head dim, replayed 60 times with
    lengths and block tables changed in place: the workspace (sized by the
    real heads) and counters stay valid."""
    import flintgen

    spec, plan = _graph_plans()[which]
    op = flintgen.get_kernel(spec, "decode_attention")
    rnd = random.Random(which)
    page, width = spec.page_size, 12
    cases = []
    for window, b in plan:
        case = Case(spec, [width * page] * b, None, seed=b, extra_cols=0)
        case.window = window
        cases.append((case, torch.empty_like(case.q)))
        op(*case.args(cases[-1][1]))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for case, out in cases:
            op(*case.args(out))
    for it in range(60):
        for case, out in cases:
            b = case.q.shape[0]
            lens = [rnd.choice([0, 1, page - 1, page + 1, rnd.randint(1, width * page)]) for _ in range(b)]
            refill(case, rnd, lens, page)
            out.fill_(float("nan"))
        graph.replay()
        if it % 20 == 0 or it == 59:
            for case, out in cases:
                case.check(out, f"graph {spec.name} replay {it} b={case.q.shape[0]}")
    torch.cuda.synchronize()
    ws = op._workspaces[torch.device("cuda", torch.cuda.current_device())]
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("gqa, head_dim, warps, splits, merge, merge_from, lens", MERGE_CASES, ids=lambda x: None)
def test_merge_by_several_ctas_gpu(monkeypatch, gqa, head_dim, warps, splits, merge, merge_from, lens):
    """The H200 twin of test_emulated_merge_by_several_ctas: the last
    ``merge_ctas`` CTAs to arrive merge (all but the last polling the
    counter); eager launches, then a graph replayed 40 times with lengths and
    block tables changed in place (active splits from 0 to all, so the
    merging CTAs vary); counters end at 0."""
    import flintgen

    cfg = dac.DecodeAttentionConfig(splits, warps, 2, 1, False, 0, head_dim, gqa, merge_ctas=merge,
                                    merge_from=merge_from)
    monkeypatch.setattr(dac, "launch_config", lambda **kw: cfg)
    spec = shape_spec(gqa, head_dim, 16, kv=2, max_batch=len(lens)).replace(
        name=f"gpu-merge{merge}-from{merge_from}-g{gqa}-d{head_dim}-s{splits}-w{warps}")
    op = flintgen.get_kernel(spec, "decode_attention")
    width = -(-max(lens) // 16)
    case = Case(spec, [width * 16] * len(lens), None, seed=sum(lens), extra_cols=0)   # no NaN page tails
    rnd = random.Random(merge * 1000 + splits)
    out = case.poisoned_out()
    for first in ([width * 16] * len(lens), lens):
        refill(case, rnd, first)
        out.fill_(float("nan"))
        op(*case.args(out))
        case.check(out, f"merge_ctas={merge} eager {first}")
    _replay_with_changed_lens(op, case, out, rnd, width, len(lens), 40, f"merge_ctas={merge}", check_every=8)


def _replay_with_changed_lens(op, case, out, rnd, width, n, iters, label, check_every=1):
    """Capture ``op`` on ``case`` in a CUDA graph, then replay it ``iters`` times with ``n`` lengths and the block
    tables changed in place (0, 1, 17 tokens, partial and full contexts of ``width`` pages), ``out`` NaN-poisoned
    before each, checked every ``check_every``-th replay and the last; the workspace counters end at 0."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(*case.args(out))
    for it in range(iters):
        new = [rnd.choice([0, 1, 17, rnd.randint(1, width * 16), width * 16]) for _ in range(n)]
        refill(case, rnd, new)
        out.fill_(float("nan"))
        graph.replay()
        if it % check_every == 0 or it == iters - 1:
            case.check(out, f"{label} graph replay {it} lens={new}")
    torch.cuda.synchronize()
    ws = op._workspaces[torch.device("cuda", torch.cuda.current_device())]
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("gqa, head_dim, warps, splits, merge, merge_from, lens", EVICT_CASES, ids=lambda x: None)
def test_kv_evict_first_gpu(monkeypatch, gqa, head_dim, warps, splits, merge, merge_from, lens):
    """K/V read with the L2 evict-first policy: eager, then a graph replayed with lengths and block tables
    changed in place (0, 1, 17 tokens, partial and full contexts); counters end at 0."""
    import flintgen

    cfg = _evict_cfg(gqa, head_dim, warps, splits, merge, merge_from)
    monkeypatch.setattr(dac, "launch_config", lambda **kw: cfg)
    spec = shape_spec(gqa, head_dim, 16, kv=2, max_batch=len(lens)).replace(
        name=f"gpu-evict-g{gqa}-d{head_dim}-s{splits}-m{merge}")
    op = flintgen.get_kernel(spec, "decode_attention")
    width = -(-max(lens) // 16)
    case = Case(spec, [width * 16] * len(lens), None, seed=sum(lens), extra_cols=0)
    rnd = random.Random(splits * 100 + merge)
    out = case.poisoned_out()
    refill(case, rnd, lens)
    out.fill_(float("nan"))
    op(*case.args(out))
    case.check(out, f"kv_evict_first eager {lens}")
    _replay_with_changed_lens(op, case, out, rnd, width, len(lens), 12, "kv_evict_first")


PADDED_PLAN = [(128, 3), (None, 3), (None, 24)]


@pytest.mark.gpu
@pytest.mark.parametrize("window, batch", PADDED_PLAN)
def test_padded_heads_write_nothing_outside(precompiled, window, batch):
    """GQA 4 computes 8 heads per kv head: the 4 padded ones must not be
    stored (out is a view of a larger NaN buffer) nor read q past its end."""
    import flintgen

    spec = shape_spec(4, 64, 32, kv=2)
    op = flintgen.get_kernel(spec, "decode_attention")
    lens = lens_for(op.config(batch, window is not None), batch, window is not None, 128, random.Random(batch), 32)
    case = Case(spec, lens, window, seed=21)     # exact-size q: a padded head's row would lie past its end
    big = torch.full((batch, 16, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = big[:, 4:12]
    op(*case.args(out))
    case.check(out, f"padded heads window={window} b={batch}")
    assert torch.isnan(big[:, :4]).all() and torch.isnan(big[:, 12:]).all()


# (GQA, head_dim, window, seq_lens): the normalization sites — one CTA's output
# (cluster / one split), split partials merged by the last CTA, the 4-CTA merge.
SINK_WINS = [(8, 64, 128, [130, 17]), (8, 64, None, [600, 33]), (16, 64, None, [600] + [0] * 16)]


@pytest.mark.parametrize("gqa, head_dim, window, lens", SINK_WINS, ids=lambda x: None)
def test_emulated_sink_takes_the_mass(gqa, head_dim, window, lens):
    """Heads whose sink lies far above every logit (q = 0: logits 0; V x
    1000). 55-80 nats (79-115 binary orders): the output, down to ~1e-32, is
    a normal fp32 / bf16 and must come out accurate, not as 0. 90-95 nats:
    the output factor is below 2^-126 and flushes to 0 (ex2.approx.ftz, as
    on the H200): exact zeros, within head_errors' floor; never NaN."""
    spec = shape_spec(gqa, head_dim, 16, sinks=True, kv=1, max_batch=80)
    op = EmulatedOp(spec)
    case = Case(spec, lens, window, seed=7, device="cpu")
    d = spec.head_dim
    case.kv[..., d:] *= 1000
    normal = list(range(0, spec.q_heads_per_rank, 3))
    flushed = list(range(1, spec.q_heads_per_rank, 3))
    case.q[:, normal + flushed] = 0
    case.sinks[normal] = torch.linspace(55.0, 80.0, len(normal))
    case.sinks[flushed] = torch.linspace(90.0, 95.0, len(flushed))
    out = case.poisoned_out()
    op(*case.args(out))
    case.check(out, f"emulated sink wins {spec.name} window={window} b={len(lens)}", head_tol=2e-2)
    live = case.lens > 0
    assert (out[live][:, normal].abs().amax(-1) > 0).all(), "sink-dominated heads came out as zeros"
    assert (out[live][:, flushed] == 0).all(), "outputs below 2^-126 |V| should flush to 0 (ftz)"
