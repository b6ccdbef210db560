"""Work plan of the streaming QKV GEMV (cute-free): a persistent split-K grid.

The weights ``W [N, hidden]`` are cut into row blocks of ``block_rows`` rows
(a head, or 128-row pieces of a 256-dim head) and each block into K steps of
``64 unit_steps`` values. A *unit* is one (block, step): ``block_rows x 64
unit_steps`` weights (``unit_steps`` 1 or 2: 16 or 32 KB of a 128-row block,
one ring stage). The units
are numbered block-major, step-minor (``u = block * steps + step``) and the
grid's ``grid`` CTAs take contiguous ranges::

    CTA c: units [lo(c), lo(c + 1)),   lo(c) = c * units // grid

so every CTA streams the same number of weight bytes (+-1 unit) whatever the
head count, and a range covers the tail of one block and the head of the
next (a *segment* per block it touches, at most ``max_segments``). The grid
is the SM count x ``ctas_per_sm`` (persistent), or with ``splits`` > 0 it is
``blocks x splits``: then ``lo(b splits) = b steps``, every range lies in one
block (one segment) and a head has exactly ``splits`` contributors. A CTA
accumulates each segment's fp32 partial sums ``[block_rows, max_m]`` and
publishes them to its workspace slot ``c * max_segments + (block - first
block of c)``; a per-head counter counts the units that arrived, and the CTA
that completes a head sums the head's partials in CTA order (= K order:
deterministic) and runs the per-head epilogue.

With ``cluster`` (``splits`` >= 2, a block per head) a block's ``splits``
CTAs are one thread-block cluster and keep their partials on chip: rank r
finishes the head's tokens of slice r (``slice_tokens``: ``ceil(max_m / 8 /
splits)`` whole 8-token n-tiles, so the last ranks' slices may reach past the
tile and hold fewer tokens or none), summing the CTAs' partials of those
tokens in rank (= K) order after a reduce-scatter through distributed shared
memory (flintgen.device.cluster_reduce); no workspace or counter.

With ``finish_tokens`` > 0 the finish is spread instead: a head's tokens are
cut into ``finish_slices`` slices of ``finish_tokens`` tokens (whole 8-token
n-tiles), slice ``s = head * finish_slices + j`` (of ``finish_total``)
belongs to CTA ``s * grid // finish_total`` (one of the head's contributors
or a neighbour), and every CTA, after publishing its whole range, waits for
the heads of its slices to complete (their counters) and finishes those
tokens only: merge (same CTA order) and epilogue. The grid is what the SMs
hold at once and a CTA waits only after publishing everything, so the waits
end (the persistent-grid assumption decode attention's several-CTA merge
makes too). The finishers count their departures on the same counter; the
last resets it.

Inside a CTA, ``warps = block_rows / (16 warp_tiles)`` warps each own
``warp_tiles`` 16-row MMA tiles of the block and all ``max_m`` tokens. Two
copy paths bring the weights:

* the *ring* (``prefetch = 0``): ``stages`` shared-memory stages, each one
  unit's weight rows and xn's 64 values of every token, filled by
  ``cp.async`` (16-byte pieces, ``stages - 1`` units in flight). Shared rows
  are padded to ``ROW_STRIDE`` bytes, so the 8 rows of a 16-byte access
  phase land on distinct banks. With ``wgmma``, a stage holds both operands
  in wgmma's 128-byte swizzle (flintgen.device.wgmma, 128 bytes per row, no
  padding) and each warpgroup multiplies 64 of the block's rows with every
  token in ``wgmma.m64nNk16`` (N = ``max_m``), reading xn from shared memory
  once per warpgroup instead of once per warp. With ``tma`` the wgmma ring is
  filled by two TMA tensor copies per unit (flintgen.device.ring_tma), issued
  by warp 0, each stage's landing counted on its mbarrier; with
  ``l2_prefetch`` a range's next units are prefetched into L2 (before the
  grid-dependency wait, then kept that far ahead of the copies).
* *registers* (``prefetch > 0``): each warp loads its own tiles' A fragments
  straight from global memory (``ld.global.nc``, 16-byte pieces), ``prefetch``
  units ahead, with no barrier per unit; xn's values of the range's K steps
  are staged in shared memory once per CTA (``xn_slots`` slots of ``max_m``
  tokens x 64 values). ``ctas_per_sm`` CTAs share an SM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flintgen.configs.qkv_config import L2_PREFETCH_MAX_WEIGHT_BYTES
from flintgen.layout import (CTA_SMEM_RESERVED, K_STEP, MAX_CLUSTER, ROW_STRIDE, SMEM_PER_CTA_MAX, SMEM_PER_SM,
                             WARPGROUP_ROWS, XN_SLOT_BYTES)

MAX_BLOCK_ROWS = 128    # rows per block (8 warps); 256-dim heads take two blocks
MAX_STAGES = 16         # ring depth cap (a 32-bit stage index, small unrolled prologue)
MAX_UNIT_STEPS = 2      # K_STEP steps per unit (and ring stage): 2 for the wgmma cp.async ring
FLAG_BYTES = 16         # the arrival result broadcast to the CTA
MBARRIER_BYTES = 8      # one mbarrier (the TMA ring's, per stage)
STREAM_MIN_TOKENS = 16  # token tiles from which bf16 weights take the streaming design (stream_config)
STREAM_MIN_HIDDEN_8 = 3584  # ... and the 8-token tile from this hidden size (wgmma head dims only) ...
STREAM_MIN_HIDDEN_8_UNITS = 3072  # ... or this one where hidden is a multiple of 2 K_STEP (units of two K steps)
STREAM_L2_PREFETCH_8 = 1    # ... whose two-step-unit ring keeps this many units prefetched into L2 ahead ...
STREAM_L2_PREFETCH_MAX_HIDDEN = 4096   # ... up to this hidden size (measured at 4096; larger: not measured)
MAX_L2_PREFETCH = 1 << 16   # units prefetched into L2 per range (more than any range holds: all of it)
# The cluster finish's tiles (16-64 tokens) up to that hidden size: (units prefetched into L2 ahead, units per
# rolling prefetch) for weights of at most L2_PREFETCH_MAX_WEIGHT_BYTES, and for larger ones (stream_config)
STREAM_L2_PREFETCH_CLUSTER_SMALL = (8, 8)
STREAM_L2_PREFETCH_CLUSTER_SMALL_64 = (MAX_L2_PREFETCH, 1)   # ... at the 64-token tile: the whole range
STREAM_L2_PREFETCH_CLUSTER = (1, 4)
STREAM_L2_PREFETCH_CLUSTER_16 = (1, 8)   # ... and for larger ones at the 16-token tile (where the 8-token tile has
                                         # no ring of two-step units: else the 16-token tile takes that ring)
STREAM_STAGES = 6       # ring depth the heuristic picks for 64-token tiles and the mma.sync ring (StreamConfig)
STREAM_STAGES_SMALL = 8  # ... for the wgmma ring's tiles of 8, 16 and 32 tokens (the cluster finish fills smem)
FINISH_TOKENS = 32      # the 64-token wgmma tile: completed heads finished in two slices (stream_config)
FINISH_MAX_HEADS = 64   # ... where the slices (2 per head) fit 128 CTAs, one each
SPLITS = 2              # wgmma tiles of 16-64 tokens: CTAs per block (the grid aligned to blocks, stream_config) ...
SPLITS_MIN_FILL = 0.6   # ... where that grid is 0.6 .. 1 times the SM count (measured at 0.61 and 0.73)
MAX_PREFETCH = 8        # units in flight per warp on the register path (16 registers per unit and tile)
MAX_CTAS_PER_SM = 4
MAX_L2_PREFETCH_GROUP = 16  # units of one rolling L2 prefetch (StreamConfig.l2_prefetch_group)
MERGE_FLOATS = 96       # partial-sum loads a thread keeps in flight when merging a head (ring path)
MERGE_FLOATS_REGISTER_PATH = 16   # the register path merges beside its next units' weights in registers


@dataclass(frozen=True)
class StreamConfig:
    """Launch configuration of the streaming design: ``stages`` of the ring
    (0: as many as fit a CTA's shared memory, StreamPlan.ring_stages),
    ``warp_tiles`` 16-row MMA tiles per warp, ``prefetch`` units in flight
    per warp in registers (> 0: the register path, no ring; stages must be 0),
    ``ctas_per_sm`` CTAs per SM (the grid is ``ctas_per_sm`` x the SM count),
    ``wgmma`` (the ring's MMAs as warpgroup MMAs from shared memory) and
    ``finish_tokens`` (> 0: completed heads finished in slices of that many
    tokens by several CTAs, StreamPlan; a tile of fewer tokens is one slice)
    and ``l2_prefetch`` (units of each range, after those copied before the
    grid-dependency wait, whose weights are prefetched into L2 before it; the
    ring then keeps the prefetch that many units ahead of its copies) and
    ``tma`` (the wgmma ring filled by TMA: one tensor copy per operand and
    unit, issued by one lane, each stage's arrival counted on an mbarrier;
    tokens >= M zero-filled by the copy) and ``splits`` (> 0: the grid is
    ``splits`` CTAs per block, each a contiguous part of the block's K steps,
    ranges aligned to blocks; 0: the SM count x ``ctas_per_sm``, ranges across
    blocks) and ``cluster`` (those ``splits`` CTAs one cluster, reducing
    through distributed shared memory, each finishing ``ceil(n-tiles /
    splits)`` of the tile's 8-token n-tiles, the last ranks fewer or none) and
    ``unit_steps`` (K_STEP steps per unit and ring stage: 2 makes 32 KB
    units of a 128-row block, the wgmma cp.async ring only) and
    ``evict_first`` (the ring's weight copies read with an L2 evict-first
    policy: dead once read, they leave L2 first; the cp.async ring only) and
    ``l2_prefetch_group`` (with ``l2_prefetch``: the ring's rolling L2
    prefetch every that many units, each row's bytes of that many units in
    one bulk prefetch, instead of one unit's per row at every unit)."""

    stages: int = 0
    warp_tiles: int = 1
    prefetch: int = 0
    ctas_per_sm: int = 1
    wgmma: bool = False
    finish_tokens: int = 0
    l2_prefetch: int = 0
    tma: bool = False
    splits: int = 0
    cluster: bool = False
    unit_steps: int = 1
    evict_first: bool = False
    l2_prefetch_group: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.l2_prefetch_group, bool) or not isinstance(self.l2_prefetch_group, int) \
                or not 1 <= self.l2_prefetch_group <= MAX_L2_PREFETCH_GROUP:
            raise ValueError(f"StreamConfig.l2_prefetch_group = {self.l2_prefetch_group!r} must be an int in "
                             f"1..{MAX_L2_PREFETCH_GROUP} (units per rolling L2 prefetch)")
        if self.l2_prefetch_group > 1 and not self.l2_prefetch:
            raise ValueError(f"StreamConfig: l2_prefetch_group = {self.l2_prefetch_group} groups the ring's L2 "
                             f"prefetch: l2_prefetch = {self.l2_prefetch} must be >= 1 (or the group 1)")
        if not isinstance(self.evict_first, bool):
            raise TypeError(f"StreamConfig.evict_first = {self.evict_first!r} must be a bool")
        if self.evict_first and (self.tma or self.prefetch):
            raise ValueError("StreamConfig: evict_first = True applies to the cp.async ring's weight copies: "
                             f"tma = {self.tma}, prefetch = {self.prefetch} must be off (False, 0)")
        if self.cluster and self.splits < 2:
            raise ValueError(f"StreamConfig: cluster = True reduces the splits CTAs of a block in a cluster: "
                             f"splits = {self.splits} must be >= 2")
        if self.splits < 0:
            raise ValueError(f"StreamConfig: splits = {self.splits} must be 0 (a CTA per SM) or >= 1 CTAs per block")
        StreamPlan(hidden=K_STEP * MAX_UNIT_STEPS * (MAX_PREFETCH + 1), head_dim=128, heads=1, ctas=1, max_m=8,
                   stages=self.stages, warp_tiles=self.warp_tiles, prefetch=self.prefetch,
                   ctas_per_sm=self.ctas_per_sm, wgmma=self.wgmma,
                   finish_tokens=min(self.finish_tokens, 8), l2_prefetch=self.l2_prefetch,
                   tma=self.tma, splits=min(self.splits, 1), unit_steps=self.unit_steps)  # range checks
        if self.finish_tokens % 8 or not 0 <= self.finish_tokens <= 64:
            raise ValueError(f"StreamConfig: finish_tokens = {self.finish_tokens} must be 0 (the completing CTA "
                             "finishes a head) or 8, 16, .., 64 (whole 8-token n-tiles)")

    def tokens_for(self, max_m: int) -> int:
        """Tokens per finishing slice at the token tile ``max_m``."""
        return min(self.finish_tokens, max_m)


def stream_config(weight_format: str, max_m: int, head_dim: int, *, hidden: int,
                  heads: int = 0, ctas: int = 0) -> "StreamConfig | None":
    """The streaming design's configuration for the token tile ``max_m`` of a
    spec (``hidden`` its hidden size, ``heads`` q + 2 kv heads per rank,
    ``ctas`` the target's SM count: 0 leaves out the rule that needs it,
    ``splits``), or None where the tile runs the cluster design
    (flintgen.configs.qkv_config.QKVConfig). NVFP4 weights always run the
    cluster design (dequantized in registers; the streaming template takes
    bf16 only); the register path (StreamConfig.prefetch) is never selected
    (benchmarks/results/qkv_stream_register_path.md). For bf16, measured on
    an H200 (CUDA-graph replay, weights rotating beyond L2, one process):

    * Tiles of 16 tokens and more stream (qkv_stream.md). Where a block is a
      multiple of 64 rows (head_dim 64, 128, 256) they multiply with wgmma,
      8 stages at 16 / 32 tokens and 6 at 64 (hidden 2048 / 4096 32/8 steps:
      9.68 / 17.41 us at M = 16 against 10.67 / 18.67 with the mma.sync ring,
      11.29 / 18.56 at 32 against 13.90 / 22.06, 15.86 / 23.42 at 64 against
      20.89 / 31.10; 6 stages at M = 16 are slower in the step, 8 at 64
      slower); head_dim 96 keeps the mma.sync ring of 6 stages.
    * The 8-token tile streams where the heads' blocks are whole
      warpgroups: from hidden STREAM_MIN_HIDDEN_8_UNITS where hidden is a
      multiple of 128, with units of two K steps (``unit_steps``) and the
      ring filling shared memory (6 stages), else from STREAM_MIN_HIDDEN_8
      with wgmma and 8 stages of one K step (qkv_u8.md, H100, steps at
      M = 1 / 8 against 8 stages of one step: hidden 3584 14.44 / 14.70 ->
      14.05 / 14.29 us, 4096 32/8 19.98 / 20.37 -> 19.51 / 19.77, 5120
      27.63 / 27.99 -> 27.24 / 27.54, 8192 57.86 / 58.27 -> 57.34 / 57.84;
      hidden 3072 24/8 on the cluster design 14.70 / 15.16 -> 13.59 /
      13.88). Below 3072 the cluster design is faster (H100: hidden 2048
      9.11 / 9.53 against 9.97 / 10.39, 1024 5.21 / 5.29 against 6.77 /
      6.58); head_dim 96 was not measured streaming at 8 tokens and stays
      on the cluster design.
    * The 64-token wgmma tile of at most FINISH_MAX_HEADS heads finishes heads
      in two slices of 32 tokens (``finish_tokens``), measured (qkv_stream.md,
      8fd9fb8): hidden 2048 / 4096 GEMV 12.11 / 19.70 us against 14.31 / 21.83
      finished whole by the completing CTA; slices of 16 or 8 tokens (2-3 per
      CTA) 13.8-14.4 / 21.5-22.6; at 16 / 32 tokens no slicing was faster
      (32: 9.89 / 17.32 with two slices against 10.14 / 16.96).
    * The wgmma tiles of 16-64 tokens run SPLITS = 2 CTAs per block (the
      grid aligned to blocks: each CTA half a block's K steps, no range
      across blocks) where that grid is SPLITS_MIN_FILL .. 1 times the SM
      count, else one CTA per SM (qkv_stream_splits.md, H100, 3 runs, steps
      at M = 16 / 32 / 64: hidden 2048 32/4 (80 CTAs) 11.05 / 12.65 / 14.66
      -> 10.72 / 11.77 / 13.79 us, GEMV 9.71 / 11.40 / 13.28 -> 9.66 / 10.32
      / 12.98; hidden 4096 32/8 (96 CTAs) steps 22.08 / 23.56 / 26.76 ->
      21.56 / 22.58 / 25.93, but its GEMV alone is slower at 16 / 32 tokens,
      20.49 / 21.98 -> 21.34 / 22.35, and faster at 64, 24.91 -> 24.57; the
      step is what a decoder runs). Three CTAs per block were slower at 32
      and 64 tokens, also as one cluster (qkv_stream_cluster.md third A/B,
      H100: +1.7-3.7 us in the step at hidden 2048, 120 CTAs); 8-token
      tiles slower with two (hidden 4096: step 20.94 -> 21.32), and with
      the cluster finish only faster at M = 8 (fourth A/B, H100: steps at
      M = 1 / 2 / 4 / 8 +0.16 / +0.22 / -0.09 / -0.62 us); grids below 0.6
      of the SMs not measured.
    * Where a head is one block (head_dim 64 or 128) those two CTAs are one
      cluster reducing through distributed shared memory (``cluster``): each
      finishes half the tokens, no workspace round trip or counter wait
      (qkv_stream_cluster.md, H100, 3 runs, steps at M = 16 / 32 / 64
      against the workspace finish, 8 stages: hidden 2048 10.69 / 11.74 /
      13.85 -> 10.52 / 11.00 / 12.05 us, GEMV 9.67 / 10.37 / 12.95 -> 9.62 /
      10.07 / 10.79; hidden 4096 21.53 / 22.51 / 25.69 -> 21.13 / 22.37 /
      22.91, GEMV 21.26 / 22.26 / 24.53 -> 20.16 / 20.83 / 21.64), its ring
      filling shared memory (``stages = 0``: 12 / 10 / 8 stages at 16 / 32
      / 64 tokens; against 8, steps at 16 / 32 tokens 10.49 / 10.99 ->
      10.24 / 10.85 and 20.73 / 22.09 -> 20.27 / 22.06, GEMV -0.40 / -0.30
      and -0.60 / -0.19 us; the TMA ring was not faster).
    * Every streaming tile copies its weights with the L2 evict-first policy
      (``evict_first``): read once, they leave L2 before what the step reads
      again (x, the residual, xn, the next launch's data). qkv_evict.md
      run 1, H100, 3 runs with a control, steps at M = 1 / 8 / 16 / 64: hidden 4096
      32/8 19.56 / 19.84 / 20.48 / 22.72 -> 18.77 / 19.04 / 19.39 / 22.35 us
      (GEMV -0.37 / -0.41 / -1.06 / -0.77); hidden 2048 at 16 tokens 10.26 ->
      9.48 (GEMV level), at 64 12.02 -> 12.14 (within the spread; GEMV
      -0.27). The cluster design's loads with the same policy were level
      (flint-bf16 M = 1 / 8), so it keeps the default.
    * With those reads the 8-token tile's ring of two-step units keeps
      STREAM_L2_PREFETCH_8 = 1 unit prefetched into L2 ahead of its copies
      (``l2_prefetch``; before the grid wait, the unit after the copied
      ones), up to hidden STREAM_L2_PREFETCH_MAX_HIDDEN (qkv_evict.md run 4,
      H100, 3 runs with a control, hidden 4096 32/8 at M = 1 / 2 / 4 / 8:
      GEMV 18.20 / 18.25 / 18.25 / 18.35 -> 16.49 / 16.51 / 16.51 / 16.55
      us, 99 % of the floor; steps 19.34 / 19.35 / 19.45 / 19.55 -> 17.72 /
      17.78 / 17.86 / 18.12; 2 units ahead -1.2 to -1.3 us, 4 level; at 16
      and 64 tokens 2 and 8 units ahead made the step 0.1-14 us slower, run 3).
      Larger hidden sizes were not measured (before evict-first reads the L2
      prefetch cost 2-18 us there) and keep none.
    * The cluster finish's tiles (16-64 tokens) up to the same hidden size
      keep units prefetched into L2 ahead, the ring's rolling prefetch
      grouped (``l2_prefetch_group``: one bulk prefetch per row every G
      units). Weights of at most L2_PREFETCH_MAX_WEIGHT_BYTES: 8 units ahead
      in groups of 8, at 64 tokens the whole range before the grid wait
      (STREAM_L2_PREFETCH_CLUSTER_SMALL / _SMALL_64); larger ones: 1 unit
      ahead in groups of 4, of 8 at 16 tokens (STREAM_L2_PREFETCH_CLUSTER /
      _16). Measured on the H100 (qkv_evict.md runs 8-16, 3 runs each with
      a control), steps / GEMV us at M = 16 / 32 / 64 against no L2
      prefetch: hidden 4096 32/8 (50 MB) 19.64 / 21.76 / 22.80 -> 18.66 /
      20.14 / 21.82 and 18.59 / 19.69 / 20.92 -> 18.49 / 18.36 / 20.14
      (groups of 8 at 16 tokens: step -0.72 / -0.76 against groups of 4 in
      two runs, the GEMV +0.1-0.2); flint-bf16 (21 MB) steps 9.59 / 10.84 /
      12.30 -> 9.5-9.8 / 10.0-10.2 / 11.74 (the whole range at 64 tokens:
      -0.53 / -0.61 against 8 ahead in groups of 8 in two runs, the GEMV
      +0.4-0.55). Swapped settings, 2 / 4 / 16 units ahead, groups of 16
      and one unit ahead ungrouped were slower or level.
    * Larger weights take the 8-token tile's ring of two-step units (one CTA
      per SM, one unit prefetched into L2 ahead) at the 16-token tile too,
      where the 8-token tile has it (qkv_evict.md run 17, H100, 3 runs with a
      control, hidden 4096 32/8 at M = 16 against the cluster ring in groups
      of 8: GEMV 18.42 -> 17.41 us, 88 -> 94 % of the floor; step 18.83 ->
      18.74, the control 18.76; 2 units ahead: GEMV 17.35, step 19.16). At
      32 / 64 tokens that ring is slower (GEMV +1.2 / +4.5 us), as at every
      tile of flint-bf16 (+0.6-4.9)."""
    cfg = _stream_tile(weight_format, max_m, head_dim, hidden=hidden, heads=heads, ctas=ctas)
    if cfg is None:
        return None
    cfg = replace(cfg, evict_first=True)
    if max_m >= STREAM_MIN_TOKENS and cfg.cluster and hidden <= STREAM_L2_PREFETCH_MAX_HIDDEN:
        small = hidden * heads * head_dim * 2 <= L2_PREFETCH_MAX_WEIGHT_BYTES
        if small:
            ahead, group = STREAM_L2_PREFETCH_CLUSTER_SMALL_64 if max_m == 64 else STREAM_L2_PREFETCH_CLUSTER_SMALL
        elif max_m == STREAM_MIN_TOKENS:
            ring8 = _stream_tile(weight_format, 8, head_dim, hidden=hidden, heads=heads, ctas=ctas)
            if ring8 is not None and ring8.unit_steps > 1:
                return replace(ring8, evict_first=True)     # the 8-token tile's ring of two-step units
            ahead, group = STREAM_L2_PREFETCH_CLUSTER_16
        else:
            ahead, group = STREAM_L2_PREFETCH_CLUSTER
        cfg = replace(cfg, l2_prefetch=ahead, l2_prefetch_group=group)
    return cfg


def _stream_tile(weight_format: str, max_m: int, head_dim: int, *, hidden: int, heads: int,
                 ctas: int) -> "StreamConfig | None":
    """stream_config's ring, tile and finish per token tile (before the read policy)."""
    if weight_format != "bf16":
        return None
    whole_warpgroups = block_rows_of(head_dim) % WARPGROUP_ROWS == 0
    if max_m < STREAM_MIN_TOKENS:
        if whole_warpgroups and hidden >= STREAM_MIN_HIDDEN_8_UNITS and hidden % (2 * K_STEP) == 0:
            l2 = STREAM_L2_PREFETCH_8 if hidden <= STREAM_L2_PREFETCH_MAX_HIDDEN else 0
            return StreamConfig(wgmma=True, unit_steps=2, l2_prefetch=l2)      # the ring fills shared memory
        if whole_warpgroups and hidden >= STREAM_MIN_HIDDEN_8:
            return StreamConfig(stages=STREAM_STAGES_SMALL, wgmma=True)
        return None
    if not whole_warpgroups:
        return StreamConfig(stages=STREAM_STAGES)
    splits = SPLITS if ctas and SPLITS_MIN_FILL * ctas <= SPLITS * blocks_of(heads, head_dim) <= ctas else 0
    if splits and blocks_of(1, head_dim) == 1:
        return StreamConfig(wgmma=True, splits=splits, cluster=True)     # the ring fills shared memory
    if max_m > 32:
        return StreamConfig(stages=STREAM_STAGES, wgmma=True,
                            finish_tokens=FINISH_TOKENS if 0 < heads <= FINISH_MAX_HEADS else 0, splits=splits)
    return StreamConfig(stages=STREAM_STAGES_SMALL, wgmma=True, splits=splits)


def block_rows_of(head_dim: int) -> int:
    """Weight rows of a block: the head, or 128-row pieces of a 256-dim head."""
    return min(head_dim, MAX_BLOCK_ROWS)


def blocks_of(heads: int, head_dim: int) -> int:
    """Row blocks of ``heads`` heads of ``head_dim`` rows."""
    return heads * (head_dim // block_rows_of(head_dim))


@dataclass(frozen=True)
class StreamPlan:
    hidden: int
    head_dim: int
    heads: int       # q + 2 kv heads of the rank
    ctas: int        # CTAs the target runs at once (its SM count): the grid, at most one per unit
    max_m: int       # token tile
    stages: int = 0  # 0: as many as fit shared memory (up to MAX_STAGES)
    warp_tiles: int = 1   # 16-row MMA tiles per warp (2: each xn fragment read from shared memory feeds two)
    prefetch: int = 0     # > 0: the register path, units in flight per warp
    ctas_per_sm: int = 1  # CTAs resident per SM: the grid is ctas x ctas_per_sm (at most one per unit)
    wgmma: bool = False   # the ring's MMAs as wgmma.m64nNk16 from shared memory (a warpgroup per 64 rows)
    finish_tokens: int = 0   # > 0: completed heads finished in slices of this many tokens by several CTAs
    l2_prefetch: int = 0     # units of a range prefetched into L2 before the grid-dependency wait
    tma: bool = False        # the wgmma ring filled by TMA tensor copies (an mbarrier per stage)
    splits: int = 0          # > 0: grid = blocks x splits, each CTA a contiguous K part of one block
    cluster: bool = False    # a block's splits CTAs one cluster: reduce-scatter through DSMEM, no workspace
    unit_steps: int = 1      # K_STEP steps per unit (ring stage): 2 for 32 KB units of a 128-row block (wgmma ring)

    def __post_init__(self) -> None:
        if isinstance(self.unit_steps, bool) or self.unit_steps not in range(1, MAX_UNIT_STEPS + 1):
            raise ValueError(f"StreamPlan: unit_steps = {self.unit_steps!r} must be 1..{MAX_UNIT_STEPS} K steps of "
                             f"{K_STEP} values per unit")
        if self.unit_steps > 1 and (not self.wgmma or self.tma):
            raise ValueError(f"StreamPlan: unit_steps = {self.unit_steps} (several K steps per ring stage) takes "
                             f"the wgmma ring filled by cp.async: wgmma = {self.wgmma} must be True and tma = "
                             f"{self.tma} must be False, or use unit_steps = 1")
        if self.hidden % self.unit_k or self.hidden < self.unit_k:
            raise ValueError(f"StreamPlan: hidden = {self.hidden} must be a positive multiple of {self.unit_k} "
                             f"(unit_steps = {self.unit_steps} K steps of {K_STEP})"
                             + (": use unit_steps = 1" if self.unit_steps > 1 and self.hidden % K_STEP == 0 else ""))
        if self.head_dim % 16 or (self.head_dim > MAX_BLOCK_ROWS and self.head_dim % MAX_BLOCK_ROWS):
            raise ValueError(f"StreamPlan: head_dim = {self.head_dim} must be a multiple of 16, and of "
                             f"{MAX_BLOCK_ROWS} above {MAX_BLOCK_ROWS}")
        if self.max_m % 8 or not 8 <= self.max_m <= 64:
            raise ValueError(f"StreamPlan: max_m = {self.max_m} must be 8, 16, .., 64")
        if self.ctas < 1 or self.heads < 1:
            raise ValueError(f"StreamPlan: ctas = {self.ctas} and heads = {self.heads} must be >= 1")
        if not 0 <= self.stages <= MAX_STAGES or self.stages == 1:
            raise ValueError(f"StreamPlan: stages = {self.stages} must be 0 (fill shared memory) or "
                             f"2..{MAX_STAGES}")
        if self.warp_tiles not in (1, 2) or self.block_rows % (16 * self.warp_tiles):
            raise ValueError(f"StreamPlan: warp_tiles = {self.warp_tiles} must be 1 or 2 and divide the "
                             f"{self.block_rows // 16} tiles of a {self.block_rows}-row block")
        if not 0 <= self.prefetch <= MAX_PREFETCH:
            raise ValueError(f"StreamPlan: prefetch = {self.prefetch} must be 0 (the cp.async ring) or "
                             f"1..{MAX_PREFETCH} units in registers")
        if self.prefetch and self.stages:
            raise ValueError(f"StreamPlan: prefetch = {self.prefetch} (the register path) takes no ring: "
                             f"stages = {self.stages} must be 0")
        if self.prefetch and self.steps < self.prefetch:
            raise ValueError(f"StreamPlan: hidden = {self.hidden} has {self.steps} K steps, fewer than "
                             f"prefetch = {self.prefetch} (a group of prefetched units spans at most two "
                             "blocks): prefetch fewer units")
        if self.wgmma and (self.prefetch or self.warp_tiles != 1 or self.block_rows % WARPGROUP_ROWS):
            raise ValueError(f"StreamPlan: wgmma takes the ring path (prefetch = {self.prefetch} must be 0), one "
                             f"16-row tile per warp (warp_tiles = {self.warp_tiles}) and blocks of a multiple of "
                             f"{WARPGROUP_ROWS} rows (head_dim {self.head_dim}: {self.block_rows}): use the "
                             "mma.sync ring (wgmma=False) for this shape")
        if not 1 <= self.ctas_per_sm <= MAX_CTAS_PER_SM:
            raise ValueError(f"StreamPlan: ctas_per_sm = {self.ctas_per_sm} must be 1..{MAX_CTAS_PER_SM}")
        if self.finish_tokens and (self.finish_tokens % 8 or self.max_m % self.finish_tokens):
            raise ValueError(f"StreamPlan: finish_tokens = {self.finish_tokens} must be a multiple of 8 that "
                             f"divides the {self.max_m}-token tile (or 0: the completing CTA finishes a head)")
        if self.finish_tokens and self.prefetch:
            raise ValueError(f"StreamPlan: finish_tokens = {self.finish_tokens} (heads finished in slices after "
                             f"the range) takes the ring path: prefetch = {self.prefetch} must be 0")
        if not 0 <= self.l2_prefetch <= MAX_L2_PREFETCH:
            raise ValueError(f"StreamPlan: l2_prefetch = {self.l2_prefetch} must be 0 (none) or 1..{MAX_L2_PREFETCH} "
                             "units prefetched into L2 before the grid-dependency wait")
        if not 0 <= self.splits <= self.steps:
            raise ValueError(f"StreamPlan: splits = {self.splits} must be 0 (a CTA per SM) or 1..{self.steps} (the "
                             f"{self.steps} K steps of a block at hidden {self.hidden})")
        if self.splits and self.finish_tokens and self.grid > self.ctas * self.ctas_per_sm:
            raise ValueError(f"StreamPlan: splits = {self.splits} makes a grid of {self.grid} CTAs, more than the "
                             f"{self.ctas * self.ctas_per_sm} resident at once, and finish_tokens = "
                             f"{self.finish_tokens} has CTAs wait for other CTAs' heads: use fewer splits or "
                             "finish_tokens = 0")
        if self.cluster:
            self._check_cluster()
        if self.tma and not self.wgmma:
            raise ValueError(f"StreamPlan: tma = True writes the 128-byte swizzled stages of the wgmma ring: "
                             f"wgmma = {self.wgmma} must be True (and prefetch = {self.prefetch} 0)")
        if (self.smem_bytes + CTA_SMEM_RESERVED) * self.ctas_per_sm > SMEM_PER_SM:
            what = (f"xn of {self.xn_slots} K steps x {self.max_m} tokens" if self.prefetch
                    else f"{self.ring_stages} ring stages of {self.stage_bytes} bytes")
            raise ValueError(f"StreamPlan: {self.ctas_per_sm} CTAs of {self.smem_bytes} bytes of shared memory "
                             f"({what}) exceed an SM's {SMEM_PER_SM}: use fewer CTAs per SM"
                             + ("" if self.prefetch else " or fewer stages"))
        if not self.prefetch and self.ring_stages < 2:
            want = self.stages or 2
            fit = StreamPlan(**{**self.__dict__, "stages": 0}).ring_stages if self.stages else 0
            raise ValueError(f"StreamPlan: {want} stages of {self.stage_bytes} bytes (max_m {self.max_m}, head_dim "
                             f"{self.head_dim}) need {self.smem_bytes_for(want)} bytes of shared memory, over the "
                             f"{SMEM_PER_CTA_MAX} a CTA may use: "
                             + (f"use at most {fit} stages" if fit >= 2 else "this shape does not fit the design"))
        if self.wgmma and self.lookahead < 1:
            raise ValueError(f"StreamPlan: wgmma keeps a unit's MMAs in flight past the next unit's barrier: "
                             f"{self.ring_stages} stages must be at least 3")

    def _check_cluster(self) -> None:
        if not 2 <= self.splits <= MAX_CLUSTER:
            raise ValueError(f"StreamPlan: cluster = True makes the splits CTAs of a block one cluster: splits = "
                             f"{self.splits} must be 2..{MAX_CLUSTER}")
        if self.blocks_per_head != 1:
            raise ValueError(f"StreamPlan: cluster = True finishes a head within its block's cluster: head_dim "
                             f"{self.head_dim} spans {self.blocks_per_head} blocks; use cluster = False")
        if self.finish_tokens or self.prefetch:
            raise ValueError(f"StreamPlan: cluster = True finishes the tokens by cluster rank on the ring path: "
                             f"finish_tokens = {self.finish_tokens} and prefetch = {self.prefetch} must be 0")

    # ------------------------------------------------------------ geometry
    @property
    def block_rows(self) -> int:
        return block_rows_of(self.head_dim)

    @property
    def warps(self) -> int:
        return self.block_rows // (16 * self.warp_tiles)

    @property
    def blocks_per_head(self) -> int:
        return blocks_of(1, self.head_dim)

    @property
    def unit_k(self) -> int:
        """K values of a unit."""
        return K_STEP * self.unit_steps

    @property
    def steps(self) -> int:
        """Units of a block (its K steps of ``unit_k`` values)."""
        return self.hidden // self.unit_k

    @property
    def blocks(self) -> int:
        return blocks_of(self.heads, self.head_dim)

    @property
    def units(self) -> int:
        return self.blocks * self.steps

    @property
    def head_units(self) -> int:
        """Units of one head: its counter's target."""
        return self.blocks_per_head * self.steps

    @property
    def grid(self) -> int:
        """``splits`` CTAs per block (ranges never cross a block: lo(b splits) = b steps), else the SMs'
        ``ctas x ctas_per_sm``; at most one per unit."""
        if self.splits:
            return self.blocks * self.splits
        return min(self.ctas * self.ctas_per_sm, self.units)

    def lo(self, c: int) -> int:
        """First unit of CTA ``c`` (``lo(grid) = units``)."""
        return c * self.units // self.grid

    def cta_of_unit(self, u: int) -> int:
        """The CTA whose range holds unit ``u``: the largest c with lo(c) <= u."""
        return ((u + 1) * self.grid - 1) // self.units

    @property
    def max_units(self) -> int:
        """Units of the longest range."""
        return -(-self.units // self.grid)

    @property
    def max_segments(self) -> int:
        """Blocks a range of ``max_units`` consecutive units can touch."""
        if self.splits:
            return 1
        return (self.max_units + self.steps - 2) // self.steps + 1

    def segments(self, c: int) -> list[tuple[int, int, int]]:
        """CTA ``c``'s (block, first unit, end unit) segments, in order."""
        lo, hi = self.lo(c), self.lo(c + 1)
        out = []
        for b in range(lo // self.steps, (hi - 1) // self.steps + 1):
            out.append((b, max(lo, b * self.steps), min(hi, (b + 1) * self.steps)))
        return out

    def slot(self, c: int, block: int) -> int:
        """Workspace slot of CTA ``c``'s segment of ``block``."""
        return c * self.max_segments + block - self.lo(c) // self.steps

    def contributors(self, block: int) -> tuple[int, int]:
        """First and last CTA whose ranges share ``block`` (the template's closed form)."""
        first_unit = block * self.steps
        return ((first_unit + 1) * self.grid - 1) // self.units, ((first_unit + self.steps) * self.grid - 1) // self.units

    @property
    def max_contributors(self) -> int:
        """CTAs whose ranges share one block, at most (the merge's unrolled loads)."""
        return max(last - first + 1 for first, last in map(self.contributors, range(self.blocks)))

    @property
    def slots(self) -> int:
        """Workspace slots (none with ``cluster``: the partials stay on chip)."""
        return 0 if self.cluster else self.grid * self.max_segments

    @property
    def workspace_floats(self) -> int:
        """fp32 partials: ``[slots, block_rows, max_m]``."""
        return self.slots * self.block_rows * self.max_m

    # ------------------------------------------------------------ finishing a head
    @property
    def finish_slices(self) -> int:
        """Token slices a completed head is finished in (``splits`` with ``cluster``: one per rank; 1 with
        ``finish_tokens`` 0: all of it by the CTA that completed it)."""
        if self.cluster:
            return self.splits
        return self.max_m // self.finish_tokens if self.finish_tokens else 1

    @property
    def slice_tokens(self) -> int:
        """Tokens of one finishing slice: ``cluster``, whole n-tiles, ``ceil(n-tiles / splits)`` a rank (the
        last ranks' slices may hold fewer or none of the tile's tokens)."""
        if self.cluster:
            return 8 * -(-self.max_m // (8 * self.splits))
        return self.max_m // self.finish_slices

    @property
    def finish_total(self) -> int:
        """Slices of every head (``finish_tokens`` > 0); slice ``s`` is head ``s // finish_slices``'s."""
        return self.heads * self.finish_slices

    def finisher(self, s: int) -> int:
        """The CTA that finishes slice ``s``."""
        return s * self.grid // self.finish_total

    @property
    def max_owned(self) -> int:
        """Slices one CTA finishes, at most."""
        return -(-self.finish_total // self.grid) if self.finish_tokens else 0

    # ------------------------------------------------------------ merging a head
    @property
    def merge_floats(self) -> int:
        return MERGE_FLOATS_REGISTER_PATH if self.prefetch else MERGE_FLOATS

    @property
    def merge_ntiles(self) -> int:
        """8-token n-tiles of every contributor's partial loaded per merge round: the most that divide
        a finishing slice's n-tiles with ``4 max_contributors n <= merge_floats`` (1 past 6 contributors or on the
        register path). Measured (qkv_stream_launch.md): rounds are L2 latencies on the kernel's tail,
        so fewer rounds shorten it."""
        if self.prefetch or self.max_contributors > 6:
            return 1
        n_tiles = self.slice_tokens // 8
        fit = [n for n in range(1, n_tiles + 1) if n_tiles % n == 0 and 4 * self.max_contributors * n <= self.merge_floats]
        return max(fit, default=1)

    # ------------------------------------------------------------ shared memory
    @property
    def stage_bytes(self) -> int:
        """One unit: per K_STEP step of it (``unit_steps``), ``block_rows`` weight rows, then ``max_m``
        xn rows, each ROW_STRIDE bytes (wgmma: K_STEP values, unpadded and swizzled)."""
        return self.unit_steps * (self.block_rows + self.max_m) * (K_STEP * 2 if self.wgmma else ROW_STRIDE)

    @property
    def head_rows_bytes(self) -> int:
        """The bf16 rows ``[max_m, head_dim]`` of the head being finished."""
        return self.max_m * self.head_dim * 2

    @property
    def slice_values(self) -> int:
        """fp32 accumulators of one finishing slice per thread (``cluster``)."""
        return self.warp_tiles * (self.slice_tokens // 8) * 4

    @property
    def recv_bytes(self) -> int:
        """``cluster``: the receive buffer of the other ranks' partials of this CTA's tokens
        (flintgen.device.cluster_reduce: ``splits - 1`` parts of ``block_rows x slice_tokens`` fp32)."""
        return (self.splits - 1) * self.block_rows * self.slice_tokens * 4 if self.cluster else 0

    def smem_bytes_for(self, stages: int) -> int:
        """Ring (128-aligned, first; wgmma: 1024), the TMA ring's mbarriers (8 bytes a stage), head rows (16),
        the flag (16), the cluster's receive buffer (16)."""
        return (stages * (self.stage_bytes + (MBARRIER_BYTES if self.tma else 0)) + self.head_rows_bytes + FLAG_BYTES
                + self.recv_bytes)

    # ------------------------------------------------------------ register path
    @property
    def xn_by_unit(self) -> bool:
        """Register path: xn slot j holds the K step of the range's unit j (a
        range of at most ``steps`` units meets each step once); else slot s
        holds step s (every step staged)."""
        return self.max_units <= self.steps

    @property
    def xn_slots(self) -> int:
        return self.max_units if self.xn_by_unit else self.steps

    @property
    def xn_bytes(self) -> int:
        """Staged xn ``[xn_slots, 2 halves, max_m, 64 bytes]`` (register path)."""
        return self.xn_slots * self.max_m * XN_SLOT_BYTES

    @property
    def lookahead(self) -> int:
        """Ring path: units whose copies are in flight (the first ones issued before the grid-dependency
        wait). A wgmma unit's MMAs stay in flight past the next unit's barrier, so its stage is refilled
        one unit later."""
        return self.ring_stages - (2 if self.wgmma else 1)

    @property
    def ring_stages(self) -> int:
        """``stages``, or the most (<= MAX_STAGES) that fit a CTA."""
        if self.stages:
            return self.stages if self.smem_bytes_for(self.stages) <= SMEM_PER_CTA_MAX else 0
        s = MAX_STAGES
        while s > 0 and self.smem_bytes_for(s) > SMEM_PER_CTA_MAX:
            s -= 1
        return s

    @property
    def smem_bytes(self) -> int:
        if self.prefetch:
            return self.xn_bytes + self.head_rows_bytes + FLAG_BYTES
        return self.smem_bytes_for(self.ring_stages)
