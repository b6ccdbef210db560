"""The streaming design of the fused QKV GEMV (persistent split-K grid, cp.async
ring, per-head arrival counters): flintgen.configs.qkv_stream_plan,
flintgen.kernels.qkv_stream, templates/qkv_stream.py.j2.

* CPU: the variants and their refusals (the plan's closed forms against brute
  force: tests/test_qkv_stream_plan.py).
* ``compile`` (sm_90a): tests/test_qkv_stream_compile.py (the launch configs
  named here).
* GPU: test_qkv's numerics contract at M 1 .. 64 (slot_mapping shorter than
  M), fp8 cache bytes bit-exact with the bf16 binary's rows quantized, ring
  depths 2 and the largest, CUDA-graph replay with changed inputs, layers
  back to back without syncs, counters back at zero after every launch.
"""

from __future__ import annotations

import functools

import pytest
import torch

from flintgen.configs import qkv_stream_plan as sp
from flintgen.kernels.base import Target
from flintgen.kernels.qkv import QKVDef, QKVOp
from flintgen.kernels.qkv_stream import MMA_PTX, REQUIRED_PTX, WGMMA_PTX, StreamConfig, args_of, plan_of
from flintgen.presets import FLINT

KDEF = QKVDef()
T132 = Target("sm_90a", 132)


# ----------------------------------------------------------------- variants
F64 = FLINT.replace(weight_format="bf16", max_tokens=64)


def EF(**kw) -> StreamConfig:
    """A streaming tile as stream_config selects it: its weights copied with the L2 evict-first policy."""
    return StreamConfig(evict_first=True, **kw)


