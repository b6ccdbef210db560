"""The fused QKV step's token tiles (M up to 64 tokens): one GEMV binary per
tile of 8 / 16 / 32 / 64 tokens up to spec.max_tokens.

* CPU: spec and CLI limits (max_tokens 1..64), the token tiles and the
  variants per max_tokens (8 alone up to 8 tokens: the same binary as
  before), the op's refusal of M above max_tokens, its choice of binary by
  M at call time and in warmup, the launch configuration per tile
  (QKVConfig: chains, prefetch, early dequantization, early token inputs)
  and a shared-memory plan within a CTA for every hidden size, head dim and
  tile.
* ``compile`` (sm_90a): the tiles 16 / 32 / 64 of a handful of shapes (and, run once by
  hand, of tests/test_qkv_grid.py's 58 specs: 174 binaries, spill-free, 40..246 registers)
  compile spill-free with the design's PTX (the MMAs of every n-tile, one
  multicast per token row and xn chunk, the buffers at QKVSmem's offsets).

GPU numerics of the tiles (M in 1, 7, 8, 9, 16, 33, 63, 64, slot_mapping
shorter than M): tests/test_qkv.py (TILE_CASES); CUDA-graph capture per tile:
test_graph_replay_per_token_tile below.
"""

from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner
from test_qkv import SPECS, _cpu_args, check_design_ptx
from test_qkv_grid import _SPECS as GRID

from flintgen.cli import main
from flintgen.configs import qkv_config as qc
from flintgen.kernels.base import Target
from flintgen.kernels.qkv import QKVDef
from flintgen.presets import FLINT
from flintgen.spec import MAX_TOKENS_LIMIT

KDEF = QKVDef()
T132 = Target("sm_90a", 132)
F64 = FLINT.replace(max_tokens=64)


# ----------------------------------------------------------------- spec / CLI
def test_max_tokens_1_to_64():
    assert MAX_TOKENS_LIMIT == 64 == qc.TOKEN_TILES[-1]
    assert FLINT.max_tokens == 8                        # the preset's default stays
    for n in (1, 8, 9, 33, 64):
        KDEF.check_limits(FLINT.replace(max_tokens=n))
    spec = FLINT.replace(max_tokens=65)                 # the spec admits rms_norm's 1..256 ...
    with pytest.raises(ValueError, match=r"kernel qkv supports max_tokens 1\.\.64, got 65 \(spec 'flint'\): use "
                                         r"a max_tokens in that range"):
        KDEF.variants(spec, T132)                       # ... the QKV step refuses it, naming itself
    with pytest.raises(ValueError, match=r"kernel qkv supports max_tokens 1\.\.64, got 65"):
        KDEF.bind(spec, T132, lambda v: None)
    with pytest.raises(ValueError, match=r"'max_tokens' = 0 .*>= 1"):
        FLINT.replace(max_tokens=0)
    with pytest.raises(ValueError, match=r"'max_tokens' = 300 .*\(rms_norm 1\.\.256, qkv 1\.\.64\)"):
        FLINT.replace(max_tokens=300)


def test_cli_max_tokens():
    r = CliRunner().invoke(main, ["list", "--preset", "flint", "--max-tokens", "40"])
    assert r.exit_code == 0, r.output
    qkv = [line.strip() for line in r.output.splitlines() if line.strip().startswith("qkv-")]
    assert [v.name for v in KDEF.variants(FLINT.replace(max_tokens=40), T132)] == qkv and len(qkv) == 4
    r = CliRunner().invoke(main, ["list", "--preset", "flint"])
    assert sum(line.strip().startswith("qkv-") for line in r.output.splitlines()) == 1
    r = CliRunner().invoke(main, ["list", "--preset", "flint", "--max-tokens", "65"])
    assert r.exit_code != 0 and "kernel qkv supports max_tokens 1..64, got 65" in r.output + r.stderr
    r = CliRunner().invoke(main, ["show-spec", "--preset", "flint", "--max-tokens", "16"])
    assert r.exit_code == 0 and '"max_tokens": 16' in r.output


# ----------------------------------------------------------------- tiles and variants
def test_token_tiles():
    assert [qc.token_tile(m) for m in (1, 8, 9, 16, 17, 32, 33, 63, 64)] == [8, 8, 16, 16, 32, 32, 64, 64, 64]
    with pytest.raises(ValueError, match=r"M = 65 tokens exceeds the largest token tile .*\(64\)"):
        qc.token_tile(65)
    assert [qc.token_tiles(n) for n in (1, 8, 9, 16, 17, 33, 64)] == [
        (8,), (8,), (8, 16), (8, 16), (8, 16, 32), (8, 16, 32, 64), (8, 16, 32, 64)]


