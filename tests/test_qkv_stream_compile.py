"""The streaming QKV GEMV compiled for sm_90a (``compile``): token tiles 8 .. 64
of head dims 64 / 96 / 128 / 256, bias, partial / interleaved rotary and an fp8
cache compile spill-free with each design's PTX (4 MMAs per n-tile and segment
loop body, wgmma per K step, the L2 prefetches and evict-first copies, the
cluster finish's DSMEM stores, TMA copies, the spread finish's polls). Specs
and launch configs: tests/test_qkv_stream.py (the GPU tests run the same ones).
"""

from __future__ import annotations

import pytest

from flintgen.configs import qkv_stream_plan as sp
from flintgen.kernels.qkv_stream import StreamConfig
from test_qkv_stream import (FIN8, FIN8_MMA, FIN16, FIN32, GU6, K2D, K2D6, K2D8, K2DU, K3D, K3DU, K4D6, KDEF, T132,
                             WGMMA, _cfg_id, _fin_id, _spec)


def _compiled(spec, cfg, max_m):
    """(render params, PTX) of the streaming variant (``cfg`` None: the op's), built for sm_90a and checked
    (decode_attention_cases.check_compiled: required PTX, ptxas resources)."""
    from decode_attention_cases import check_compiled

    from flintgen.runtime import load_variant

    v = KDEF.variant(spec, config=cfg, max_m=max_m, target=T132)
    load_variant(KDEF, spec, v, T132)
    return KDEF.render_params(spec, v), check_compiled(KDEF, spec, v, T132)[1]


COMPILE = [("flint_bf16", 8), ("flint_bf16", 64), ("bf16_4096", 16), ("bf16_4096", 32), ("oss_bf16", 64),
           ("h16384_bf16", 64), ("d96_r24", 8), ("glm4", 32), ("phi4_mini", 64), ("oss_bf16_fp8", 8),
           ("d96_r24_fp8", 64), ("qwen_896", 16)]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m", COMPILE, ids=[f"{n}-M{m}" for n, m in COMPILE])
def test_stream_compiles_clean(name, max_m):
    p, ptx = _compiled(_spec(name), StreamConfig(), max_m)
    # one CTA per SM (the ring fills shared memory): registers up to 255 per thread are free
    assert p["stages"] >= 4, p["stages"]
    # the unit loop body of each segment: 4 MMAs per 8-token n-tile
    assert ptx.count("mma.sync.aligned.m16n8k16") == p["max_segments"] * 4 * (max_m // 8)
    assert ptx.count("cp.async.wait_group") == p["max_segments"]
    assert ".minnctapersm 1" in ptx     # else ptxas squeezes some variants into 64 registers and spills


# what the op runs from 16 tokens (stream_config: 8 wgmma stages at 16 / 32 tokens, 6 at 64) on every compiled
# shape whose blocks are whole warpgroups, and the 8-token tile: production from hidden 3072 (units of two K steps,
# 6 stages filling shared memory) where hidden is a multiple of 128, else from 3584 (8 stages), else with wgmma as a
# config (6 stages)
WGMMA_COMPILE = [("flint_bf16", 8), ("flint_bf16", 64), ("bf16_4096", 8), ("bf16_4096", 16), ("bf16_4096", 32),
                 ("bf16_4096", 64), ("oss_bf16", 32), ("h16384_bf16", 8), ("h16384_bf16", 16), ("h16384_bf16", 64),
                 ("glm4", 32), ("glm4_fp8", 8), ("phi4_mini", 64), ("oss_bf16_fp8", 64), ("qwen_896", 16)]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m", WGMMA_COMPILE, ids=[f"{n}-M{m}" for n, m in WGMMA_COMPILE])
def test_stream_wgmma_compiles_clean(name, max_m):
    spec = _spec(name)
    production = isinstance(KDEF.config(spec, max_m), StreamConfig)
    h = spec.hidden_size
    assert production == (max_m >= sp.STREAM_MIN_TOKENS or h >= sp.STREAM_MIN_HIDDEN_8
                          or (h >= sp.STREAM_MIN_HIDDEN_8_UNITS and h % 128 == 0))
    p, ptx = _compiled(spec, None if production else WGMMA, max_m)
    # the cluster finish (the rule's where two CTAs per block fill 0.6-1 x the SMs and a head is one block) fills
    # shared memory: 12 / 10 / 8 stages at 16 / 32 / 64 tokens for head dim 128
    cluster = production and KDEF.config(spec, max_m, T132).cluster
    # the 8-token rule's units of two K steps, and its ring at the 16-token tile of weights over 24 MB up to hidden
    # 4096 (bf16_4096: 50 MB)
    heads = spec.q_heads_per_rank + 2 * spec.kv_heads_per_rank
    big = h * heads * spec.head_dim * 2 > sp.L2_PREFETCH_MAX_WEIGHT_BYTES
    units2 = production and h % 128 == 0 and (max_m == 8 or (max_m == 16 and big
                                                             and h <= sp.STREAM_L2_PREFETCH_MAX_HIDDEN))
    stages = {16: 12, 32: 10, 64: 8}[max_m] if cluster else (8 if production and max_m <= 32 and not units2 else 6)
    assert p["use_wgmma"] is True and p["cluster"] == cluster and p["stages"] == stages
    assert p["unit_steps"] == (2 if units2 else 1)
    # each segment's unit: 4 k16 steps of m64n{max_m}k16 per K step, waited on once; no mma.sync
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{max_m}k16.f32.bf16.bf16") == p["max_segments"] * 4 * (
        2 if units2 else 1)
    assert ptx.count("wgmma.wait_group.sync.aligned 0") == p["max_segments"]
    assert "mma.sync" not in ptx
    if spec.kv_cache_dtype == "fp8_e4m3":   # k_scale / v_scale loaded before the grid wait, 1 / scale after it
        wait = ptx.index("griddepcontrol.wait")
        assert ptx[:wait].count("ld.global.f32") == 2
        assert ptx.count("rcp.rn.f32") == 2 and ptx.index("rcp.rn.f32") > wait