def test_variant_and_template():
    v = KDEF.variant(F64, config=StreamConfig(), max_m=16, target=T132)
    assert v["design"] == "stream" and v["ctas"] == 132 and v["max_m"] == 16
    assert KDEF.template_of(v) == "qkv_stream.py.j2" and KDEF.variant_ptx(v) == REQUIRED_PTX + (MMA_PTX,)
    vg = KDEF.variant(F64, config=StreamConfig(wgmma=True), max_m=16, target=T132)
    assert vg["wgmma"] is True and KDEF.variant_ptx(vg) == REQUIRED_PTX + WGMMA_PTX
    assert "wgmma" not in dict(v.params)    # the default stays out of the params (and of older cache keys)
    cluster = KDEF.variant(F64, max_m=8)
    assert KDEF.template_of(cluster) == "qkv_gemv.py.j2" and KDEF.variant_ptx(cluster) == KDEF.required_ptx
    # the heuristic (stream_config): bf16 tiles of 16 tokens and more stream, 6 stages; NVFP4 and 8 tokens cluster
    assert [dict(v.params).get("design", "cluster") for v in KDEF.variants(F64, T132)] == ["cluster"] + ["stream"] * 3
    # wgmma where blocks are whole warpgroups (head_dim 96: the mma.sync ring), 8 stages below 64 tokens; with the
    # cluster finish (flint's 40 heads of 128: 80 CTAs on 132 SMs) the ring fills shared memory: 12 / 10 / 8 stages
    assert [(v["stages"], v["wgmma"]) for v in KDEF.variants(F64, T132)[1:]] == [(0, True)] * 3
    assert [plan_of(dict(v.params)).ring_stages for v in KDEF.variants(F64, T132)[1:]] == [12, 10, 8]
    d96 = _spec("d96_r24")
    assert not any(dict(v.params).get("wgmma") for v in KDEF.variants(d96, T132))
    sc = functools.partial(sp.stream_config, hidden=2048)
    assert sc("bf16", 64, 96) == sc("bf16", 16, 96) == EF(stages=6)
    assert sc("bf16", 32, 256) == EF(stages=8, wgmma=True)
    assert sc("bf16", 64, 64) == EF(stages=6, wgmma=True)
    # the 64-token tile finishes heads in two slices of 32 tokens where those fit one per CTA
    assert sc("bf16", 64, 128, heads=40) == EF(stages=6, wgmma=True, finish_tokens=32)
    assert sc("bf16", 64, 128, heads=64) == EF(stages=6, wgmma=True, finish_tokens=32)
    assert sc("bf16", 64, 64, heads=80) == EF(stages=6, wgmma=True)
    assert sc("bf16", 32, 128, heads=40) == EF(stages=8, wgmma=True)
    assert sc("bf16", 64, 96, heads=40) == EF(stages=6)
    assert sc("nvfp4", 64, 128) is None and sc("bf16", 8, 128) is None
    # the grid aligned to blocks, SPLITS CTAs each, where that grid is SPLITS_MIN_FILL .. 1 x the SMs (wgmma tiles
    # of 16 tokens and more; ctas = 0: the rule left out)
    # and those CTAs one cluster reducing through DSMEM, the ring filling shared memory, where a head is one block
    # (head_dim 64 / 128)
    k132 = functools.partial(sp.stream_config, "bf16", hidden=2048, ctas=132)
    # (and, up to hidden 4096, units prefetched into L2 ahead in groups: 8 / 8 for weights of at most 24 MB, the
    # whole range before the grid wait at 64 tokens; larger ones 1 / 4 at 32 / 64 tokens, and at 16 tokens the
    # 8-token tile's ring of two-step units, one unit prefetched into L2 ahead)
    for m in (16, 32, 64):
        small = dict(l2_prefetch=sp.MAX_L2_PREFETCH) if m == 64 else dict(l2_prefetch=8, l2_prefetch_group=8)
        assert k132(m, 128, heads=40) == EF(wgmma=True, splits=sp.SPLITS, cluster=True, **small)   # 21 MB
        assert k132(m, 64, heads=60) == EF(wgmma=True, splits=sp.SPLITS, cluster=True, **small)
        assert sp.stream_config("bf16", m, 128, hidden=4096, heads=48, ctas=132) == (     # 50 MB
            EF(wgmma=True, unit_steps=2, l2_prefetch=1) if m == 16 else
            EF(wgmma=True, splits=sp.SPLITS, cluster=True, l2_prefetch=1, l2_prefetch_group=4))
        assert sp.stream_config("bf16", m, 128, hidden=4224, heads=48, ctas=132) == EF(     # not measured: none
            wgmma=True, splits=sp.SPLITS, cluster=True)
    weights = sp.L2_PREFETCH_MAX_WEIGHT_BYTES // (2 * 128 * 48)     # the bound, in hidden (48 heads of 128)
    assert k132(16, 128, heads=48).l2_prefetch == 8 and weights * 2 * 128 * 48 == sp.L2_PREFETCH_MAX_WEIGHT_BYTES
    assert sp.stream_config("bf16", 16, 128, hidden=weights, heads=48, ctas=132).l2_prefetch_group == 8
    assert sp.stream_config("bf16", 32, 128, hidden=weights, heads=48, ctas=132).l2_prefetch_group == 8
    assert sp.stream_config("bf16", 32, 128, hidden=weights + 64, heads=48, ctas=132).l2_prefetch_group == 4
    # larger weights at 16 tokens where the 8-token tile has no ring of two-step units (hidden 2112: below 3072, not
    # a multiple of 128): the cluster ring, one unit ahead in groups of 8
    big16 = sp.stream_config("bf16", 16, 128, hidden=weights + 64, heads=48, ctas=132)
    assert (big16.cluster, big16.l2_prefetch, big16.l2_prefetch_group) == (True, 1, 8)
    assert k132(32, 256, heads=20).l2_prefetch == 0 and k132(32, 96, heads=40).l2_prefetch == 0  # not the cluster
    assert k132(64, 256, heads=20) == EF(stages=6, wgmma=True, finish_tokens=32, splits=sp.SPLITS)
    assert k132(32, 256, heads=20) == EF(stages=8, wgmma=True, splits=sp.SPLITS)
    assert k132(32, 128, heads=66).splits == 2 and k132(32, 128, heads=67).splits == 0    # 134 > 132 CTAs
    assert k132(32, 128, heads=40).splits == 2 and k132(32, 128, heads=39).splits == 0    # 78 < 0.6 x 132
    assert k132(32, 256, heads=20).splits == 2                                            # two blocks a head
    assert k132(32, 96, heads=40) == EF(stages=6)   # the mma.sync ring
    assert sp.stream_config("bf16", 32, 128, hidden=2048, heads=40, ctas=78).splits == 0  # 80 > 78 SMs
    assert sp.stream_config("bf16", 8, 128, hidden=4096, heads=48, ctas=132) == EF(wgmma=True, unit_steps=2,
                                                                                   l2_prefetch=1)
    flint64 = _spec("flint_bf16").replace(max_tokens=64)
    assert [dict(v.params).get("splits", 0) for v in KDEF.variants(flint64, T132)] == [0, 2, 2, 2]
    assert [dict(v.params).get("dsmem_reduce", False) for v in KDEF.variants(flint64, T132)] == [False] + [True] * 3
    # StreamConfig.cluster takes every tile (the 8-token tile too: rank 0 finishes every token)
    k2d = EF(wgmma=True, splits=2, cluster=True)
    assert all(dict(KDEF.variant(flint64, config=k2d, max_m=m, target=T132).params).get("dsmem_reduce")
               for m in (8, 16, 32, 64))
    assert "dsmem_reduce" not in dict(KDEF.variant(flint64, config=StreamConfig(wgmma=True, splits=2), max_m=8,
                                                   target=T132).params)
    assert KDEF.config(flint64, 32) == EF(stages=8, wgmma=True)   # no target: the rule left out
    # the 8-token tile streams for whole-warpgroup blocks only: from hidden 3072 where it is a multiple of 128
    # (units of two K steps, the ring filling shared memory, one unit prefetched into L2 ahead up to hidden 4096),
    # from 3584 otherwise (wgmma, 8 stages)
    assert sp.stream_config("bf16", 8, 128, hidden=3071 - 63) is None
    assert sp.stream_config("bf16", 8, 128, hidden=3136) is None and sp.stream_config("bf16", 8, 128, hidden=3520) is None
    for d in (64, 128, 256):
        for h in (3072, 3200, 3584, 4096, 4224, 8192):
            l2 = sp.STREAM_L2_PREFETCH_8 if h <= sp.STREAM_L2_PREFETCH_MAX_HIDDEN else 0
            assert sp.stream_config("bf16", 8, d, hidden=h) == EF(wgmma=True, unit_steps=2, l2_prefetch=l2)
        assert sp.stream_config("bf16", 8, d, hidden=3648) == EF(stages=8, wgmma=True)
    assert sp.stream_config("bf16", 8, 96, hidden=8192) is None
    assert sp.stream_config("nvfp4", 8, 128, hidden=8192) is None
    assert {dict(v.params).get("design") for v in KDEF.variants(FLINT.replace(max_tokens=64), T132)} == {None}
    p = KDEF.render_params(F64, v)
    assert p["grid"] == 132 and p["stages"] == plan_of(dict(v.params)).ring_stages
    # the argument table: every tensor the kernel takes, in call order
    names = [a.name for a in args_of(dict(v.params))]
    assert names == ["xn", "weight", "q_norm_weight", "k_norm_weight", "cos_sin", "positions", "slot_mapping",
                     "q", "k_cache", "v_cache", "workspace", "counters", "qk_eps"]
    assert p["arg_names"] == ", ".join(names)
    dbg = KDEF.variant(F64.replace(qkv_bias=True, kv_cache_dtype="fp8_e4m3"), debug=True,
                       config=StreamConfig(stages=4), max_m=8, target=T132)
    names = [a.name for a in args_of(dict(dbg.params))]
    assert names[2] == "bias"
    assert names[-6:] == ["k_scale", "v_scale", "workspace", "counters", "pre", "qk_eps"]
    # one workspace per op, sized for its largest streaming tile (never replaced: graphs keep it)
    op = QKVOp(KDEF, F64, T132, lambda v: None)
    assert op._workspace_size[0] == plan_of(dict(KDEF.variants(F64, T132)[-1].params)).workspace_floats
    assert op._workspace_size[1] == 40 and QKVOp(KDEF, FLINT, T132, lambda v: None)._workspace_size[0] == 0
    # another SM count is another binary
    assert KDEF.variant(F64, config=StreamConfig(), max_m=16, target=Target("sm_90a", 114)) != v


