"""The fused QKV step (rms_norm + the QKV GEMV) over the model shapes it serves.

Factors (per rank): head dim (HEAD_DIMS) x hidden (HIDDENS: 512 ... 16384,
q_heads x head_dim free of it, e.g. Qwen3-0.6B's 1024 with 16 x 128) x
weights bf16 / NVFP4 x RoPE (ROPES) x q/k bias x q/k norm; GQA (GRID_GQA, as
in the decode-attention grid) and kv heads enter through the head counts.

* CPU: the pairwise (covering-array) selection covers every pair of factor
  values; every hidden size in range gets a launch configuration whose shared
  memory fits a CTA (QKVSmem: whole xn rows up to about 13k, K-chunks above),
  and sizes out of range are refused with the fix.
* ``compile`` (CI, sm_90a): the selection's GEMV variants, the edge sizes of
  the chunked staging and a few model shapes compile with the design's PTX
  (one multicast per xn chunk, a cluster barrier between chunks) and no
  spills, stack or local memory; so do the rms_norm variants of every hidden
  size. The full product (480 code paths x head counts) differs from these
  only in constants already exercised pairwise.

GPU numerics per hidden size: tests/test_qkv.py (GPU_CASES).
"""

from __future__ import annotations

import itertools
import re

import pytest

from flintgen import cache
from flintgen.configs import qkv_config as qc
from flintgen.kernels.base import Target
from flintgen.kernels.qkv import QKVDef
from flintgen.kernels.rms_norm import RMSNormDef
from flintgen.presets import FLINT
from test_qkv import check_design_ptx, cluster_config

KDEF = QKVDef()
NORM = RMSNormDef()
T132 = Target("sm_90a", 132)