# weights prefetched into L2 before the grid-dependency wait (l2_prefetch): a range's few units kept ahead of the
# ring (hidden 4096: 24 units a range), whole ranges, the register path
L2_COMPILE = [("bf16_4096", 64, StreamConfig(stages=6, wgmma=True, finish_tokens=32, l2_prefetch=8), True),
              ("bf16_4096", 8, StreamConfig(stages=8, wgmma=True, l2_prefetch=4), True),
              ("flint_bf16", 32, StreamConfig(stages=8, wgmma=True, l2_prefetch=1 << 16), False),
              ("bf16_4096", 8, StreamConfig(prefetch=3, ctas_per_sm=2, l2_prefetch=8), False)]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m, cfg, rolling", L2_COMPILE,
                         ids=[f"{n}-M{m}-{_cfg_id(c)}" for n, m, c, _ in L2_COMPILE])
def test_stream_l2_prefetch_compiles_clean(name, max_m, cfg, rolling):
    p, ptx = _compiled(_spec(name), cfg, max_m)
    assert p["l2_prefetch"] == cfg.l2_prefetch
    wait = ptx.index("griddepcontrol.wait")
    # the range's rows before the wait (one bulk prefetch per row and block, unrolled over the threads' rows),
    # and with a range longer than the prefetch, one per unit in the ring's loop after it
    before = ptx[:wait].count("cp.async.bulk.prefetch.L2.global")
    assert before == p["max_segments"] * -(-p["block_rows"] // (32 * p["warps"])), before
    assert ptx[wait:].count("cp.async.bulk.prefetch.L2.global") == (p["max_segments"] if rolling else 0)


# the ring's rolling L2 prefetch grouped (l2_prefetch_group): the cluster finish at 32 tokens (the 16-64 tiles'
# ring, 16 units a range at hidden 4096), the 8-token ring of two-step units across blocks
L2_GROUP_COMPILE = [("bf16_4096", 32, StreamConfig(wgmma=True, splits=2, cluster=True, evict_first=True,
                                                   l2_prefetch=1, l2_prefetch_group=8)),
                    ("bf16_4096", 8, StreamConfig(wgmma=True, unit_steps=2, evict_first=True, l2_prefetch=1,
                                                  l2_prefetch_group=4))]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m, cfg", L2_GROUP_COMPILE,
                         ids=[f"{n}-M{m}-{_cfg_id(c)}" for n, m, c in L2_GROUP_COMPILE])
def test_stream_l2_prefetch_group_compiles_clean(name, max_m, cfg):
    """One bulk prefetch per row and block segment every l2_prefetch_group units (the group's bytes of the row),
    guarded by the unit index modulo the group; the ungrouped binary prefetches one unit's bytes per row at
    every unit."""
    from dataclasses import replace

    spec = _spec(name)
    p, ptx = _compiled(spec, cfg, max_m)
    assert p["l2_group"] == cfg.l2_prefetch_group and p["l2_prefetch"] == 1
    wait = ptx.index("griddepcontrol.wait")
    after = ptx[wait:].count("cp.async.bulk.prefetch.L2.global")   # in each segment's loop, one per segment
    assert after == p["max_segments"] ** 2, after                   # the group can reach
    _, plain = _compiled(spec, replace(cfg, l2_prefetch_group=1), max_m)
    assert plain[plain.index("griddepcontrol.wait"):].count("cp.async.bulk.prefetch.L2.global") == p["max_segments"]
    assert ptx != plain