def test_variant_refusals():
    with pytest.raises(ValueError, match=r"the streaming design takes bf16 weights, spec 'flint' has 'nvfp4': "
                                         r"use the cluster design"):
        KDEF.variant(FLINT, config=StreamConfig(), target=T132)
    with pytest.raises(ValueError, match=r"a streaming variant needs the target"):
        KDEF.variant(F64, config=StreamConfig())


# ----------------------------------------------------------------- compile
WGMMA = StreamConfig(stages=6, wgmma=True)


def _spec(name):
    from test_qkv import SPECS

    return SPECS[name].replace(max_tokens=64)


def _cfg_id(c):
    return f"s{c.stages}w{c.warp_tiles}" + (f"p{c.prefetch}" if c.prefetch else "") + \
        (f"c{c.ctas_per_sm}" if c.prefetch or c.ctas_per_sm > 1 else "") + ("g" if c.wgmma else "") + \
        ("t" if c.tma else "") + (f"f{c.finish_tokens}" if c.finish_tokens else "") + \
        (f"l{c.l2_prefetch}" if c.l2_prefetch else "") + \
        (f"G{c.l2_prefetch_group}" if c.l2_prefetch_group > 1 else "") + \
        (f"k{c.splits}" if c.splits else "") + \
        ("d" if c.cluster else "") + (f"u{c.unit_steps}" if c.unit_steps > 1 else "") + ("e" if c.evict_first else "")


def test_l2_prefetch_group_refusals_and_params():
    from flintgen.configs.qkv_stream_plan import MAX_L2_PREFETCH_GROUP

    with pytest.raises(ValueError, match=r"l2_prefetch_group = 0 must be an int in 1..16"):
        StreamConfig(wgmma=True, l2_prefetch=1, l2_prefetch_group=0)
    with pytest.raises(ValueError, match=rf"l2_prefetch_group = {MAX_L2_PREFETCH_GROUP + 1} must be an int"):
        StreamConfig(wgmma=True, l2_prefetch=1, l2_prefetch_group=MAX_L2_PREFETCH_GROUP + 1)
    with pytest.raises(ValueError, match=r"l2_prefetch_group = True must be an int"):
        StreamConfig(wgmma=True, l2_prefetch=1, l2_prefetch_group=True)
    with pytest.raises(ValueError, match=r"l2_prefetch_group = 4 groups the ring's L2 prefetch: l2_prefetch = 0"):
        StreamConfig(wgmma=True, l2_prefetch_group=4)
    spec = _spec("bf16_4096")
    v1 = KDEF.variant(spec, config=StreamConfig(wgmma=True, l2_prefetch=1), max_m=32, target=T132)
    v8 = KDEF.variant(spec, config=StreamConfig(wgmma=True, l2_prefetch=1, l2_prefetch_group=8), max_m=32,
                      target=T132)
    assert "l2_prefetch_group" not in dict(v1.params) and dict(v8.params)["l2_prefetch_group"] == 8
    assert KDEF.render_params(spec, v1)["l2_group"] == 1


# a block's CTAs as one cluster reducing through DSMEM (StreamConfig.cluster): 2 ranks, 4 of 8 tokens each
K2D6 = StreamConfig(stages=6, wgmma=True, splits=2, cluster=True)    # the 64-token tile's former ring
K2D8 = StreamConfig(stages=8, wgmma=True, splits=2, cluster=True)    # the 16 / 32-token tiles' former ring
K4D6 = StreamConfig(stages=6, wgmma=True, splits=4, cluster=True)
K2D = StreamConfig(wgmma=True, splits=2, cluster=True)               # the rule's: the ring fills shared memory
K2DU = StreamConfig(wgmma=True, splits=2, cluster=True, unit_steps=2)   # ... with units of two K steps (32 KB)
K3D = StreamConfig(wgmma=True, splits=3, cluster=True)               # 3 ranks: slices of ceil(n-tiles / 3) n-tiles
K3DU = StreamConfig(wgmma=True, splits=3, cluster=True, unit_steps=2)
GU = StreamConfig(wgmma=True, unit_steps=2)                          # the persistent grid, units of two K steps
GU6 = StreamConfig(stages=6, wgmma=True, unit_steps=2)               # ... 6 stages (tiles of 8 and 16 tokens)
GU2L = StreamConfig(wgmma=True, unit_steps=2, evict_first=True, l2_prefetch=1)   # the 8-token rule's ring (and the
                                                                     # 16-token tile's of weights over 24 MB)