@pytest.mark.parametrize("max_tokens, tiles", [(1, [8]), (8, [8]), (9, [8, 16]), (16, [8, 16]), (32, [8, 16, 32]),
                                               (33, [8, 16, 32, 64]), (64, [8, 16, 32, 64])])
def test_variants_per_max_tokens(max_tokens, tiles):
    spec = FLINT.replace(max_tokens=max_tokens)
    vs = KDEF.variants(spec, T132)
    assert [dict(v.params).get("max_m", 8) for v in vs] == tiles
    # the 8-token binary is the one every spec had before: same name, same rendered constants
    assert vs[0] == KDEF.variant(FLINT) and "max_m" not in vs[0].name
    assert KDEF.render_params(spec, vs[0]) == KDEF.render_params(FLINT, KDEF.variant(FLINT))
    assert vs[0].name == ("qkv-bias0-cluster4-debug0-early_dequant2-head_dim128-hidden2048-interleaved0-kv_heads4-"
                          "norm_offset0-prefetch4-q_heads32-qk_norm1-rope1-rope_dim128-rows32-warps8-weight_formatnvfp4")
    for v, t in zip(vs[1:], tiles[1:]):
        assert f"-max_m{t}-" in v.name
        assert KDEF.render_params(spec, v)["max_m"] == t


def test_config_per_tile():
    C = qc.QKVConfig
    # flint NVFP4: prefetch 4 / 4 / 2 / 1, early dequantization at 8 tokens only
    assert [C.from_heuristic(2048, 128, "nvfp4", t) for t in qc.TOKEN_TILES] == [
        C(32, 4, 8, 4, 2), C(32, 4, 8, 4), C(32, 4, 8, 2), C(32, 4, 8, 1)]
    assert [C.from_heuristic(4096, 128, "bf16", t).prefetch for t in qc.TOKEN_TILES] == [2, 1, 1, 1]
    assert [C.from_heuristic(2880, 64, "bf16", t).prefetch for t in qc.TOKEN_TILES] == [4, 3, 2, 1]
    assert [C.from_heuristic(2880, 64, "nvfp4", t).prefetch for t in qc.TOKEN_TILES] == [6, 6, 5, 1]
    assert C.from_heuristic(2048, 128, "nvfp4") == C.from_heuristic(2048, 128, "nvfp4", 8)
    # chains: 2 at 8 tokens (more than one step per warp), else 1; accumulators per thread
    assert [C.chains(t, 4) for t in qc.TOKEN_TILES] == [2, 1, 1, 1] and C.chains(8, 1) == 1
    assert [C.acc_regs(2, t, 4) for t in qc.TOKEN_TILES] == [16, 16, 32, 64]
    assert [C.tile_regs(2, t, 4) for t in qc.TOKEN_TILES] == [24, 32, 64, 128]
    assert [C.weight_reg_budget(2, t, 4) for t in qc.TOKEN_TILES] == [64, 56, 24, -40]
    # ptxas launch bound: none at 8 tokens and where two CTAs fit by shared memory, else 1
    assert [C.min_ctas_per_sm(t, 100_000) for t in qc.TOKEN_TILES] == [0, 0, 0, 0]
    assert [C.min_ctas_per_sm(t, 120_000) for t in qc.TOKEN_TILES] == [0, 1, 1, 1]
    assert [C.early_tokens(t) for t in qc.TOKEN_TILES] == [True, False, False, False]
    # L2 prefetch: BF16 weights of at most L2_PREFETCH_MAX_WEIGHT_BYTES at the 8-token tile only
    rows = lambda q, kv, d=128: (q + 2 * kv) * d   # noqa: E731
    assert C.from_heuristic(2048, 128, "bf16", 8, out_features=rows(32, 4)).l2_prefetch            # flint-bf16, 21 MB
    assert C.from_heuristic(1024, 128, "bf16", 8, out_features=rows(16, 8)).l2_prefetch            # qwen3-0.6b, 8 MB
    assert not C.from_heuristic(3072, 128, "bf16", 8, out_features=rows(24, 8)).l2_prefetch        # 31.5 MB
    assert not C.from_heuristic(2048, 128, "bf16", 16, out_features=rows(32, 4)).l2_prefetch       # 16 tokens
    assert not C.from_heuristic(2048, 128, "nvfp4", 8, out_features=rows(32, 4)).l2_prefetch       # NVFP4
    assert not C.from_heuristic(2048, 128, "bf16", 8).l2_prefetch                                 # rows unknown
    edge = qc.L2_PREFETCH_MAX_WEIGHT_BYTES // (2 * 2048)
    assert C.from_heuristic(2048, 128, "bf16", 8, out_features=edge).l2_prefetch
    assert not C.from_heuristic(2048, 128, "bf16", 8, out_features=edge + 128).l2_prefetch
    with pytest.raises(ValueError, match=r"max_m = 12 is not a token tile: use one of \[8, 16, 32, 64\]"):
        C.from_heuristic(2048, 128, "nvfp4", 12)