# the grid aligned to blocks: one CTA per block (wgmma, 64 tokens), two (8 stages, TMA), three (mma.sync ring); as a
# cluster: 16 / 32 / 64 tokens, head dims 64 / 96 (mma.sync) / 128, bias, an fp8 cache, partial and interleaved rotary
SPLITS_COMPILE = [("flint_bf16", 64, StreamConfig(stages=6, wgmma=True, splits=1)),
                  ("bf16_4096", 32, StreamConfig(stages=8, wgmma=True, tma=True, splits=2)),
                  ("flint_bf16", 16, StreamConfig(stages=6, splits=3)),
                  ("flint_bf16", 64, K2D6), ("flint_bf16", 16, K2D8), ("bf16_4096", 32, K2D), ("oss_bf16_fp8", 64, K2D6),
                  ("qwen_896", 32, K4D6), ("phi4_mini", 64, K2D6), ("glm4", 16, K2D8),
                  ("d96_r24", 64, StreamConfig(stages=6, splits=2, cluster=True)),
                  # ranks past the tile's n-tiles (padded slices): 3 ranks at 16 / 64 tokens, 2 at the 8-token tile
                  ("flint_bf16", 16, K3D), ("flint_bf16", 64, K3DU), ("bf16_4096", 8, K2DU), ("glm4_fp8", 32, K3D)]


# the ring's weight copies with the L2 evict-first policy (evict_first): the op's 8-token ring (units of two K
# steps) and its cluster finish at 64 tokens
EVICT_COMPILE = [("bf16_4096", 8, StreamConfig(wgmma=True, unit_steps=2, evict_first=True)),
                 ("flint_bf16", 64, StreamConfig(stages=6, wgmma=True, splits=2, cluster=True, evict_first=True))]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m, cfg", EVICT_COMPILE, ids=[f"{n}-M{m}-{_cfg_id(c)}" for n, m, c in EVICT_COMPILE])
def test_stream_evict_first_compiles_clean(name, max_m, cfg):
    import re

    from dataclasses import replace

    spec = _spec(name)
    p, ptx = _compiled(spec, cfg, max_m)
    assert p["evict_first"] is True
    copies = re.findall(r"cp\.async\.cg\.shared\.global\S* \[[^]]+\], \[[^]]+\], 16, n(?:, %rd\d+)?;", ptx)
    hinted = [c for c in copies if ".L2::cache_hint" in c]
    # every weight copy hinted (BLOCK_ROWS x 8 pieces per sub-stage over the threads), xn's copies not
    assert hinted and len(hinted) < len(copies), (len(hinted), len(copies))
    assert "createpolicy.fractional.L2::evict_first.b64" in ptx
    _, off = _compiled(spec, replace(cfg, evict_first=False), max_m)
    assert "cache_hint" not in off and "createpolicy" not in off


# units of two K steps (unit_steps = 2): the cluster finish at 16 / 64 tokens (head dims 64 / 128, an fp8 cache),
# the persistent grid's ranges across blocks at the 8-token tile (hidden 4096) and with the spread finish
UNIT_COMPILE = [("flint_bf16", 16, K2DU), ("flint_bf16", 64, K2DU), ("phi4_mini", 32, K2DU), ("glm4", 64, K2DU),
                ("bf16_4096", 8, GU6), ("flint_bf16", 64, StreamConfig(stages=4, wgmma=True, finish_tokens=32,
                                                                      unit_steps=2))]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m, cfg", UNIT_COMPILE, ids=[f"{n}-M{m}-{_cfg_id(c)}" for n, m, c in UNIT_COMPILE])
def test_stream_unit_steps_compile_clean(name, max_m, cfg):
    spec = _spec(name)
    p, ptx = _compiled(spec, cfg, max_m)
    assert p["unit_steps"] == 2 and p["stage_bytes"] == 2 * (p["block_rows"] + max_m) * 128
    assert p["units"] == sp.blocks_of(spec.q_heads_per_rank + 2 * spec.kv_heads_per_rank, spec.head_dim) * (
        spec.hidden_size // 128)
    # one commit group per unit: its two sub-stages' 4 k16 steps each, per segment's unit loop
    mma = f"wgmma.mma_async.sync.aligned.m64n{max_m}k16.f32.bf16.bf16"
    assert ptx.count(mma) == 8 * p["max_segments"] and ptx.count("wgmma.commit_group") == p["max_segments"]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m, cfg", SPLITS_COMPILE,
                         ids=[f"{n}-M{m}-{_cfg_id(c)}" for n, m, c in SPLITS_COMPILE])