# One constant per factor: extend these to grow the grid. ROPES: name -> the
# spec fields for a head dim (partial rotary: half the head, as GLM-4).
HEAD_DIMS = (64, 96, 128, 256)
HIDDENS = (512, 896, 1024, 2048, 2560, 3072, 3584, 5120, 8192, 16384)
FORMATS = ("bf16", "nvfp4")
ROPES = {
    "none": lambda d: dict(rope_style="none"),
    "neox": lambda d: dict(rope_style="neox"),
    "interleaved": lambda d: dict(rope_style="interleaved"),
    "neox-half": lambda d: dict(rope_style="neox", rotary_dim=d // 2),
    "interleaved-half": lambda d: dict(rope_style="interleaved", rotary_dim=d // 2),
}
BIASES = (False, True)
QK_NORMS = (False, True)
GRID_GQA = (1, 2, 3, 5, 6, 7, 8, 12, 16)
KV_HEADS = (1, 2, 4, 8)
FACTORS = (HIDDENS, HEAD_DIMS, FORMATS, tuple(ROPES), BIASES, QK_NORMS)


def covering_rows(factors=FACTORS):
    """A pairwise covering array of ``factors``: greedily the full-product row
    that covers the most uncovered value pairs (on a tie, the one whose values
    the rows so far used least, then the first in product order), until every
    pair of values of every two factors is in some row. Deterministic."""
    k = len(factors)
    combos = list(itertools.combinations(range(k), 2))
    uncovered = {(i, a, j, b) for i, j in combos for a in factors[i] for b in factors[j]}
    used = {(i, a): 0 for i in range(k) for a in factors[i]}
    rows = []
    while uncovered:
        best = max(itertools.product(*factors),
                   key=lambda r: (sum((i, r[i], j, r[j]) in uncovered for i, j in combos),
                                  -sum(used[i, r[i]] for i in range(k))))
        rows.append(best)
        uncovered -= {(i, best[i], j, best[j]) for i, j in combos}
        for i in range(k):
            used[i, best[i]] += 1
    return rows


def qkv_spec(hidden, head_dim, fmt, rope, bias, qk_norm, gqa, kv, name=None):
    return FLINT.replace(
        name=name or f"qkvgrid-h{hidden}-d{head_dim}-{fmt}-{rope}-b{int(bias)}-n{int(qk_norm)}-g{gqa}-kv{kv}",
        hidden_size=hidden, head_dim=head_dim, weight_format=fmt, qkv_bias=bias, qk_norm=qk_norm,
        num_q_heads=gqa * kv, num_kv_heads=kv, **ROPES[rope](head_dim))


def grid_specs():
    """{id: spec}: the covering rows (GQA and kv heads cycling over the rows,
    so each GQA meets several head dims and hidden sizes), the edges of the
    chunked xn staging and model shapes."""
    out = {}
    for i, row in enumerate(covering_rows()):
        gqa, kv = GRID_GQA[i % len(GRID_GQA)], KV_HEADS[(i // len(GRID_GQA) + i) % len(KV_HEADS)]
        spec = qkv_spec(*row, gqa, kv)
        out[spec.name] = spec
    edges = [
        (13760, 128, "nvfp4", "neox", False, True, 8, 1),   # the largest whole-row staging at d = 128
        (13824, 128, "bf16", "neox", False, True, 4, 2),    # the first chunked one: 2 x 108 steps
        (14144, 64, "nvfp4", "none", True, False, 6, 2),    # the first chunked at d = 64: 221 steps, a short
                                                            # last chunk and a K tail
        (16320, 256, "bf16", "neox", True, True, 2, 1),     # chunked, 255 steps
    ]
    models = {
        "qwen3-0.6b": (1024, 128, "bf16", "neox", False, True, 2, 8),     # 16 x 128 q = 2048 != hidden
        "qwen2.5-0.5b": (896, 64, "bf16", "neox", True, False, 7, 2),
        "qwen2.5-7b": (3584, 128, "nvfp4", "neox", True, False, 7, 4),
        "llama-3.1-405b-tp8": (16384, 128, "nvfp4", "neox", False, False, 16, 1),
    }
    for e in edges:
        spec = qkv_spec(*e)
        out[spec.name] = spec
    for name, m in models.items():
        out[name] = qkv_spec(*m, name=f"qkvgrid-{name}")
    return out


_SPECS = grid_specs()
_HIDDENS_ALL = sorted({s.hidden_size for s in _SPECS.values()})


# ----------------------------------------------------------------- CPU
def test_selection_is_pairwise_and_small():
    rows = covering_rows()
    for i, j in itertools.combinations(range(len(FACTORS)), 2):
        pairs = {(r[i], r[j]) for r in rows}
        assert pairs == set(itertools.product(FACTORS[i], FACTORS[j])), (i, j)
    assert len(_SPECS) <= 60
    assert {s.num_q_heads // s.num_kv_heads for s in _SPECS.values()} >= set(GRID_GQA)
    assert any(s.q_heads_per_rank * s.head_dim != s.hidden_size for s in _SPECS.values())


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_hidden_size_fits_shared_memory(head_dim, fmt):
    """Every multiple of 64 in 512..16384: the heuristic's launch has a shared-
    memory plan within the CTA opt-in limit, whole rows wherever they fit
    (chunks only where they do not), chunks of whole warp rounds covering K."""
    first_chunked = None
    for hidden in range(qc.HIDDEN_RANGE[0], qc.HIDDEN_RANGE[1] + 1, qc.K_STEP):
        cfg = qc.QKVConfig.from_heuristic(hidden, head_dim, fmt)
        sm = qc.QKVSmem.plan(hidden, head_dim, cfg.rows, cfg.warps)
        assert sm.total_bytes <= qc.SMEM_PER_CTA_MAX
        whole = qc.QKVSmem(hidden, head_dim, cfg.rows, cfg.warps, hidden // 64) if sm.chunks == 1 else None
        if sm.chunks == 1:
            assert whole == sm
        else:
            first_chunked = first_chunked or hidden
            with pytest.raises(ValueError, match=r"exceed the 232448 a CTA may opt into"):
                qc.QKVSmem(hidden, head_dim, cfg.rows, cfg.warps, hidden // 64)
            assert sm.chunk_steps % cfg.warps == 0 and sm.chunks == 2
        assert sum(sm.chunk_row_bytes) == 2 * hidden and all(b % 16 == 0 for b in sm.chunk_row_bytes)
        assert sm.xs_stride == max(sm.chunk_row_bytes) + qc.XS_PAD
    assert 13000 < first_chunked <= 14144, first_chunked     # the common sizes keep whole rows


def test_shared_memory_layout_matches_the_compiled_offsets():
    """The allocation order of the template: flint's PTX addresses red at 0,
    head_rows at 9216, xs at 11264 and the mbarriers at 44160."""
    sm = qc.QKVSmem.plan(2048, 128, 32, 8)
    assert sm.offsets == {"red": 0, "head_rows": 9216, "xs": 11264, "mbar": 44160}
    assert sm.total_bytes == 44176 and sm.chunks == 1 and sm.xs_stride == 4112
    # the grid's edges (grid_specs): where the chunked staging starts
    assert [qc.QKVSmem.plan(h, d, r, 8).chunks for h, d, r in
            ((13760, 128, 32), (13824, 128, 32), (14080, 64, 16), (14144, 64, 16), (16320, 256, 32))] == [1, 2, 1, 2, 2]
    big = qc.QKVSmem.plan(16384, 128, 32, 8)
    assert (big.chunks, big.chunk_steps, big.offsets["mbar"]) == (2, 128, 142464)
    with pytest.raises(ValueError, match=r"chunk_steps = 100 must be the whole row \(256 steps\) or a multiple "
                                         r"of warps = 8"):
        qc.QKVSmem(16384, 128, 32, 8, 100)


@pytest.mark.parametrize("hidden, match", [
    (448, r"kernel qkv supports hidden_size 512..16384, got 448 .*use a hidden_size in that range"),
    (16448, r"kernel qkv supports hidden_size 512..16384, got 16448"),
    (2064, r"hidden_size = 2064 is not supported by the fused QKV GEMV: it must be a multiple of 64 .* in "
           r"512..16384; pad the hidden size to a multiple of 64"),
    (32768, r"kernel qkv supports hidden_size 512..16384, got 32768"),
])
def test_qkv_refuses_other_hidden_sizes(hidden, match):
    spec = FLINT.replace(hidden_size=hidden)
    with pytest.raises(ValueError, match=match):
        KDEF.variants(spec, T132)
    with pytest.raises(ValueError, match=match):
        KDEF.bind(spec, T132, lambda v: None)


def test_config_refuses_other_hidden_sizes():
    for hidden, match in ((2080, r"hidden_size = 2080 .*multiple of 64"), (256, r"hidden_size = 256 .*512..16384"),
                          (20480, r"hidden_size = 20480 .*512..16384")):
        with pytest.raises(ValueError, match=match):
            qc.QKVConfig.from_heuristic(hidden, 128, "nvfp4")


def test_spec_refuses_hidden_beyond_every_kernel():
    with pytest.raises(ValueError, match=r"'hidden_size' = 40000 is not supported: flintgen's kernels support "
                                         r"64..32768 .*qkv 512..16384"):
        FLINT.replace(hidden_size=40000)


# ----------------------------------------------------------------- compile (CI)
def _norm_specs():
    return {f"rms_norm-h{h}": FLINT.replace(name=f"qkvgrid-norm-h{h}", hidden_size=h) for h in _HIDDENS_ALL}


_NORM_SPECS = _norm_specs()


def _cluster_variant(spec):
    """The cluster design's 8-token binary (production unless the tile streams: bf16 from hidden 3584)."""
    return KDEF.variant(spec, config=cluster_config(spec), target=T132)


def _todo():
    todo = {}
    for spec in _SPECS.values():
        for v in {_cluster_variant(spec), KDEF.variants(spec, T132)[0]}:   # and production, where it streams
            todo[v.name] = (spec, "qkv", v)
    for spec in _NORM_SPECS.values():
        for v in NORM.variants(spec, T132):
            todo[v.name] = (spec, "rms_norm", v)
    return todo


@pytest.fixture(scope="module")
def built_grid():
    """Compile the grid in parallel (one process per CPU core) into the
    default cache root; {variant name: entry dir, or the build's exception (a
    spill is refused: KernelResourceError)}."""
    from flintgen.cli import _build_one
    from flintgen.procutil import run_spawned

    todo = _todo()
    done = run_spawned(_build_one, [(spec, kernel, v, T132, cache.default_root())
                                    for spec, kernel, v in todo.values()], return_exceptions=True)
    # an exception is reported by the variant's test
    return {name: r if isinstance(r, BaseException) else r[4] for name, r in zip(todo, done)}


def _compiled(built, kdef, spec, v):
    """(resources, PTX) of a grid build: decode_attention_cases.check_compiled's
    checks (no spills, stack or local memory, sm_90a, the kernel's PTX)."""
    from decode_attention_cases import check_compiled

    built = built[v.name]
    if isinstance(built, Exception):
        raise built
    assert cache.make_entry(v, kdef.template_of(v), dict(kdef.render_params(spec, v)), T132).dir == built
    return check_compiled(kdef, spec, v, T132)


@pytest.mark.compile
@pytest.mark.parametrize("key", sorted(_SPECS))
def test_qkv_grid_compiles_clean(built_grid, key):
    spec = _SPECS[key]
    production = KDEF.variants(spec, T132)[0]
    if KDEF.template_of(production) != KDEF.template:   # the streaming 8-token tile: spill-free, its own PTX
        _compiled(built_grid, KDEF, spec, production)
    v = _cluster_variant(spec)
    _, ptx = _compiled(built_grid, KDEF, spec, v)
    p = KDEF.render_params(spec, v)
    # one multicast per xn chunk; a cluster barrier before each chunk after the first
    assert ptx.count("cp.async.bulk.shared::cluster.global") == p["xn_chunks"], p["xn_chunks"]
    assert ptx.count("barrier.cluster.arrive") == p["xn_chunks"]
    assert ptx.count("mbarrier.try_wait.parity") == p["xn_chunks"] + 1      # + rank 0's rows
    sm = qc.QKVSmem.plan(spec.hidden_size, spec.head_dim, p["rows"], p["warps"])
    assert (sm.chunks, sm.xs_stride) == (p["xn_chunks"], p["xs_stride"])
    # The kernel addresses its buffers at QKVSmem's offsets (the DSL allocates in its order).
    for name, off in sm.offsets.items():
        assert off == 0 or re.search(rf"[+ ]{off}[;\]]", ptx), f"{name} not at offset {off}"
    check_design_ptx(ptx, spec)


@pytest.mark.compile
@pytest.mark.parametrize("key", sorted(_NORM_SPECS))
def test_rms_norm_grid_compiles_clean(built_grid, key):
    spec = _NORM_SPECS[key]
    for v in NORM.variants(spec, T132):
        _compiled(built_grid, NORM, spec, v)