# the spread finish's slices (finish_tokens): 16 and 8 tokens, with wgmma and mma.sync, and the production rule's 32
# at 64 tokens (stream_config)
FIN16, FIN8 = StreamConfig(stages=6, wgmma=True, finish_tokens=16), StreamConfig(stages=6, wgmma=True, finish_tokens=8)
FIN8_MMA = StreamConfig(stages=6, finish_tokens=8)
FIN32 = StreamConfig(stages=6, wgmma=True, finish_tokens=32)   # the production rule's at 64 tokens (stream_config)


def _fin_id(c):
    return f"f{c.finish_tokens}" + ("g" if c.wgmma else "")


# ----------------------------------------------------------------- GPU
def _op(spec, cfg=StreamConfig()):
    from flintgen import toolchain
    from flintgen.runtime import load_variant

    t = toolchain.resolve_target()
    return QKVOp(KDEF, spec, t, lambda v: load_variant(KDEF, spec, v, t)[0], config=cfg)


_OPS = {}


def _stream_op(name, cfg=StreamConfig()):
    if (name, cfg) not in _OPS:
        _OPS[name, cfg] = _op(_spec(name), cfg)
    return _OPS[name, cfg]


def _counters_zero(op):
    for ws, counters in op._workspace.values():
        torch.cuda.synchronize()
        assert int(counters.abs().sum()) == 0, "a head counter was not reset"


TILE_MS = (1, 7, 8, 9, 16, 33, 63, 64)
GPU_CASES = ([("flint_bf16", m) for m in TILE_MS] + [("bf16_4096", m) for m in TILE_MS]
             + [("oss_bf16", 5), ("oss_bf16", 64), ("h16384_bf16", 3), ("h16384_bf16", 40), ("d96_r24", 8),
                ("d96_r24", 57), ("glm4", 2), ("glm4", 33), ("phi4_mini", 17), ("qwen_896", 9), ("qwen3_1024", 64)])


@pytest.mark.gpu
@pytest.mark.parametrize("name, m", GPU_CASES, ids=[f"{n}-M{m}" for n, m in GPU_CASES])
def test_stream_numerics(name, m):
    op = _stream_op(name)
    _numerics_spec(op, name, m)
    _counters_zero(op)