def test_stream_splits_compile_clean(name, max_m, cfg):
    from flintgen.kernels.qkv_stream import CLUSTER_PTX, COUNTER_PTX

    spec = _spec(name)
    p, ptx = _compiled(spec, cfg, max_m)
    heads = spec.q_heads_per_rank + 2 * spec.kv_heads_per_rank
    assert p["grid"] == sp.blocks_of(heads, spec.head_dim) * cfg.splits and p["max_segments"] == 1
    assert p["max_contributors"] == cfg.splits
    mma = f"wgmma.mma_async.sync.aligned.m64n{max_m}k16.f32.bf16.bf16" if cfg.wgmma else "mma.sync.aligned.m16n8k16"
    assert mma in ptx
    counters = [i in ptx for i in COUNTER_PTX]      # the workspace finish's atomic and counter reset
    assert p["cluster"] == cfg.cluster and ((not any(counters)) if cfg.cluster else all(counters))
    if cfg.cluster:   # each rank sends the other ranks' slices, 16 bytes a store; no workspace partial or poll
        slice_tokens = 8 * -(-max_m // (8 * cfg.splits))   # whole n-tiles, the last ranks' padded past the tile
        assert p["recv_bytes"] == (cfg.splits - 1) * spec.head_dim * slice_tokens * 4
        assert ptx.count("st.shared::cluster.v4.f32") == (cfg.splits - 1) * p["slice_values"] // 4
        assert all(i in ptx for i in CLUSTER_PTX) and "ld.acquire" not in ptx and "st.global.v2.f32" not in ptx


# the wgmma ring filled by TMA: 8 / 16 / 64 tokens, head dims 64 / 128 / 256, an fp8 cache, with the L2 prefetch
TMA_COMPILE = [("flint_bf16", 8, StreamConfig(stages=8, wgmma=True, tma=True)),
               ("bf16_4096", 16, StreamConfig(stages=8, wgmma=True, tma=True, l2_prefetch=8)),
               ("oss_bf16", 64, StreamConfig(stages=6, wgmma=True, finish_tokens=32, tma=True)),
               ("h16384_bf16", 64, StreamConfig(stages=6, wgmma=True, finish_tokens=32, tma=True)),
               ("oss_bf16_fp8", 32, StreamConfig(stages=8, wgmma=True, tma=True))]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m, cfg", TMA_COMPILE, ids=[f"{n}-M{m}-{_cfg_id(c)}" for n, m, c in TMA_COMPILE])
def test_stream_tma_compiles_clean(name, max_m, cfg):
    p, ptx = _compiled(_spec(name), cfg, max_m)
    assert p["tma"] is True and p["use_wgmma"] is True
    # a tensor copy per operand and unit: the first units' weights before the grid wait, their xn after it,
    # both in each segment's loop; no cp.async at all; the stages' barriers one wait per segment's loop
    tensor = "cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes"
    wait = ptx.index("griddepcontrol.wait")
    assert ptx[:wait].count(tensor) == p["lookahead"]
    assert ptx[wait:].count(tensor) == p["lookahead"] + 2 * p["max_segments"]
    assert ptx.count("mbarrier.init.shared.b64") == p["stages"]
    assert ptx.count("mbarrier.try_wait") == p["max_segments"]
    assert "cp.async.cg" not in ptx and "cp.async.wait_group" not in ptx
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{max_m}k16.f32.bf16.bf16") == p["max_segments"] * 4


# the spread finish (finish_tokens): both MMA kinds, head dims 64 / 96 / 128 / 256, fp8, slices of 8 and 16
FINISH_COMPILE = [("flint_bf16", 64, FIN16), ("flint_bf16", 64, FIN8), ("bf16_4096", 16, FIN8), ("oss_bf16", 64, FIN8),
                  ("h16384_bf16", 64, FIN16), ("d96_r24", 32, FIN8_MMA), ("glm4", 32, FIN16),
                  ("oss_bf16_fp8", 64, FIN16), ("qwen3_1024", 64, FIN8), ("flint_bf16", 64, FIN32),
                  ("oss_bf16", 64, FIN32), ("h16384_bf16", 64, FIN32)]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m, cfg", FINISH_COMPILE, ids=[f"{n}-M{m}-{_fin_id(c)}" for n, m, c in FINISH_COMPILE])
def test_stream_finish_compiles_clean(name, max_m, cfg):
    p, ptx = _compiled(_spec(name), cfg, max_m)
    assert p["finish_slices"] == max_m // cfg.tokens_for(max_m) and p["max_owned"] >= 1
    # one poll loop per owned slice, no arrival flag broadcast (counting only: one atomic per segment,
    # one departure per owned slice)
    assert ptx.count("nanosleep") == p["max_owned"]
    assert ptx.count("ld.acquire.gpu.global") == 2 * p["max_owned"]   # the poll loop rotated: one load before it
    assert ptx.count("atom.acq_rel.gpu.global.add.s32") == p["max_segments"] + p["max_owned"]
