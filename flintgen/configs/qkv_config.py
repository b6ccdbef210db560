"""Launch configuration of the fused QKV GEMV (cute-free).

Geometry: one cluster per head (q, k or v), ``cluster = head_dim / rows``
CTAs of ``rows`` weight rows each; inside a CTA ``warps`` warps split K in
64-value steps (step ``s`` goes to warp ``s % warps``) and each warp keeps the
weights of ``prefetch`` steps in flight in registers, the first batch issued
before ``griddepcontrol.wait`` so it streams while the RMSNorm kernel runs.

Token tiles (``TOKEN_TILES``): a binary serves M tokens up to its tile
``max_m`` (8, 16, 32 or 64; the tile of M is ``token_tile(M)``): the MMA's N
is 8 tokens, so a thread keeps ``max_m / 8`` n-tiles of accumulators per
16-row weight tile.

Shared memory (``QKVSmem``): xn's ``max_m`` token rows, staged whole or, where
the whole rows do not fit a CTA (M <= 8: hidden above about 13k; larger tiles
much earlier), in K-chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from flintgen.layout import CTA_SMEM_RESERVED, K_STEP, MAX_CLUSTER, MMA_N, SMEM_PER_CTA_MAX, SMEM_PER_SM

SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)   # head dims the fused QKV step compiles and tests
PREFETCH_REG_BUDGET = 64  # registers per thread holding in-flight weights (8-token tile; QKVConfig.weight_reg_budget)
ACT_REGS_PER_NTILE = 8    # activation (B) registers of one step and 8-token n-tile: 16 bf16 values
# Registers per thread the prefetched weights may take once some of them are
# dequantized before the grid wait: flint's 32-row CTAs use 88 (+ 38 others =
# 126), so two 256-thread CTAs still fit an SM (160 CTAs, one wave).
EARLY_DEQUANT_REG_BUDGET = 88
# BF16 weights (per rank) of at most this many bytes are prefetched into L2
# before the grid wait at the 8-token tile (``from_heuristic``): about half of
# Hopper's 50 MB L2, between the largest set measured to gain (21 MB) and the
# smallest measured to lose (31.5 MB).
L2_PREFETCH_MAX_WEIGHT_BYTES = 24 << 20
# Hidden sizes of the fused QKV step (the GEMV's and the RMSNorm's): multiples
# of K_STEP in this range, compiled spill-free (tests/test_qkv_grid.py).
HIDDEN_RANGE = (512, 16384)
TOKEN_TILES = (8, 16, 32, 64)   # max_m of the GEMV binaries: M tokens run the binary of token_tile(M)
# TOKEN_TILES[-1] is spec.MAX_TOKENS_LIMIT (tests/test_qkv_tokens.py); not imported here: a kernel
# module importing flintgen.spec would hash the whole package into its cache key.


def token_tile(m: int) -> int:
    """The smallest token tile holding ``m`` tokens (the binary M runs)."""
    for tile in TOKEN_TILES:
        if m <= tile:
            return tile
    raise ValueError(f"M = {m} tokens exceeds the largest token tile of the fused QKV GEMV "
                     f"({TOKEN_TILES[-1]}): split the batch into chunks of <= {TOKEN_TILES[-1]} tokens")


def token_tiles(max_tokens: int) -> tuple[int, ...]:
    """The token tiles a spec of ``max_tokens`` needs: every tile up to ``token_tile(max_tokens)``
    (one binary each; 8 alone for max_tokens <= 8)."""
    last = token_tile(max_tokens)
    return tuple(t for t in TOKEN_TILES if t <= last)


def check_hidden(hidden: int) -> None:
    """ValueError unless ``hidden`` is a multiple of K_STEP in HIDDEN_RANGE."""
    lo, hi = HIDDEN_RANGE
    if hidden % K_STEP or not lo <= hidden <= hi:
        raise ValueError(f"hidden_size = {hidden} is not supported by the fused QKV GEMV: it must be a "
                         f"multiple of {K_STEP} (one 64-value step per quad) in {lo}..{hi}; pad the hidden "
                         f"size to a multiple of {K_STEP}, or run an unfused path (rms_norm + a GEMM) "
                         "outside that range")


@dataclass(frozen=True)
class QKVConfig:
    rows: int       # weight rows per CTA: 16 (one m16 tile) or 32 (two)
    cluster: int    # CTAs per head
    warps: int      # K split inside the CTA
    prefetch: int   # steps of weights a warp keeps in flight
    early_dequant: int = 0  # NVFP4: prefetched steps dequantized before the grid wait
    l2_prefetch: bool = False   # the CTA's weight rows past the prefetched steps into L2 before the grid wait
    evict_first: bool = False   # weights read with L2 evict-first priority (dead once read)

    def __post_init__(self) -> None:
        if self.rows not in (16, 32):
            raise ValueError(f"QKVConfig.rows = {self.rows} is not supported: use 16 or 32")
        if not 1 <= self.cluster <= MAX_CLUSTER:
            raise ValueError(f"QKVConfig.cluster = {self.cluster} is outside 1..{MAX_CLUSTER} "
                             "(the portable cluster limit): use more rows per CTA")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"QKVConfig.warps = {self.warps} must be a power of two <= 16")
        if self.prefetch < 1:
            raise ValueError(f"QKVConfig.prefetch = {self.prefetch} must be >= 1")
        if isinstance(self.early_dequant, bool) or not 0 <= self.early_dequant <= self.prefetch:
            raise ValueError(f"QKVConfig.early_dequant = {self.early_dequant!r} must be a step count "
                             f"0..prefetch ({self.prefetch})")
        if not isinstance(self.l2_prefetch, bool):
            raise TypeError(f"QKVConfig.l2_prefetch = {self.l2_prefetch!r} must be a bool")
        if not isinstance(self.evict_first, bool):
            raise TypeError(f"QKVConfig.evict_first = {self.evict_first!r} must be a bool")

    @property
    def tiles(self) -> int:
        return self.rows // 16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @staticmethod
    def chains(max_m: int, steps_per_warp: int) -> int:
        """Accumulator chains (even / odd steps, added at the end): 2 for the
        8-token tile with more than one step per warp, halving the dependent-HMMA
        chain of its TILES accumulators (measured, see from_heuristic); 1 for
        larger tiles, whose max_m / 8 n-tiles are independent accumulators
        already (unmeasured)."""
        return 2 if max_m == MMA_N and steps_per_warp > 1 else 1

    @staticmethod
    def min_ctas_per_sm(max_m: int, smem_bytes: int) -> int:
        """The launch bound rendered for ptxas (``.minnctapersm``; 0: none).
        Without one ptxas fits 256-thread CTAs into 128 registers where it
        nearly can, spilling a few bytes (32 tokens: NVFP4 Gemma-3-4b, 8
        bytes at 4 prefetch steps; hidden 16384 d128, 16 bytes at 2); with
        1 it takes what it needs (144 and 150 registers, no spill). 1 for
        tiles above 8 tokens whose shared memory admits one CTA per SM only
        (they never run two); 0 (none) for the 8-token tile (its binaries as
        measured) and where two CTAs fit."""
        if max_m == MMA_N:
            return 0
        return 1 if SMEM_PER_SM // (smem_bytes + CTA_SMEM_RESERVED) < 2 else 0

    @staticmethod
    def early_tokens(max_m: int) -> bool:
        """Whether the epilogue's per-token inputs (slot, cos / sin) are loaded
        right after the grid wait, landing during the GEMV (the 8-token tile,
        measured), or after the GEMV's main loop (larger tiles: a warp's
        max_m / warps tokens would hold 2 + 2 pair_e registers each through
        the main loop, 48 at max_m 64 with flint's RoPE; unmeasured)."""
        return max_m == MMA_N

    @classmethod
    def acc_regs(cls, tiles: int, max_m: int, steps_per_warp: int) -> int:
        """fp32 accumulator registers per thread: 4 per (chain, 16-row tile, 8-token n-tile)."""
        return cls.chains(max_m, steps_per_warp) * tiles * (max_m // MMA_N) * 4

    @staticmethod
    def regs_per_step(weight_format: str, tiles: int) -> int:
        """Registers one step of weights takes per thread: rows g, g+8 of each
        tile; NVFP4 = 2 words + 1 scale byte per row, bf16 = 8 words per row."""
        return tiles * (6 if weight_format == "nvfp4" else 16)

    @classmethod
    def early_steps(cls, prefetch: int, tiles: int) -> int:
        """NVFP4 steps to dequantize before the grid wait: as many as keep the
        weights within EARLY_DEQUANT_REG_BUDGET (a dequantized step holds bf16
        weights, a raw one NVFP4: ``regs_per_step`` of each)."""
        raw, deq = cls.regs_per_step("nvfp4", tiles), cls.regs_per_step("bf16", tiles)
        e = 0
        while e < prefetch and (prefetch - e - 1) * raw + (e + 1) * deq <= EARLY_DEQUANT_REG_BUDGET:
            e += 1
        return e

    @classmethod
    def from_heuristic(cls, hidden: int, head_dim: int, weight_format: str,
                       max_m: int = MMA_N, out_features: int = 0) -> "QKVConfig":
        """Measured on an H200 (benchmarks/results/qkv_correctness.md; GEMV
        kernel alone, CUDA-graph replay, weights rotating beyond L2):

        * rows 32 for head_dim >= 128 (4-CTA clusters at d = 128): flint
          NVFP4 4.68 / 5.65 us (M = 1 / 8) against 5.32 / 6.48 with 16 rows
          (8-CTA clusters); hidden 4096 32x8 bf16 15.40 / 16.15 us (77% / 73%
          of the weight-read floor) against 17.7 / 18.6. Half the CTAs, half
          the per-CTA fixed costs (xn multicast, reduction, cluster barriers).
          d = 64 keeps 16 rows (4-CTA clusters; 2-CTA clusters not measured).
        * warps 8: flint 5.91 / 10.61 us against 6.99 / 11.22 with 4 warps
          (run 1); bf16 4096 r32: 15.40 us against 25.17 with 4 warps.
        * prefetch: as many steps as fit in PREFETCH_REG_BUDGET registers
          (NVFP4 6 per tile and step, bf16 16): flint 4 (all of a warp's
          steps, issued before the grid-dependency wait); bf16 4096 r32 -> 2
          (p3: 18.8 us, 144 registers).
        * early_dequant (benchmarks/results/qkv_sweep.md, 2026-11-29 session
          3): after the grid wait a 32-row CTA's NVFP4 dequantization is
          issue-bound (~550 instructions per thread, two CTAs on 28 SMs); the
          ablation puts the MMA stage at 1.6 us of flint's 4.75 us GEMV.
          Dequantizing 2 of the 4 prefetched steps before the wait (126
          registers, still 2 CTAs per SM), with the rows sent to rank 0 by
          st.async: step 4.41-4.52 / 5.01-5.12 us (M = 1 / 8, three runs)
          against 5.57-5.71 / 6.39-6.50 before; in one sweep run, 0 / 1 / 3
          early steps 5.36 / 4.77 / 6.88 (M = 1) and 6.04 / 5.38 / 7.57
          (M = 8) against 2's 4.41 / 5.05: 3 steps take 142 registers, one
          CTA per SM, and the grid runs in two waves. With 16-row CTAs (320
          per grid) early dequantization was slower (6.19 vs 5.36 us GEMV: 95
          registers, two waves), so rows 16 keeps 0.
        * token tiles above 8 (``max_m`` 16 / 32 / 64; unmeasured, compiled
          spill-free for sm_90a in tests/test_qkv_tokens.py): rows, cluster and
          warps as for 8 tokens; one accumulator chain (``chains``); prefetch
          within ``weight_reg_budget`` (the budget less the accumulator and
          activation registers beyond the 8-token tile's: flint NVFP4 4 / 2 / 1
          steps, bf16 1 / 1 / 1 at max_m 16 / 32 / 64); no early dequantization (its
          budget is the 8-token tile's two CTAs per SM, which max_m >= 32
          gives up to shared memory anyway); the epilogue's token inputs
          after the main loop (``early_tokens``); a ptxas launch bound of one
          CTA per SM where shared memory admits no more (``min_ctas_per_sm``).
        * l2_prefetch (``out_features``: the weight's rows, 0 = unknown: off):
          BF16 at the 8-token tile with at most L2_PREFETCH_MAX_WEIGHT_BYTES
          of weights (benchmarks/results/qkv_stream_launch.md, run 5, H100,
          M = 1 / 8, step then GEMV, us): flint-bf16 (21 MB) 10.04 -> 9.45
          / 10.28 -> 9.74 and 9.12 -> 8.76 / 9.42 -> 9.10 (H200, run 3: step
          8.00 -> 7.54); qwen3-0.6b (8 MB) level within 0.03; llama-3.2-3b
          (31.5 MB) slower: step +0.31 / +0.07, GEMV +0.56 / +0.39 (the
          prefetched lines are evicted before they are read). NVFP4 keeps it
          off (unmeasured).
        """
        check_hidden(hidden)
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise NotImplementedError(
                f"qkv: head_dim = {head_dim} is not supported by the fused QKV step (supported: "
                f"{list(SUPPORTED_HEAD_DIMS)}): use one of those head dims, or build decode attention "
                "alone (flintgen build --kernel decode_attention, get_kernel(spec, 'decode_attention')).")
        rows = 16 if head_dim <= 64 else 32
        cluster = head_dim // rows     # any size 1..8: d96 runs 3-CTA clusters (multicast mask 0b111)
        if cluster > MAX_CLUSTER:
            raise ValueError(f"head_dim = {head_dim} needs {cluster} CTAs of {rows} rows per head, "
                             f"over the portable cluster limit of {MAX_CLUSTER}")
        if max_m not in TOKEN_TILES:
            raise ValueError(f"qkv: max_m = {max_m} is not a token tile: use one of {list(TOKEN_TILES)} "
                             "(token_tile(M))")
        warps = 8
        tiles = rows // 16
        per_warp = -(-(hidden // K_STEP) // warps)
        budget = cls.weight_reg_budget(tiles, max_m, per_warp)
        prefetch = max(1, min(per_warp, budget // cls.regs_per_step(weight_format, tiles)))
        early = (cls.early_steps(prefetch, tiles)
                 if weight_format == "nvfp4" and rows == 32 and max_m == MMA_N else 0)
        l2 = (weight_format == "bf16" and max_m == MMA_N
              and 0 < out_features * hidden * 2 <= L2_PREFETCH_MAX_WEIGHT_BYTES)
        return cls(rows=rows, cluster=cluster, warps=warps, prefetch=prefetch, early_dequant=early, l2_prefetch=l2)

    @classmethod
    def tile_regs(cls, tiles: int, max_m: int, steps_per_warp: int) -> int:
        """Registers a token tile holds per thread besides the weights: its
        accumulators and one step's activation (B) fragments of each n-tile."""
        return cls.acc_regs(tiles, max_m, steps_per_warp) + ACT_REGS_PER_NTILE * (max_m // MMA_N)

    @classmethod
    def weight_reg_budget(cls, tiles: int, max_m: int, steps_per_warp: int) -> int:
        """Registers per thread for in-flight weights: PREFETCH_REG_BUDGET for
        the 8-token tile (measured); larger tiles give up what they hold
        beyond the 8-token tile's (``tile_regs``: accumulators and activation
        fragments; unmeasured)."""
        extra = cls.tile_regs(tiles, max_m, steps_per_warp) - cls.tile_regs(tiles, MMA_N, steps_per_warp)
        return PREFETCH_REG_BUDGET - max(0, extra)


# ---------------------------------------------------------------- shared memory
XS_PAD = 16               # bytes after each staged xn row: rows g, g + 1 of a 16-byte access phase
                          # land on different banks
RED_PAD = 4               # fp32 after each token's rows in the cross-warp buffer: no bank conflicts
MBAR_BYTES = 16           # two mbarriers: [0] xn landed, [1] rows landed (rank 0)


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class QKVSmem:
    """Shared memory of one GEMV CTA, in the template's allocation order
    (SmemAllocator places each buffer at the next multiple of its alignment):
    ``red`` (the warps' fp32 partial rows, 16-aligned), ``head_rows`` (rank
    0's bf16 rows of the head, 16), ``xs`` (xn's ``max_m`` rows, 128) and the
    two mbarriers (8); ``red`` and ``head_rows`` hold ``max_m`` tokens too.

    xn is staged in ``chunks`` K-chunks of ``chunk_steps`` 64-value steps:
    one chunk (the whole row) wherever it fits, which is every hidden size up
    to about 13k for the 8-token tile (16 tokens: about 6.5k, 32: about 3k,
    64: 1k to 1.5k; at hidden 16384 2 / 3 / 7 / 16 chunks, 32 at head_dim
    256 and 64 tokens); beyond that rank 0 multicasts chunk c + 1 into the
    same buffer once every CTA of the cluster is done with chunk c (a cluster
    barrier). A chunk of a chunked plan is a multiple of ``warps`` steps, so
    each warp's steps of a chunk are consecutive iterations of its loop.
    """

    hidden: int
    head_dim: int
    rows: int
    warps: int
    chunk_steps: int
    max_m: int = MMA_N   # the token tile (TOKEN_TILES)

    def __post_init__(self) -> None:
        if self.max_m not in TOKEN_TILES:
            raise ValueError(f"QKVSmem.max_m = {self.max_m} is not a token tile: use one of {list(TOKEN_TILES)}")
        steps = self.hidden // K_STEP
        if self.hidden % K_STEP or steps < 1:
            raise ValueError(f"QKVSmem: hidden = {self.hidden} must be a positive multiple of {K_STEP}")
        if self.chunk_steps != steps and not (0 < self.chunk_steps < steps and self.chunk_steps % self.warps == 0):
            raise ValueError(f"QKVSmem.chunk_steps = {self.chunk_steps} must be the whole row ({steps} steps) "
                             f"or a multiple of warps = {self.warps} below it")
        if self.total_bytes > SMEM_PER_CTA_MAX:
            raise ValueError(f"QKVSmem: {self.total_bytes} bytes of shared memory per CTA (hidden {self.hidden}, "
                             f"head_dim {self.head_dim}, rows {self.rows}, warps {self.warps}, max_m {self.max_m}, "
                             f"xn chunks of {self.chunk_steps} steps) exceed the {SMEM_PER_CTA_MAX} a CTA may opt into: "
                             "stage xn in smaller chunks (QKVSmem.plan) or use fewer warps")

    @property
    def steps(self) -> int:
        return self.hidden // K_STEP

    @property
    def chunks(self) -> int:
        return -(-self.steps // self.chunk_steps)

    @property
    def chunk_row_bytes(self) -> tuple[int, ...]:
        """Bytes of one token row in each chunk (the last may be shorter)."""
        return tuple((min(self.steps, (c + 1) * self.chunk_steps) - c * self.chunk_steps) * K_STEP * 2
                     for c in range(self.chunks))

    @property
    def red_stride(self) -> int:
        """fp32 per token in the cross-warp buffer."""
        return self.rows + RED_PAD

    @property
    def xs_stride(self) -> int:
        """Bytes per staged token row."""
        return self.chunk_steps * K_STEP * 2 + XS_PAD

    @property
    def red_bytes(self) -> int:
        return self.warps * self.max_m * self.red_stride * 4

    @property
    def head_rows_bytes(self) -> int:
        return self.max_m * self.head_dim * 2

    @property
    def xs_bytes(self) -> int:
        return self.max_m * self.xs_stride

    @property
    def offsets(self) -> dict[str, int]:
        red = 0
        head_rows = _align(red + self.red_bytes, 16)
        xs = _align(head_rows + self.head_rows_bytes, 128)
        mbar = _align(xs + self.xs_bytes, 8)
        return {"red": red, "head_rows": head_rows, "xs": xs, "mbar": mbar}

    @property
    def total_bytes(self) -> int:
        return self.offsets["mbar"] + MBAR_BYTES

    @classmethod
    def plan(cls, hidden: int, head_dim: int, rows: int, warps: int, max_m: int = MMA_N) -> "QKVSmem":
        """The whole row where it fits, else the fewest chunks that fit
        (balanced, each rounded up to a multiple of ``warps`` steps)."""
        if hidden % K_STEP or hidden < K_STEP:
            raise ValueError(f"hidden_size = {hidden} is not supported by the fused QKV GEMV: it must be a "
                             f"positive multiple of {K_STEP} (one 64-value step per quad); pad the hidden size")
        steps = hidden // K_STEP
        whole = dict(hidden=hidden, head_dim=head_dim, rows=rows, warps=warps, chunk_steps=steps, max_m=max_m)
        if cls._fits(whole):
            return cls(**whole)
        for chunks in range(2, steps // warps + 1):
            cs = _align(-(-steps // chunks), warps)
            if cs >= steps:
                continue
            trial = dict(whole, chunk_steps=cs)
            if cls._fits(trial):
                return cls(**trial)
        return cls(**dict(whole, chunk_steps=warps))  # raises: not even one step per warp fits

    @classmethod
    def _fits(cls, params: dict) -> bool:
        try:
            cls(**params)
        except ValueError:
            return False
        return True