@pytest.mark.parametrize("head_dim", qc.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("max_m", qc.TOKEN_TILES)
def test_every_shape_and_tile_fits_shared_memory(head_dim, max_m):
    """Every hidden size in range, both weight formats: the tile's launch has a
    shared-memory plan within the CTA opt-in limit (red and head_rows of
    max_m tokens, xn in as few K-chunks as fit), whole rows wherever they fit."""
    chunked = []
    for fmt in ("bf16", "nvfp4"):
        for hidden in range(qc.HIDDEN_RANGE[0], qc.HIDDEN_RANGE[1] + 1, qc.K_STEP):
            cfg = qc.QKVConfig.from_heuristic(hidden, head_dim, fmt, max_m)
            sm = qc.QKVSmem.plan(hidden, head_dim, cfg.rows, cfg.warps, max_m)
            assert sm.max_m == max_m and sm.total_bytes <= qc.SMEM_PER_CTA_MAX
            assert sm.red_bytes == cfg.warps * max_m * (cfg.rows + qc.RED_PAD) * 4
            assert sm.head_rows_bytes == max_m * head_dim * 2 and sm.xs_bytes == max_m * sm.xs_stride
            assert sum(sm.chunk_row_bytes) == 2 * hidden and all(b % 16 == 0 for b in sm.chunk_row_bytes)
            if sm.chunks > 1:
                chunked.append(hidden)
                assert sm.chunk_steps % cfg.warps == 0
                with pytest.raises(ValueError, match=r"exceed the 232448 a CTA may opt into"):
                    qc.QKVSmem(hidden, head_dim, cfg.rows, cfg.warps, hidden // 64, max_m)
                # fewest chunks: one fewer would not fit
                fewer = sm.chunks - 1
                cs = -(-(-(-sm.steps // fewer)) // cfg.warps) * cfg.warps
                if fewer > 1 and cs < sm.steps:
                    with pytest.raises(ValueError, match="exceed"):
                        qc.QKVSmem(hidden, head_dim, cfg.rows, cfg.warps, cs, max_m)
    # where chunking starts (QKVSmem's docstring): about 13k / 6.5k / 3k / 1-1.5k at 8 / 16 / 32 / 64 tokens
    lo, hi = {8: (13000, 14144), 16: (6400, 6912), 32: (2800, 3264), 64: (1024, 1472)}[max_m]
    assert lo <= min(chunked) <= hi, min(chunked)


def test_smem_refuses_other_tiles():
    with pytest.raises(ValueError, match=r"QKVSmem.max_m = 24 is not a token tile"):
        qc.QKVSmem(2048, 128, 32, 8, 32, 24)
    assert qc.QKVSmem.plan(2048, 128, 32, 8) == qc.QKVSmem.plan(2048, 128, 32, 8, 8)
    big = qc.QKVSmem.plan(2048, 128, 32, 8, 64)
    assert (big.chunks, big.chunk_steps, big.total_bytes) == (2, 16, 222224)


# ----------------------------------------------------------------- the op (CPU)
def _recording_op(spec):
    """The op with validation and the RMSNorm stubbed out: every GEMV launch
    records (variant, M) instead of running."""
    calls = []

    def load(v):
        return lambda *args: calls.append((v, args[0].shape[0]))

    class Norm:
        def __call__(self, x, w, eps, residual=None, out=None, residual_out=None):
            return out, x if residual is None else residual

    op = KDEF.bind(spec, T132, load)
    op._validate = lambda x, *a, **k: x.shape[0]
    op.norm_op = lambda: Norm()
    return op, calls


def test_op_refuses_m_above_max_tokens():
    from flintgen.kernels.qkv import QKVOp

    def load(v):
        raise AssertionError("validation must fail before loading")

    op = KDEF.bind(F64, T132, load)
    assert isinstance(op, QKVOp)
    with pytest.raises(ValueError, match=r"M = 65 tokens exceeds spec.max_tokens = 64 of the fused QKV step \(spec "
                                         r"'flint'; its binaries serve M <= 64\): build the spec with a larger "
                                         r"max_tokens \(up to 64.*--max-tokens N\), split the batch into chunks of "
                                         r"<= 64 tokens, or use an unfused path") as e:
        op(**_cpu_args(F64, m=65))
    assert "at most 8" not in str(e.value)
    op16 = KDEF.bind(FLINT.replace(max_tokens=16), T132, load)
    with pytest.raises(ValueError, match=r"M = 17 tokens exceeds spec.max_tokens = 16"):
        op16(**_cpu_args(FLINT.replace(max_tokens=16), m=17))
    with pytest.raises(ValueError, match="x must be on a CUDA device"):   # M = 16 passes the limit
        op16(**_cpu_args(FLINT.replace(max_tokens=16), m=16))


def test_op_picks_the_binary_of_m_tile():
    op, calls = _recording_op(F64)
    assert [dict(v.params).get("max_m", 8) for v in op.variants()] == [8, 16, 32, 64]
    for m in (1, 7, 8, 9, 16, 17, 33, 63, 64):
        op(**_cpu_args(F64, m=m))
    assert [(dict(v.params).get("max_m", 8), m) for v, m in calls] == [
        (8, 1), (8, 7), (8, 8), (16, 9), (16, 16), (32, 17), (64, 33), (64, 63), (64, 64)]
    assert not any(v["debug"] for v, _ in calls)
    calls.clear()
    a = _cpu_args(F64, m=20)
    op(**a, pre_norm_out=torch.zeros(20, F64.qkv_out_features, dtype=torch.bfloat16))
    ((v, m),) = calls
    assert (v["debug"], v["max_m"], m) == (True, 32, 20)


def test_warmup_runs_every_tile():
    op, calls = _recording_op(F64)
    op.warmup("cpu")
    assert [(dict(v.params).get("max_m", 8), m) for v, m in calls] == [(8, 1), (8, 1), (16, 16), (32, 32), (64, 64)]
    op8, calls8 = _recording_op(FLINT)
    op8.warmup("cpu")
    assert [m for _, m in calls8] == [1, 1] and len({v for v, _ in calls8}) == 1


# ----------------------------------------------------------------- compiled tiles
TILE_SPECS = {
    "flint": F64,                                                  # NVFP4, d128, hidden 2048
    "flint_bf16": SPECS["flint_bf16"].replace(max_tokens=64),
    "bf16_4096": SPECS["bf16_4096"].replace(max_tokens=64),        # hidden 4096, 32 / 8 heads
    "d256": SPECS["d256"].replace(max_tokens=64),                  # 8-CTA clusters
    "oss_bf16": SPECS["oss_bf16"].replace(max_tokens=64),          # d64: 16-row CTAs, bias, a K tail
    "h16384": SPECS["h16384"].replace(max_tokens=64),              # hidden 16384: many xn chunks
    "flint_fp8": SPECS["flint_fp8"].replace(max_tokens=64),        # e4m3 cache
    # ptxas squeezed these into 128 registers and spilled at 32 tokens before the launch bound
    # (QKVConfig.min_ctas_per_sm)
    "gemma3_4b": SPECS["gemma3_4b"].replace(max_tokens=64),
    "llama405_tp8": GRID["llama-3.1-405b-tp8"].replace(max_tokens=64),
    # the most registers of the grid's 174 tile binaries (tests/test_qkv_grid.py's specs at 16 / 32 / 64
    # tokens, all spill-free: 214 / 204 / 246 registers)
    "h16320_d256_bf16": GRID["qkvgrid-h16320-d256-bf16-neox-b1-n1-g2-kv1"].replace(max_tokens=64),
    "h2048_bf16_interleaved_half": GRID["qkvgrid-h2048-d128-bf16-interleaved-half-b0-n1-g8-kv1"].replace(max_tokens=64),
}
COMPILE_TILES = [(n, t) for n in TILE_SPECS for t in qc.TOKEN_TILES[1:]]


@pytest.mark.compile
@pytest.mark.parametrize("name, max_m", COMPILE_TILES, ids=[f"{n}-M{t}" for n, t in COMPILE_TILES])
def test_tile_compiles_clean(name, max_m):
    from decode_attention_cases import check_compiled

    from flintgen.runtime import load_variant

    spec = TILE_SPECS[name]
    if spec.weight_format == "bf16":
        # production runs the streaming design here (tests/test_qkv_stream.py); the cluster design
        # stays selectable (QKVOp(config=QKVConfig ...)) and is checked as before
        v = KDEF.variant(spec, max_m=max_m, config=qc.QKVConfig.from_heuristic(
            spec.hidden_size, spec.head_dim, spec.weight_format, max_m))
    else:
        v = KDEF.variant(spec, max_m=max_m)
        assert v in KDEF.variants(spec, T132)
    load_variant(KDEF, spec, v, T132)
    res, ptx = check_compiled(KDEF, spec, v, T132)     # no spills, stack or local memory
    check_design_ptx(ptx, spec)
    p = KDEF.render_params(spec, v)
    sm = qc.QKVSmem.plan(spec.hidden_size, spec.head_dim, p["rows"], p["warps"], max_m)
    # one CTA per SM by shared memory: ptxas is told so (.minnctapersm 1), else no bound; where shared
    # memory admits two CTAs per SM, the registers do too
    two = qc.SMEM_PER_SM // (sm.total_bytes + qc.CTA_SMEM_RESERVED) >= 2
    assert p["min_ctas"] == (0 if two else 1) and (".minnctapersm 1" in ptx) == (not two)
    if two:
        assert res["registers"] <= 128, res
    # 4 MMAs per step, 16-row tile and 8-token n-tile, every step unrolled
    per_warp = -(-(spec.hidden_size // 64) // p["warps"])
    assert ptx.count("mma.sync.aligned.m16n8k16") == per_warp * (p["rows"] // 16) * (max_m // 8) * 4
    # xn: one multicast per token row of a warp and chunk; a cluster barrier per chunk
    token_iters = -(-max_m // p["warps"])
    assert ptx.count("cp.async.bulk.shared::cluster.global") == sm.chunks * token_iters
    assert ptx.count("barrier.cluster.arrive") == sm.chunks
    assert ptx.count("mbarrier.try_wait.parity") == sm.chunks + 1
    assert ptx.count("st.async.shared::cluster") == 1      # one (token, 8 rows) piece per thread
    for buf, off in sm.offsets.items():
        assert off == 0 or re.search(rf"[+ ]{off}[;\]]", ptx), f"{buf} not at offset {off}"


@pytest.mark.compile
def test_tile_debug_and_other_configs_compile_clean():
    """The 64-token debug binary (pre-norm rows of 64 tokens), and a 4-warp
    CTA of 32 rows, whose 64 x 4 (token, 8-row) pieces take two per thread."""
    from decode_attention_cases import check_compiled

    from flintgen.runtime import load_variant

    for v, send_iters in ((KDEF.variant(F64, debug=True, max_m=64), 1),
                          (KDEF.variant(F64, max_m=64, config=qc.QKVConfig(32, 4, 4, 1)), 2)):
        load_variant(KDEF, F64, v, T132)
        _, ptx = check_compiled(KDEF, F64, v, T132)
        check_design_ptx(ptx, F64)
        assert ptx.count("st.async.shared::cluster") == send_iters
        assert ptx.count("st.global.v4.u32") == v["debug"] * send_iters   # the pre-norm rows


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flint", "bf16_4096", "flint_bf16"])   # flint_bf16 M <= 8: L2 prefetch
def test_graph_replay_per_token_tile(name):
    """After warmup, a CUDA graph captured at any M replays that M's binary
    (launch shape a function of its tile alone) and matches an eager call."""
    import flintgen
    from test_qkv import Case

    spec = TILE_SPECS[name]
    flintgen.warmup(spec, ["qkv"])
    op = flintgen.get_kernel(spec, "qkv")
    for m in (1, 9, 33, 64):
        c = Case(spec, m, seed=70 + m, n_slots=m - 1 if m > 1 else 1)
        q_eager, _ = c.run(op, debug=False)
        k_eager, v_eager = c.k_cache.clone(), c.v_cache.clone()
        q_out = torch.full_like(q_eager, float("nan"))
        xn = torch.empty_like(c.x)
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        a = list(c.args())
        c.poison()
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            op(*a, q_out=q_out, xn_out=xn)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(q_out, q_eager), f"M={m}"
        assert torch.equal(c.k_cache.nan_to_num(7.0), k_eager.nan_to_num(7.0)), f"M={m}"
        assert torch.equal(c.v_cache.nan_to_num(7.0), v_eager.nan_to_num(7.0)), f"M={m}"