def _numerics(op, name, m):
    from test_qkv import _numerics as numerics

    numerics(op, name, m, max(1, m - 1 - m // 8))


def _numerics_spec(op, name, m):
    """test_qkv._numerics on the max_tokens-64 twin of SPECS[name] (slot_mapping shorter than M)."""
    from test_qkv import SPECS, _numerics

    key = f"{name}_t64s"
    SPECS.setdefault(key, _spec(name))
    _numerics(op, key, m, max(1, m - 1 - m // 8))


# every token tile (8..64 tokens: n8..n64), head dims 64 (one warpgroup), 128 and 256 (two blocks per head)
WGMMA_CASES = [("bf16_4096", 1), ("bf16_4096", 16), ("bf16_4096", 33), ("bf16_4096", 64), ("oss_bf16", 9),
               ("oss_bf16", 64), ("flint_bf16", 40), ("h16384_bf16", 17), ("glm4", 63)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, m", WGMMA_CASES, ids=[f"{n}-M{m}" for n, m in WGMMA_CASES])
def test_stream_wgmma_numerics(name, m):
    op = _stream_op(name, WGMMA)
    _numerics_spec(op, name, m)
    _counters_zero(op)


FINISH_CASES = ([("flint_bf16", m, FIN16) for m in (1, 7, 9, 16, 33, 63, 64)]
                + [("flint_bf16", 40, FIN8), ("bf16_4096", 1, FIN8), ("bf16_4096", 64, FIN8), ("oss_bf16", 64, FIN8),
                   ("oss_bf16", 17, FIN16), ("h16384_bf16", 40, FIN16), ("d96_r24", 57, FIN8_MMA),
                   ("glm4", 63, FIN16), ("qwen3_1024", 64, FIN8), ("qwen3_1024", 2, FIN8), ("flint_bf16", 64, FIN32),
                   ("flint_bf16", 33, FIN32), ("h16384_bf16", 64, FIN32), ("glm4", 40, FIN32), ("oss_bf16", 63, FIN32),
                   ("bf16_4096", 48, FIN32)])


CLUSTER_CASES = [("flint_bf16", 64, K2DU), ("flint_bf16", 16, K2DU), ("flint_bf16", 33, K2DU), ("phi4_mini", 9, K2DU),
                 ("bf16_4096", 63, K2DU),
                 ("flint_bf16", 64, K2D6), ("flint_bf16", 40, K2D6), ("flint_bf16", 16, K2D8), ("oss_bf16", 64, K2D6),
                 ("oss_bf16", 17, K2D8), ("glm4", 63, K2D6), ("phi4_mini", 33, K2D6), ("qwen_896", 31, K4D6),
                 ("qwen3_1024", 64, K2D6), ("d96_r24", 57, StreamConfig(stages=6, splits=2, cluster=True)),
                 # padded slices: 3 ranks of 24 / 16 / 8 tokens (the last with none at 16, 8 of 33 at 64), the
                 # 8-token tile on 2 ranks (rank 0 finishes every token), partial rotary with 3 ranks
                 ("flint_bf16", 64, K3D), ("flint_bf16", 33, K3DU), ("flint_bf16", 16, K3D), ("flint_bf16", 9, K3D),
                 ("flint_bf16", 32, K3DU), ("bf16_4096", 8, K2DU), ("flint_bf16", 1, K2D), ("phi4_mini", 5, K2DU),
                 ("glm4", 20, K3D)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, m, cfg", CLUSTER_CASES,
                         ids=[f"{n}-M{m}-{_cfg_id(c)}" for n, m, c in CLUSTER_CASES])
def test_stream_cluster_numerics(name, m, cfg):
    """A block's CTAs reducing through distributed shared memory: the same contract (head dims 64 / 128, bias,
    partial / interleaved rotary, 2 and 4 ranks), and the counters never touched."""
    op = _stream_op(name, cfg)
    _numerics_spec(op, name, m)
    _counters_zero(op)


@pytest.mark.gpu
@pytest.mark.parametrize("name, m, cfg", FINISH_CASES, ids=[f"{n}-M{m}-{_fin_id(c)}" for n, m, c in FINISH_CASES])
def test_stream_finish_numerics(name, m, cfg):
    """Heads finished in token slices by several CTAs: the same contract, counters back at zero."""
    op = _stream_op(name, cfg)
    _numerics_spec(op, name, m)
    _counters_zero(op)


# (config, M, max_tokens): ring depths (11 fill a CTA at 8 tokens), two 16-row tiles per warp and
# the register path (prefetch depths, 1 and 2 CTAs per SM)
CONFIGS = [(StreamConfig(wgmma=True, unit_steps=2, evict_first=True), 8, 8),
           (StreamConfig(wgmma=True, unit_steps=2, l2_prefetch=2, evict_first=True), 1, 8),
           (StreamConfig(wgmma=True, unit_steps=2, l2_prefetch=2, evict_first=True), 7, 8),
           (StreamConfig(stages=6, wgmma=True, splits=2, cluster=True, evict_first=True), 33, 64),
           (StreamConfig(stages=2), 9, 64), (StreamConfig(stages=2), 64, 64), (StreamConfig(stages=3), 1, 64),
           (StreamConfig(stages=11), 8, 8), (StreamConfig(warp_tiles=2), 7, 64), (StreamConfig(warp_tiles=2), 33, 64),
           (StreamConfig(warp_tiles=2, stages=4), 64, 64), (GU6, 1, 8), (GU6, 8, 8), (GU, 40, 64),
           (StreamConfig(prefetch=3, ctas_per_sm=2), 1, 8), (StreamConfig(prefetch=3, ctas_per_sm=2), 8, 8),
           (StreamConfig(prefetch=2, ctas_per_sm=2), 5, 8), (StreamConfig(prefetch=4), 9, 32),
           (StreamConfig(prefetch=4), 17, 32), (StreamConfig(prefetch=4), 32, 32), (StreamConfig(prefetch=8), 2, 8),
           (StreamConfig(stages=4, ctas_per_sm=2), 3, 8), (StreamConfig(stages=5, ctas_per_sm=2), 8, 8),
           # weights prefetched into L2 before the grid-dependency wait: some units, whole ranges
           (StreamConfig(stages=8, wgmma=True, l2_prefetch=8), 1, 8),
           (StreamConfig(stages=6, wgmma=True, finish_tokens=32, l2_prefetch=1 << 16), 64, 64),
           (StreamConfig(prefetch=3, ctas_per_sm=2, l2_prefetch=5), 8, 8),
           # the wgmma ring's weights by TMA (an mbarrier per stage), alone and with the L2 prefetch kept ahead
           (StreamConfig(stages=8, wgmma=True, tma=True), 1, 8), (StreamConfig(stages=8, wgmma=True, tma=True), 17, 32),
           (StreamConfig(stages=6, wgmma=True, finish_tokens=32, tma=True, l2_prefetch=8), 64, 64),
           (StreamConfig(stages=6, wgmma=True, finish_tokens=32, tma=True), 33, 64),
           (StreamConfig(stages=4, wgmma=True, tma=True, ctas_per_sm=2), 9, 64),   # with l2_prefetch its debug binary spills
           # the grid aligned to blocks (splits CTAs per block): one (48 CTAs), two with the spread finish (96),
           # three on the mma.sync ring (144: more than the SMs hold, no CTA waits)
           (StreamConfig(stages=6, wgmma=True, splits=1), 64, 64),
           (StreamConfig(stages=8, wgmma=True, splits=2), 17, 32),
           (StreamConfig(stages=6, wgmma=True, finish_tokens=32, splits=2), 33, 64),
           (StreamConfig(stages=6, splits=3), 9, 16),
           # a block's CTAs as one cluster (the reduce-scatter through DSMEM): rank 1 with one token (M 9 at 16,
           # 33 at 64) or none (M 1 at 64); 4 ranks of 8 tokens, ranks 2 and 3 without tokens at M 9
           (K2D8, 9, 16), (K2D8, 16, 16), (K2D8, 17, 32), (K2D6, 1, 64), (K2D6, 33, 64), (K2D6, 64, 64),
           (K4D6, 9, 32), (K4D6, 32, 32),
           # the cluster finish on the ring filling shared memory (12 stages at 16 tokens) and on the TMA ring
           (StreamConfig(wgmma=True, splits=2, cluster=True), 16, 16),
           (StreamConfig(stages=8, wgmma=True, tma=True, splits=2, cluster=True), 33, 64),
           # ... and on the mma.sync ring (one and two 16-row tiles per warp)
           (StreamConfig(stages=6, splits=2, cluster=True), 17, 32),
           (StreamConfig(stages=4, warp_tiles=2, splits=2, cluster=True), 64, 64),
           # the ring's rolling L2 prefetch in groups (the 16-64 tiles' cluster ring; the 8-token ring across blocks)
           (StreamConfig(wgmma=True, splits=2, cluster=True, evict_first=True, l2_prefetch=1, l2_prefetch_group=8),
            33, 64),
           (StreamConfig(wgmma=True, unit_steps=2, evict_first=True, l2_prefetch=1, l2_prefetch_group=4), 5, 8)]


def _ring_spec(max_tokens):
    from test_qkv import SPECS

    key = f"bf16_4096_m{max_tokens}"
    SPECS.setdefault(key, SPECS["bf16_4096"].replace(max_tokens=max_tokens))
    return key, SPECS[key]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg, m, max_tokens", CONFIGS, ids=[f"{_cfg_id(c)}-M{m}" for c, m, _ in CONFIGS])
def test_stream_other_configs(cfg, m, max_tokens):
    key, spec = _ring_spec(max_tokens)
    _numerics(_op(spec, cfg), key, m)


# (name, M, config): the default ring (mma.sync) over five shapes, and the wgmma ring
FP8 = [("oss_bf16", 8, StreamConfig()), ("oss_bf16", 64, StreamConfig()), ("d96_r24", 33, StreamConfig()),
       ("glm4", 16, StreamConfig()), ("phi4_mini", 5, StreamConfig()), ("oss_bf16", 48, WGMMA),
       ("oss_bf16", 64, FIN8), ("oss_bf16", 33, K2D6), ("glm4", 40, K2DU), ("glm4", 41, K3D), ("glm4", 7, K2DU),
       ("glm4", 16, GU2L)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, m, cfg", FP8, ids=[f"{n}-M{m}" + ("-wgmma" if c.wgmma else "")
                                                   + (f"-f{c.finish_tokens}" if c.finish_tokens else "")
                                                   + ("-cluster" if c.cluster else "") for n, m, c in FP8])
def test_stream_fp8_cache_bit_exact(name, m, cfg):
    """The fp8 binary stores e4m3(bf16 row / scale) of the bf16 binary's rows, bit-exact; q identical."""
    from test_qkv_fp8 import Pair

    spec_b, spec8 = _spec(name), _spec(name).replace(kv_cache_dtype="fp8_e4m3")
    p = Pair(name, m, seed=300 + m, spec_b=spec_b, spec8=spec8, op_b=_op(spec_b, cfg), op8=_op(spec8, cfg))
    p.run().check(f"stream {name} M={m}" + (" wgmma" if cfg.wgmma else ""))
    _counters_zero(p.op8)


# the finish: wgmma, heads in 16-token slices; tma: the wgmma ring's weights by TMA, the L2 prefetch 8 units ahead; cluster: a
# block's two CTAs reducing through DSMEM (M 1: the 8-token tile, which finishes through the workspace)
KINDS = {"mma": StreamConfig(), "wgmma": WGMMA, "finish": FIN16,
         "tma": StreamConfig(stages=6, wgmma=True, tma=True, l2_prefetch=8), "cluster": K2D6}


def refresh_inputs(c, a, seed):
    """Fresh inputs of ``c``'s spec and M copied into the argument tensors ``a`` in place (what a captured
    graph reads at its next replay); the caches stay."""
    from test_qkv import Case

    fresh = Case(c.spec, c.m, seed=seed, n_slots=c.m)
    for dst, src in zip(a, fresh.args()):
        if isinstance(dst, torch.Tensor) and dst is not c.k_cache and dst is not c.v_cache:
            dst.copy_(src)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_stream_graph_replay_with_changed_inputs(kind):
    """A graph captured per token tile replays with new x / weights / positions
    in place and matches eager calls on the same inputs (counters reset
    inside the graph: every replay sees zeros)."""
    from test_qkv import Case

    spec = _spec("bf16_4096")
    op = _stream_op("bf16_4096", KINDS[kind])
    op.warmup(torch.device("cuda"))
    for m in (1, 9, 64):
        c = Case(spec, m, seed=11 + m, n_slots=m)
        a = list(c.args())
        q_out = torch.empty(m, c.qh * c.d, dtype=torch.bfloat16, device="cuda")
        xn = torch.empty_like(c.x)
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            op(*a, q_out=q_out, xn_out=xn)
        for r in range(3):
            refresh_inputs(c, a, seed=1000 * r + m)
            c.poison()
            g.replay()
            torch.cuda.synchronize()
            q_g, k_g, v_g = q_out.clone(), c.k_cache.clone(), c.v_cache.clone()
            c.poison()
            q_e, _ = op(*a)
            torch.cuda.synchronize()
            assert torch.equal(q_g, q_e), f"M={m} replay {r}"
            assert torch.equal(k_g.nan_to_num(7.0), c.k_cache.nan_to_num(7.0)), f"M={m} replay {r}"
            assert torch.equal(v_g.nan_to_num(7.0), c.v_cache.nan_to_num(7.0)), f"M={m} replay {r}"
        _counters_zero(op)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_stream_layers_back_to_back_race_free(kind):
    """Layers launched back to back (PDL, shared workspace and counters) give
    the bits of the same layers separated by synchronizations."""
    from test_qkv import Case

    spec = _spec("flint_bf16")
    op = _stream_op("flint_bf16", KINDS[kind])
    layers = [Case(spec, 33, seed=70 + i, n_slots=33) for i in range(5)]
    for i, c in enumerate(layers):
        c.slots = torch.arange(33 * i, 33 * i + 33, device="cuda") % (6 * 16)
        c.k_cache, c.v_cache = layers[0].k_cache, layers[0].v_cache

    def chain(sync):
        res = layers[0].residual.clone()
        xn = torch.empty_like(layers[0].x)
        q = torch.empty(33, spec.num_q_heads * 128, dtype=torch.bfloat16, device="cuda")
        layers[0].poison()
        torch.cuda.synchronize()
        outs = []
        for c in layers:
            a = list(c.args())
            a[1] = res
            op(*a, q_out=q, xn_out=xn, residual_out=res)
            outs.append(q.clone())
            if sync:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return outs + [res.clone(), layers[0].k_cache.clone(), layers[0].v_cache.clone()]

    want = chain(True)
    for _ in range(3):
        for a, b in zip(chain(False), want):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    _counters_zero(op)


# ----------------------------------------------------------------- prebuild for a GPU machine without the DSL
# (spec name, config) the graph-replay and back-to-back tests run: every KINDS config on both specs
KIND_SPECS = [(n, c) for n in ("bf16_4096", "flint_bf16") for c in KINDS.values()]


def gpu_variants(target):
    """(spec, variant) of every binary the GPU tests above load (every token tile,
    production and debug; the ring depths' configs; the specs' RMSNorm kernels)."""
    from flintgen.configs.qkv_config import TOKEN_TILES, token_tiles
    from flintgen.kernels import get_def

    todo = []
    names = sorted({n for n, _ in GPU_CASES} | {n for n, _, _ in FP8} | {"bf16_4096"})
    for cfg, _, mt in CONFIGS:
        spec = _ring_spec(mt)[1]
        todo += [(KDEF, spec, KDEF.variant(spec, config=cfg, max_m=tile, target=target, debug=d))
                 for tile in token_tiles(mt) for d in (False, True)]
    for name in sorted({n for n, _ in WGMMA_CASES}):
        for spec in (_spec(name),) + ((_spec(name).replace(kv_cache_dtype="fp8_e4m3"),) if name == "oss_bf16" else ()):
            todo += [(KDEF, spec, KDEF.variant(spec, config=WGMMA, max_m=tile, target=target, debug=d))
                     for tile in TOKEN_TILES for d in (False, True)]
    fin = {(n, c) for n, _, c in FINISH_CASES + CLUSTER_CASES} | set(KIND_SPECS)
    fp8_fin = {(n, c) for n, _, c in FP8 if c != StreamConfig()}   # (the default ring's: the names' loop below)
    for name, cfg in sorted(fin | fp8_fin, key=str):
        specs = (_spec(name),) + ((_spec(name).replace(kv_cache_dtype="fp8_e4m3"),) if (name, cfg) in fp8_fin else ())
        todo += [(KDEF, spec, KDEF.variant(spec, config=cfg, max_m=tile, target=target, debug=d))
                 for spec in specs for tile in TOKEN_TILES for d in (False, True)]
    for name in names:
        for spec in (_spec(name), _spec(name).replace(kv_cache_dtype="fp8_e4m3")):
            if spec.kv_cache_dtype == "fp8_e4m3" and name not in {n for n, _, _ in FP8}:
                continue
            rms = get_def("rms_norm")
            todo += [(rms, spec, v) for v in rms.variants(spec, target)]
            todo += [(KDEF, spec, KDEF.variant(spec, config=StreamConfig(), max_m=tile, target=target, debug=d))
                     for tile in TOKEN_TILES for d in (False, True)]
    # the production op's binaries (every tile, production and debug) of test_qkv's token-tile cases with
    # bf16 weights (their tiles of 16+ tokens stream), test_qkv_tokens' graph replay and test_qkv_fp8's bf16 tile
    from test_qkv import SPECS

    for name in ("bf16_4096", "flint_bf16", "oss_bf16", "h16384_bf16", "oss_bf16_fp8"):
        spec = SPECS[name].replace(max_tokens=64)
        rms = get_def("rms_norm")
        todo += [(rms, spec, v) for v in rms.variants(spec, target)]
        todo += [(KDEF, spec, KDEF.variant(spec, max_m=tile, target=target, debug=d))
                 for tile in TOKEN_TILES for d in (False, True)]
    return todo


def test_cache_key_covers_device_code_only():
    """A binary's key hashes the flintgen modules its source imports,
    transitively (flintgen.cache.helpers_hash): the device helpers and
    cute-free configs, never the host package (spec, kernels, cache), whose
    edits would rebuild every kernel."""
    from flintgen import cache, codegen
    from flintgen.kernels import KERNELS

    cases = [(k, FLINT, v) for k in KERNELS.values() for v in k.variants(FLINT, T132)[:1]]
    cases += [(KDEF, s, KDEF.variant(s, max_m=t, target=T132))
              for s, t in ((F64, 8), (F64, 64), (F64.replace(kv_cache_dtype="fp8_e4m3"), 32))]
    for kdef, spec, v in cases:
        src = codegen.render(v.kernel, kdef.template_of(v), dict(kdef.render_params(spec, v)))
        seen, todo = set(), sorted(cache._imports(src))
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                pkg = name if cache._module_file(name).endswith("__init__.py") else name.rsplit(".", 1)[0]
                todo += sorted(cache._imports(cache._read_module(name).decode(), pkg) - seen)
        assert all(n.startswith(("flintgen.device", "flintgen.configs", "flintgen.layout")) for n in seen), seen


def test_device_buffers_allocate_once_per_device():
    """flintgen.kernels.workspace.DeviceBuffers (decode attention's and the
    streaming GEMV's workspaces): one make() per device, the same buffers
    after, none allocated inside a capture."""
    from unittest import mock

    from flintgen.kernels.workspace import DeviceBuffers

    made = []
    bufs = DeviceBuffers("qkv", lambda d: made.append(d) or (d, len(made)))
    with mock.patch("torch.cuda.is_current_stream_capturing", return_value=False):
        assert bufs.get("a") is bufs.get("a") and bufs.get("b") == ("b", 2) and made == ["a", "b"]
    assert bufs["a"] == ("a", 1) and list(bufs.values()) == [("a", 1), ("b", 2)]
    with mock.patch("torch.cuda.is_current_stream_capturing", return_value=True):
        assert bufs.get("a") == ("a", 1)      # allocated already: capture-safe
        with pytest.raises(RuntimeError, match=r"flintgen qkv: the workspace is allocated on first use, which must "
                                               r"not be inside a CUDA-graph capture: call op.warmup\(device\)"):
            bufs.get("c")


@pytest.mark.parametrize("wg", [False, True], ids=["mma", "wgmma"])
def test_ablation_patches_apply(wg):
    """benchmarks/qkv_stream_ablation.py's patches each replace whole lines of the rendered module once, and
    what they leave still parses with the patched statement gone (the tool times what its labels say)."""
    import ast

    import benchmarks.qkv_stream_ablation as abl

    spec = _spec("bf16_4096")
    for m in (8, 64):
        v = KDEF.variant(spec, config=StreamConfig(stages=6, wgmma=wg), max_m=m, target=T132)
        ref = abl.patched_source(spec, v, "ref")
        for tag, patches in abl.PATCHES.items():
            src = abl.patched_source(spec, v, tag)
            ast.parse(src)
            for old, new in patches:
                assert ref.count(old) == 1 and src.count(old) == 0, (tag, old)
            if tag in ("no_mma", "no_sync"):   # one line less, nothing else
                assert src.count("\n") == ref.count("\n") - 1, tag
    # no_mma drops the loop's MMA and nothing else: the partial stores stay after the loop
    src = abl.patched_source(spec, v, "no_mma")
    i = src.index("for u in cutlass.range(seg_lo")
    loop = src[i:src.index("self.store_partials(workspace, acc, cta * MAX_SEGS + seg,", i)]
    assert "self.mma_unit(" not in loop and "self.refill(" in loop


if __name__ == "__main__":
    # python tests/test_qkv_stream.py --prebuild DIR [--no-other-configs] [--finish-only | --cluster-only]
    #                                    [--configs-matching A,B]:
    # compile the GPU tests' binaries for sm_90a / 132 SMs into DIR (--no-other-configs: not
    # test_stream_other_configs' ring depths and paths; --finish-only: the spread finish's binaries alone;
    # --configs-matching: test_stream_other_configs' configs whose id (_cfg_id) holds one of the strings, alone)
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from flintgen.cli import _build_one
    from flintgen.procutil import run_spawned

    from flintgen.configs.qkv_config import TOKEN_TILES, token_tiles

    root = os.path.abspath(sys.argv[sys.argv.index("--prebuild") + 1])
    skip = set()
    if "--no-other-configs" in sys.argv:
        skip = {KDEF.variant(_ring_spec(mt)[1], config=c, max_m=tile, target=T132, debug=d)
                for c, _, mt in CONFIGS for tile in token_tiles(mt) for d in (False, True)}
        skip -= {KDEF.variant(_spec(n), config=c, max_m=tile, target=T132, debug=d)     # the KINDS tests need them
                 for n, c in KIND_SPECS for tile in TOKEN_TILES for d in (False, True)}
    todo = {(k.name, v): (k, s, v) for k, s, v in gpu_variants(T132) if v not in skip}
    if "--finish-only" in sys.argv:   # the spread finish's tests alone (-k "finish or f8")
        todo = {key: c for key, c in todo.items() if c[0] is not KDEF or dict(c[2].params).get("finish_tokens")}
    if "--cluster-only" in sys.argv:   # the cluster finish's tests alone (-k cluster; the 8-token tiles of KINDS too)
        todo = {key: c for key, c in todo.items() if c[0] is not KDEF or dict(c[2].params).get("splits")}
    if "--configs-matching" in sys.argv:
        want = sys.argv[sys.argv.index("--configs-matching") + 1].split(",")
        todo = {(KDEF.name, v): (KDEF, _ring_spec(mt)[1], v) for c, _, mt in CONFIGS
                if any(w in _cfg_id(c) for w in want)
                for tile in token_tiles(mt) for d in (False, True)
                for v in [KDEF.variant(_ring_spec(mt)[1], config=c, max_m=tile, target=T132, debug=d)]}
    run_spawned(_build_one, [(s, k.name, v, T132, root) for k, s, v in todo.values()])
    print(f"prebuilt {len(todo)} variants into {root}")
