"""Launch configuration of split-KV paged decode attention (cute-free).

The rule starts from the hand-written Flint kernel's ``_launch_config`` (the
design page, shared/seeds/000_*.txt: an H200, Flint's 4 kv heads, GQA 8,
head_dim 128, 16-token pages, a 128-token window), restated in (request, kv
head) pairs and re-measured on flintgen's own kernels; each band below states
its current rule and the measurement it rests on (how the rules changed:
benchmarks/results/history/decode_attention_config.md). Tables of the choices
against the bandwidth floor and the peers: benchmarks/results/decode_attention
{,_gpt_oss,_shapes,_models,_fp8}.md; alternatives timed against each other:
benchmarks/results/decode_attention_sweep.md. Windows past the short band take
the full-attention rule (measured at 512, 1024 and 4096: sweep runs 13-14).

Terms (numbers and shapes: flintgen/layout.py): a *slice* is
SLICE_TOKENS = 16 tokens of one kv head's page, [16, 2 * head_dim] bf16 (8 KB
at head_dim 128, 4 KB at 64): the unit every warp streams (a page of 32 or 64
tokens is 2 or 4 consecutive slices in the HND cache). A *split* is
one CTA of a (request, kv head); its ``num_warps`` warps each stream whole
slices through a private ring of ``num_stages`` bulk-copy slots.
``min_pages``: a split is active only when each of its warps gets at least
that many slices (the name predates pages of more than 16 tokens).
``cluster``: the splits of a (request, kv head) form a thread-block cluster
and merge through distributed shared memory instead of global fp32 partials
+ a last-CTA merge. ``merge_ctas``: with global partials, the last that many
CTAs to arrive merge (a group of tile_heads / merge_ctas heads each) instead
of the last one alone; ``merge_from``: only once that many splits are active
(a runtime count that grows with seq_len; below it the last CTA alone).
Head tiles (``AttentionLayout``): the mma's N = HEAD_TILE = 8 columns are q
heads, so GQA 4 runs one tile with 4 padded heads and GQA 16 two tiles
(``tile_heads`` 8 or 16 heads are computed and merged).

fp8 e4m3 caches (``kv_dtype``): slices are half the bytes (an e4m3 slice at
head_dim 128 is the 4 KB of a bf16 one at head_dim 64); ``launch_config``
takes the bf16 choice of the shape with bf16's ring slots (one fewer for
sliding windows): ``_fp8_by_bytes``, measured on the rows it names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flintgen.layout import HEAD_TILE, SLICE_TOKENS, SMEM_PER_CTA_MAX, AttentionLayout

SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
SUPPORTED_GQA = tuple(range(1, 17))   # q heads per kv head per rank: one or two tiles of 8
SUPPORTED_PAGE_SIZES = (16, 32, 64)
# bf16: bf16 fragments and mma; fp8_e4m3: the bytes converted to f16 fragments, the f16 mma.
SUPPORTED_KV_DTYPES = ("bf16", "fp8_e4m3")
MAX_STAGES = 8                         # ring slots per warp (__post_init__'s bound)

# Registers a lane may spend on the slice's K / V fragments, the O
# accumulators and q (of 255 on sm_90; the rest: softmax state, addresses,
# the ring pipeline): 160 is GQA 16 at head_dim 128 (64 + 64 + 32), the
# largest shape that compiles spill-free with both K and V held at once.
FRAGMENT_REGISTERS = 160
# Windows up to this many slices (496 tokens: 31 slices + 1 for an unaligned
# start) count as "short": the cluster design was measured with window 128
# (8-9 slices). Longer windows use the full-attention rule.
SHORT_WINDOW_MAX_PAGES = 32
# Short windows of one split per pair, more pairs than SMs but at most two
# per SM: 2 ring slots and at most 2 CTAs per SM (launch_config).
SHORT_WINDOW_CTAS_PER_SM = 2
# Active splits from which 4 CTAs merge a pair's 8-head partials (fewer: the
# last CTA alone); measured crossover 32..48 (launch_config).
MERGE_FROM_ACTIVE = 40


@dataclass(frozen=True)
class DecodeAttentionConfig:
    num_splits: int
    num_warps: int
    num_stages: int
    min_pages: int
    cluster: bool
    # At most this many CTAs per SM (0: no cap), enforced by padding shared
    # memory: with PDL the next grid's CTAs launch while this one drains and
    # would otherwise pile up on the first SMs to free up (seed's comment).
    ctas_per_sm: int
    # The shape the sizes below are for (not launch choices: the variant
    # carries them separately, ``as_params`` leaves them out).
    head_dim: int = 128
    gqa: int = 8
    # CTAs that merge a pair's split partials (the last ones to arrive; each
    # takes tile_heads / merge_ctas heads). 1: the last CTA alone.
    merge_ctas: int = 1
    # With merge_ctas > 1: several CTAs merge only when at least this many
    # splits are active (a runtime count: it grows with seq_len); below it the
    # last CTA alone merges (the few partials of a short context are a
    # latency chain, not one SM's bandwidth). 0: always.
    merge_from: int = 0
    # The cache's element type (a shape field like head_dim): "bf16" or
    # "fp8_e4m3" (half the slice bytes; the same fragment registers).
    kv_dtype: str = "bf16"
    # Release PDL dependents at the kernel's entry (else once this CTA's K/V
    # streaming is done): the next launch's CTAs then take each SM slot as it
    # frees and prefetch their leading slices before their grid-dependency
    # wait. None: the rule, every launch but clusters. Sweep run 19
    # (2026-12-03, H200, interleaved passes; results/decode_attention_sweep.md):
    # 64/8 d128 B=32 window 128 fp8 5.87 -> 5.06 us, gpt-oss d64 B=64 window
    # 128 fp8 5.70 -> 5.08, 16/2 B=8 x 8k bf16 20.10 -> 19.68, B=1 x 1k 5.34
    # -> 5.15, bandwidth rows equal or up to 0.7 % faster; clusters slower
    # (16/2 B=8 window 128, 4-CTA clusters: bf16 3.22 -> 3.32, fp8 3.32 ->
    # 3.71): their peers must all be resident before any DSMEM store.
    early_release: bool | None = None
    # Bulk-copy the K/V slices with the L2 evict-first policy: each is read
    # once per launch, so it leaves L2 before what is read again (the split
    # partials the merge reads back, block tables, q, the next layer's
    # weights). Measured (decode_attention_sweep.md run 23, H100, 5 passes,
    # caches rotated beyond L2): 16/2 B=8 x 8k 25.65 -> 25.37 us, 64/8 B=32
    # window 128 7.22 -> 7.11, B=1 x 1k and both B=128 x 8k rows level
    # (+-0.1 / 0.7 us): selected by no rule yet (a rule changes every
    # production binary; their GPU tests have not run with it).
    kv_evict_first: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kv_evict_first, bool):
            raise TypeError(f"DecodeAttentionConfig.kv_evict_first = {self.kv_evict_first!r} must be a bool")
        if self.early_release is None:
            object.__setattr__(self, "early_release", not self.cluster)
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps = {self.num_warps} is not supported: the epilogue maps "
                             f"{self.tile_heads} heads x {self.head_dim} dims onto 4 or 8 warps")
        if self.kv_parts > 2 or (self.kv_parts == 2 and self.layout.num_tiles > 1):
            raise ValueError(f"{self} needs {self.kv_parts} K / V parts with {self.layout.num_tiles} head "
                             f"tiles: only one tile streams K and V in turn")
        if not 2 <= self.num_stages <= 8:
            raise ValueError(f"num_stages = {self.num_stages}: supported are 2..8 ring slots per warp")
        if self.num_splits < 1 or self.min_pages < 1 or self.ctas_per_sm < 0:
            raise ValueError(f"invalid decode-attention config {self}")
        th, d = self.tile_heads, self.head_dim
        e = th * d / (32 * self.num_warps)
        if e != int(e) or int(e) % 2 or e < 4 or d % int(e):
            raise ValueError(f"{self.num_warps} warps give {e:g} dims per thread for {th} heads x {d} "
                             "dims; the epilogue needs an even number >= 4 that divides the head dim "
                             "(8- or 16-byte partial stores): use fewer warps")
        if self.ring_bytes > SMEM_PER_CTA_MAX - 4096:
            raise ValueError(f"ring of {self.ring_bytes} B does not fit one CTA's shared memory")
        if self.scratch_bytes > self.ring_bytes:
            raise ValueError(f"{self.num_splits} splits need {self.scratch_bytes} B of epilogue "
                             f"scratch, more than the {self.ring_bytes} B ring it reuses")
        if self.merge_from < 0 or (self.merge_from and self.merge_ctas == 1):
            raise ValueError(f"merge_from = {self.merge_from} needs merge_ctas > 1 and must be >= 0 "
                             f"(0: several CTAs always merge), got {self}")
        if self.merge_ctas != 1:
            th, threads = self.tile_heads, 32 * self.num_warps
            m = self.merge_ctas
            if (not self.uses_partials or m not in (2, 4, 8) or th % m
                    or (th // m * d) % threads or th // m * d // threads not in (1, 2, 4)):
                raise ValueError(f"merge_ctas = {m} needs global split partials and {th} heads x {d} dims "
                                 f"split into {m} groups of 1, 2 or 4 dims per thread of {threads}, got {self}")
        if self.cluster:
            # Rank r merges head dims [r * D / splits, ...): the slice must hold
            # whole per-thread chunks of E dims and split evenly over the CTA.
            dpr = d // max(self.num_splits, 1)
            e = self.dims_per_thread
            if (self.num_splits not in (2, 4, 8) or dpr % e or (th * dpr) % (32 * self.num_warps)):
                raise ValueError(f"cluster merge needs 2, 4 or 8 splits whose {d} / splits dims per rank "
                                 f"x {th} heads cover the CTA's threads evenly, got {self}")
            if self.ring_bytes + 4 * self.cluster_floats > SMEM_PER_CTA_MAX - 4096:
                raise ValueError(f"ring + cluster buffer of {self} do not fit one CTA's shared memory")

    @property
    def layout(self) -> AttentionLayout:
        """q tile and KV slices of the shape (one query token, ``kv_dtype`` cache)."""
        return AttentionLayout(head_dim=self.head_dim, gqa=self.gqa, kv_dtype=self.kv_dtype)

    @property
    def tile_heads(self) -> int:
        """q heads computed per kv head: whole mma tiles, GQA padded up."""
        return self.layout.tile_rows

    @property
    def slice_bytes(self) -> int:
        return self.layout.slice_bytes

    @property
    def ring_bytes(self) -> int:
        return self.num_warps * self.num_stages * self.slice_bytes

    @property
    def kv_parts(self) -> int:
        """1: a lane holds a slice's K and V fragments at once; 2: K, then V in
        the same registers (when both, the accumulators and q would pass
        FRAGMENT_REGISTERS: head_dim 256). The fragments are 16-bit pairs
        whatever the cache (an e4m3 slice is converted to f16 pairs): D / 2
        words of K and V per lane."""
        lay = self.layout
        frag = SLICE_TOKENS * 2 * self.head_dim // (2 * 32)
        words = frag + lay.tile_rows * self.head_dim // 32 + lay.tile_rows * self.head_dim // 64
        return 1 if words <= FRAGMENT_REGISTERS else 2

    @property
    def dims_per_thread(self) -> int:
        """Epilogue: consecutive dims of one head per thread (TH heads x D dims)."""
        return self.tile_heads * self.head_dim // (32 * self.num_warps)

    @property
    def scratch_bytes(self) -> int:
        th = self.tile_heads
        warp = th * self.head_dim + 2 * th
        return 4 * (self.num_warps * warp + 2 * th * self.num_splits + 2 * th)

    @property
    def cluster_floats(self) -> int:
        """DSMEM merge buffer per rank: every split's O slice, m and l."""
        return self.tile_heads * self.head_dim + 2 * self.tile_heads * self.num_splits if self.cluster else 0

    @property
    def merge_dims(self) -> int:
        """Consecutive dims per thread when ``merge_ctas`` CTAs merge."""
        return self.tile_heads // self.merge_ctas * self.head_dim // (32 * self.num_warps)

    @property
    def uses_partials(self) -> bool:
        """Whether launches write global fp32 split partials + arrival counters."""
        return self.num_splits > 1 and not self.cluster

    def as_params(self) -> dict:
        return {"num_splits": self.num_splits, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "min_pages": self.min_pages,
                "cluster": self.cluster, "ctas_per_sm": self.ctas_per_sm, "merge_ctas": self.merge_ctas,
                "merge_from": self.merge_from, "early_release": self.early_release,
                # the default stays out of the params (and the names of the binaries built before it)
                **({"kv_evict_first": True} if self.kv_evict_first else {})}


def check_supported(*, head_dim: int, gqa: int, page_size: int, kv_dtype: str = "bf16") -> None:
    """Raise NotImplementedError for shapes this kernel does not handle."""
    if head_dim == 256 and gqa > HEAD_TILE:
        raise NotImplementedError(
            f"decode_attention: head_dim = 256 with GQA {gqa} is not supported (supported: GQA 1..{HEAD_TILE} "
            f"at head_dim 256): register budget. Two head tiles put 128 fp32 O accumulators and 64 u32 of q "
            "in every lane besides a slice's K or V fragments, more than the 255 registers of an sm_90 "
            "thread. Use a spec with at most "
            f"{HEAD_TILE} q heads per kv head on a rank at head_dim 256 (every Gemma has 2-4), or build the "
            "other kernels alone (--kernel)."
        )
    for name, value, ok, why in (
        ("head_dim", head_dim, SUPPORTED_HEAD_DIMS,
         "the mma fragment layouts cover whole 64-dim groups and one trailing 32-dim group, up to 256"),
        ("GQA (q heads per kv head per rank)", gqa, SUPPORTED_GQA,
         f"q heads are the mma's {HEAD_TILE} columns: up to 8 fill one tile, 9-16 two, padded; more "
         "needs a third tile (split the kv heads over more ranks)"),
        ("page_size", page_size, SUPPORTED_PAGE_SIZES, f"pages are streamed as {SLICE_TOKENS}-token slices"),
        ("kv_cache_dtype", kv_dtype, SUPPORTED_KV_DTYPES,
         "the mma fragments are bf16 pairs, or f16 pairs converted from e4m3 (fp8_e5m2 and int8 need "
         "other conversions)"),
    ):
        if value not in ok:
            raise NotImplementedError(
                f"decode_attention: {name} = {value} is not supported (supported: {list(ok)}; {why}). "
                "Use a spec with a supported value."
            )


def is_short_window(window: int | None, page_size: int = SLICE_TOKENS) -> bool:
    """Whether a window spans at most SHORT_WINDOW_MAX_PAGES slices of
    SLICE_TOKENS (``page_size`` is accepted for callers but does not matter:
    work is distributed in slices)."""
    return window is not None and -(-window // SLICE_TOKENS) + 1 <= SHORT_WINDOW_MAX_PAGES


def _fit_cluster(splits: int, stages: int, head_dim: int, gqa: int) -> DecodeAttentionConfig:
    """The largest cluster <= ``splits`` whose DSMEM merge mapping fits the
    shape. head_dim 64 with 8 heads: 8 ranks would own 8 dims x 8 heads = 64
    values for 128 threads, so 4 ranks (16 dims each); with a 9-slice window
    16 warps still give every warp at most one slice, the latency of 8 ranks."""
    while True:
        try:
            return DecodeAttentionConfig(splits, 4, stages, 1, True, 0, head_dim, gqa)
        except ValueError:
            if splits <= 2:
                raise
            splits //= 2


def launch_config(*, batch: int, num_kv_heads: int, sliding: bool, window: int | None,
                  head_dim: int, gqa: int, page_size: int, num_sms: int,
                  kv_dtype: str = "bf16") -> DecodeAttentionConfig:
    """The configuration for a static batch size: the bf16 rule
    (``_launch_config_bf16``), adjusted for an fp8 cache (``_fp8_by_bytes``)."""
    check_supported(head_dim=head_dim, gqa=gqa, page_size=page_size, kv_dtype=kv_dtype)
    cfg = _launch_config_bf16(batch=batch, num_kv_heads=num_kv_heads, sliding=sliding, window=window,
                              head_dim=head_dim, gqa=gqa, page_size=page_size, num_sms=num_sms)
    if kv_dtype == "bf16":
        return cfg
    return _fp8_by_bytes(cfg, kv_dtype, sliding, pairs=batch * num_kv_heads, num_sms=num_sms)


# (head_dim, GQA) whose fp8 sliding kernels keep bf16's ring slots (``_fp8_by_bytes``).
FP8_SLIDING_KEEP_BF16_SLOTS = frozenset({(64, 1), (64, 7)})
# CTAs per SM of fp8 head_dim-64 single-split launches (``_fp8_by_bytes``).
FP8_D64_CTAS_PER_SM = 4


def _fp8_by_bytes(cfg: DecodeAttentionConfig, kv_dtype: str, sliding: bool,
                  pairs: int = 1, num_sms: int = 132) -> DecodeAttentionConfig:
    """The bf16 choice ``cfg`` for a cache of 1-byte elements (half the slice
    bytes, the same fragment registers); ``pairs``: the launch's (request, kv
    head) pairs. H200, fp8 e4m3, sweep run 16
    (results/decode_attention_sweep.md):

    * stages: bf16's (fewer bytes in flight; bandwidth rows do not need
      more): 64/8 d128 B=128 x 8k 3 / 4 / 5 slots 528.7 / 525.3 / 528.3 us,
      8 slots 719 (one CTA per SM left); 16/2 d128 B=128 x 8k 3 / 4 / 6:
      131.8 / 133.4 / 134.1; gpt-oss 64/8 d64 B=64 x 8k 3 / 4 / 6 / 8:
      164.6 / 164.9 / 166.9 / 171.6.
    * sliding windows: one slot fewer, at least 2 (latency-bound: a smaller
      ring leaves room for more CTAs per SM): 64/8 d128 B=32 window 128
      2 / 3 / 4 slots 6.19 / 6.87 / 6.94 us, gpt-oss 64/8 d64 B=64 window
      128 5.67 / 6.32 / 6.44. Except FP8_SLIDING_KEEP_BF16_SLOTS (head_dim,
      GQA): their 2-slot single-split kernel spills (ptxas, sm_90a: 8 bytes
      of stack at 80 registers; 3 and 4 slots compile clean), so they keep
      bf16's slots, at least 3 for one split.
    * splits, warps, min_pages and the merges: bf16's (64/8 B=128: 2 splits
      537 us, 8 warps 540 against 525; window 128: 8 warps 8.34, 2-CTA
      clusters 9.67 against 7.03).
    * more slots where the epilogue's scratch (which reuses the ring) needs
      them: up to bf16's ring bytes (twice its slots), which always fit.
    * head_dim 64, one head tile, one split per pair with two CTAs per SM,
      more than one wave of them (> 2 x num_sms pairs): 4 CTAs per SM of 2 slots
      (``FP8_D64_CTAS_PER_SM``). A 2 KB slice gives a warp half a bf16
      slice's bytes for the same MMAs and the conversions, so two CTAs per
      SM are latency-bound where bf16 reads at the floor. Sweep run 17
      (2026-12-03), gpt-oss 64/8 d64 B=64 x 8k (512 pairs): 2 per SM 166.5
      (6 slots) / 164.1 (3); 4 per SM 136.9 (2) / 138.8 (3) / 138.4 (4);
      3 per SM 211-214 (1.3 waves); no cap, 3 slots, 144.7 us. 3 slots for
      FP8_SLIDING_KEEP_BF16_SLOTS' long windows (their 2-slot binary spills
      here too: 8 bytes at 80 registers). Not at
      head_dim 128 (64/8 d128 B=128 x 8k: 3 or 4 per SM 547 against 522).
    """
    waves_at_two = -(-pairs // (2 * num_sms))
    if (cfg.head_dim == 64 and cfg.layout.num_tiles == 1 and cfg.num_splits == 1 and cfg.ctas_per_sm == 2
            and not cfg.cluster and waves_at_two > 1):
        keep = sliding and (cfg.head_dim, cfg.gqa) in FP8_SLIDING_KEEP_BF16_SLOTS   # their 2-slot binary spills
        return replace(cfg, kv_dtype=kv_dtype, num_stages=3 if keep else 2, ctas_per_sm=FP8_D64_CTAS_PER_SM)
    stages = cfg.num_stages
    if sliding and (cfg.head_dim, cfg.gqa) in FP8_SLIDING_KEEP_BF16_SLOTS:
        stages = max(3, stages) if cfg.num_splits == 1 else stages    # their 2-slot single-split binary spills
    elif sliding:
        stages = max(2, stages - 1)
    while True:
        try:
            return replace(cfg, kv_dtype=kv_dtype, num_stages=stages)
        except ValueError:
            if stages >= 2 * cfg.num_stages:
                raise
            stages += 1


def _launch_config_bf16(*, batch: int, num_kv_heads: int, sliding: bool, window: int | None,
                        head_dim: int, gqa: int, page_size: int, num_sms: int) -> DecodeAttentionConfig:
    """The configuration of a bf16 cache for a static batch size (launch shape depends on it alone).

    ``window``: the spec's sliding-window length (used only when ``sliding``).
    ``gqa``: q heads per kv head *per rank*. Page size never changes the
    choice: the unit of work is the 16-token slice whatever the page. GQA 4
    gets the GQA-8 choice of its head_dim (its 4 heads pad one 8-column tile:
    the same work); GQA 9-16 stream the same bytes with partials of twice the
    heads. Each band's rule below carries its latest measurement (H200,
    CUDA-graph replay; decode_attention_sweep.md); how the rules got here:
    benchmarks/results/history/decode_attention_config.md.
    """
    check_supported(head_dim=head_dim, gqa=gqa, page_size=page_size)
    if batch < 1 or num_kv_heads < 1 or num_sms < 1:
        raise ValueError(f"batch={batch}, num_kv_heads={num_kv_heads}, num_sms={num_sms} must be >= 1")
    num_bh = batch * num_kv_heads
    if sliding and is_short_window(window):
        return _short_window(num_bh, num_sms, head_dim, gqa)
    if head_dim == 64:
        return _full_attention_d64(num_bh, num_sms, gqa)
    if head_dim == 96:
        return _full_attention_d96(num_bh, num_sms, gqa)
    if head_dim == 256:
        return _full_attention_d256(num_bh, num_sms, gqa)
    return _full_attention_d128(num_bh, num_sms, gqa)


def _short_window(num_bh: int, num_sms: int, head_dim: int, gqa: int) -> DecodeAttentionConfig:
    """A window of at most SHORT_WINDOW_MAX_PAGES slices (128 tokens: 8-9), too
    little work per (request, kv head) pair to split through global memory.

    * <= 8 pairs: the pair's splits form a cluster of 8 CTAs (one slice per
      warp, 2 slots) merging in DSMEM (_fit_cluster shrinks it where the merge
      mapping needs); <= 16 pairs: clusters of 4, 3 slots (16/2 B=8 window
      128, 16 pairs: 3.22 us; releasing dependents at entry is slower there,
      3.32; sweep run 19); <= 64 pairs, while the clusters fit one wave
      (2 x pairs <= num_sms): clusters of 2. Sweep runs 20 / 21 (interleaved
      passes), 16/2 d128 window 128, 2- / 4-CTA clusters / one split per pair:
      B = 12 (24 pairs) 3.23 / 3.41 / 3.31 us; B = 24 (48) 3.41 / 4.37 / 3.59,
      fp8 3.47 / 5.29 / 3.53; B = 32 (64) 3.46 / 6.80 / 3.52, fp8 3.58 / 5.37 /
      3.96; B = 33 (66) 3.60 / 7.21 / 3.38: one split per pair from there.
    * More pairs: one CTA per pair. One to two pairs per SM: 2 ring slots, at
      most SHORT_WINDOW_CTAS_PER_SM CTAs per SM (uncapped, the block
      scheduler puts 0 to 3 of the window's CTAs on an SM and the kernel ends
      with its slowest SM; a third slot is slower with or without the cap).
      Sweep run 19 (six interleaved passes, dependents released at entry),
      64/8 d128 B=32 window 128 (256 pairs), slots / cap: bf16 2 / 2 5.56 us,
      3 / 2 6.22, 3 / none 6.23, 2 / none 6.32; fp8 2 / 2 5.19, 3 / 2 5.56,
      3 / none 5.81, 2 / none 5.84. Beyond two per SM: 3 slots, uncapped.

    The slice count of a window does not depend on head_dim: every head_dim
    takes these bands.
    """
    if num_bh <= 8:
        return _fit_cluster(8, 2, head_dim, gqa)
    if num_bh <= 16:
        return _fit_cluster(4, 3, head_dim, gqa)
    if num_bh <= 64 and 2 * num_bh <= num_sms:
        return _fit_cluster(2, 3, head_dim, gqa)
    if num_bh <= 2 * num_sms and num_bh > num_sms:
        return DecodeAttentionConfig(num_splits=1, num_warps=4, num_stages=2, min_pages=1, cluster=False,
                                     ctas_per_sm=SHORT_WINDOW_CTAS_PER_SM, head_dim=head_dim, gqa=gqa)
    return DecodeAttentionConfig(num_splits=1, num_warps=4, num_stages=3, min_pages=1, cluster=False,
                                 ctas_per_sm=0, head_dim=head_dim, gqa=gqa)


def _full_attention_d128(num_bh: int, num_sms: int, gqa: int) -> DecodeAttentionConfig:
    """Full attention (and windows past the short band) at head_dim 128 (8 KB
    slices): a pair's slices are split over the SMs. 16/2 heads unless named;
    results tables: decode_attention.md, decode_attention_shapes.md.

    * <= 8 pairs: one 8-warp CTA per SM (num_sms // pairs splits), 2 slots,
      min_pages 1. 16/2 B=1 L = 1k / 32k 5.15 / 10.58 us (sweep run 19);
      64/8 B=1 L=32k 34.94. More than MERGE_FROM_ACTIVE (40) splits: the last
      4 CTAs to arrive merge a group of heads each once that many splits are
      active (merge_from; a runtime count that grows with seq_len: below it
      the last CTA alone). Sweep run 10, 16/2 B=1 (66 splits) at 8 / 16 / 32
      / 48 / 64 / 66 active: alone 5.42 / 5.91 / 6.21 / 7.17 / 7.29 / 11.45
      us, 4 always 6.23 / 6.48 / 6.67 / 6.65 / 6.82 / 10.68.
    * Two head tiles (GQA 9-16) at <= 8 pairs: the same splits, 4 merging
      CTAs whenever there are 2+ splits (16-head partials make one merging
      SM the bound). 32/2 B=1 L = 1k / 8k / 32k 8.68 / 10.52 / 15.27 us
      against 7.64 / 11.58 / 20.49 with 33 splits and one merger (sweep runs
      6-7).
    * 9..16 pairs (two tiles: while num_sms // pairs >= 2): 8-warp CTAs, one
      per SM, 2 slots; min_pages 1 up to 16 pairs, else 2. 16/2 B=8 L = 1k /
      8k 5.47 / 20.30 us against 6.26 / 20.25 with min_pages 2 (sweep run
      14), 19.68 at 8k with dependents released at entry (run 19).
    * More pairs: two 4-warp CTAs per SM (2 num_sms // pairs splits), 3
      slots, min_pages 2: B=128 x 8k at 100 % (16/2) and 103 % (64/8) of
      the read floor (decode_attention.md).
    """
    two_tiles = AttentionLayout(head_dim=128, gqa=gqa).num_tiles > 1
    per_sm = max(1, num_sms // num_bh)
    if num_bh <= 8 and two_tiles:
        return DecodeAttentionConfig(num_splits=per_sm, num_warps=8, num_stages=2, min_pages=1, cluster=False,
                                     ctas_per_sm=1, head_dim=128, gqa=gqa, merge_ctas=4 if per_sm >= 2 else 1)
    if num_bh <= 8:
        merge = dict(merge_ctas=4, merge_from=MERGE_FROM_ACTIVE) if per_sm > MERGE_FROM_ACTIVE else {}
        return DecodeAttentionConfig(num_splits=per_sm, num_warps=8, num_stages=2, min_pages=1, cluster=False,
                                     ctas_per_sm=1, head_dim=128, gqa=gqa, **merge)
    if num_bh <= 16 or (two_tiles and per_sm >= 2):
        return DecodeAttentionConfig(num_splits=per_sm, num_warps=8, num_stages=2,
                                     min_pages=1 if num_bh <= 16 else 2, cluster=False, ctas_per_sm=1,
                                     head_dim=128, gqa=gqa)
    return DecodeAttentionConfig(num_splits=max(1, 2 * num_sms // num_bh), num_warps=4, num_stages=3, min_pages=2,
                                 cluster=False, ctas_per_sm=2, head_dim=128, gqa=gqa)


def _full_attention_d64(num_bh: int, num_sms: int, gqa: int) -> DecodeAttentionConfig:
    """head_dim 64: the head_dim-128 rule above re-derived for 4 KB slices,
    keeping what it keeps per SM and per warp (the derivation below; its
    results against the floor and the peers: decode_attention_gpt_oss.md).

    * Warps per pair and per SM: the 8-warp, one-CTA-per-SM choice at <= 8
      pairs would leave 2 epilogue dims per thread (8 heads x 64 dims over 256
      threads), so it becomes two 4-warp CTAs per SM with twice the splits:
      the same 8 warps per SM and per pair.
    * Bytes in flight: stages double (2 -> 4, 3 -> 6) so that a warp's ring
      holds the same bytes (16 / 24 KB) as with 8 KB slices; per SM that is
      the measured 128 KB (small batch) and 192 KB (large batch).
    * min_pages 1 in every band, measured (sweep runs 13-15, 2026-12-01;
      derived first as 4, the bytes of head_dim 128's 2 slices): gpt-oss
      64/8 B=2 (16 pairs, 16 splits) L = 1k / 8k 4.33 / 10.42 us vs 6.31 /
      10.42 with 4; B=4 (32 pairs, 8 splits) 5.27 / 20.45 vs 6.47 / 20.09;
      SmolLM2 32/32 B=1 L = 1k / 8k / 32k 4.96 / 20.38 / 66.98 vs 6.18 /
      20.12 / 67.08 (1.2 us won at 1k against 0.3 lost at 8k).

    Measured exceptions: a single pair (gpt-oss at TP 8, batch 1) takes
    num_sms // 2 splits of 6 stages, not 2 * num_sms. One CTA merges all of a
    pair's partials, so the merge grows with the active splits (264 x 2 KB at
    L=32k); H200 sweep, 8/1 heads, B=1, L = 1k / 8k / 32k: 264 x 4 stages
    5.28 / 9.10 / 15.38 us, 132 x 4 4.28 / 8.35 / 10.54, 66 x 6 4.02 / 6.67 /
    9.62 (benchmarks/results/decode_attention_sweep.md).

    GQA 16 at <= 8 pairs follows the same measured trade (twice the partial
    bytes per split): num_sms // (2 pairs) splits of 6 stages; 32 q / 2 kv,
    B=1, L = 1k / 8k / 32k: 33 x 6 stages 5.55 / 8.55 / 15.98 us, 66 x 4
    6.11 / 10.80 / 14.47, 132 x 4 8.49 / 16.29 / 19.37 (sweep run 5; XQA
    10.31 at 8k).
    """
    two_tiles = AttentionLayout(head_dim=64, gqa=gqa).num_tiles > 1
    if num_bh == 1 or (two_tiles and num_bh <= 8):
        return DecodeAttentionConfig(max(1, num_sms // (2 * num_bh)), 4, 6, 1, False, 2, 64, gqa)
    splits = max(1, 2 * num_sms // num_bh)
    if num_bh <= 8:
        return DecodeAttentionConfig(splits, 4, 4, 1, False, 2, 64, gqa)
    if splits == 2:
        # 67..88 pairs: 3 splits, not 2. The 2-split binary spills at 72
        # registers (8-40 bytes) for most stage counts and page sizes (CuTe
        # DSL 4.8.1 / ptxas, sm_90a; 3 splits compile clean at 80-90:
        # tests/test_decode_attention_grid.py). 264 CTAs still fit one wave.
        splits = 3
    return DecodeAttentionConfig(splits, 4, 4 if num_bh <= 16 else 6, 1, False, 2, 64, gqa)


def _merge_by_four(num_splits: int, head_dim: int, gqa: int, num_warps: int) -> dict:
    """merge_ctas = 4 from MERGE_FROM_ACTIVE active splits when the launch has
    more splits than that and the merge mapping fits the shape (head_dim 96
    splits into no whole 1, 2 or 4 dims per thread: the last CTA alone)."""
    if num_splits <= MERGE_FROM_ACTIVE:
        return {}
    th = AttentionLayout(head_dim=head_dim, gqa=gqa).tile_rows
    per_thread = th // 4 * head_dim / (32 * num_warps)
    return dict(merge_ctas=4, merge_from=MERGE_FROM_ACTIVE) if per_thread in (1, 2, 4) else {}


def _full_attention_d96(num_bh: int, num_sms: int, gqa: int) -> DecodeAttentionConfig:
    """head_dim 96 (6 KB slices). 8 heads x 96 dims over 8 warps would leave
    3 epilogue dims per thread, so every band takes 4-warp CTAs; no several-CTA
    merge (96 dims split into no whole 1, 2 or 4 per thread of 4 merging CTAs).
    Measured (benchmarks/results/decode_attention_sweep.md runs 13-14,
    2026-12-01, Phi-3-mini's 32 heads per kv head group of 1 at TP 1 / 2 / 4):

    * <= 8 pairs, one tile: num_sms // pairs splits of 4 stages, one CTA per
      SM. 8/8 heads B=1 L = 1k / 32k: 16 x 4 stages 3.82 / 27.25 us against
      the derived 33 x 3 stages, two per SM, 4.43 / 28.60 (16 x 3, two per SM:
      3.72 / 35.07). One pair (132 splits, one merging CTA) is unmeasured.
    * 9..16 pairs: two CTAs per SM (2 * num_sms // pairs splits), 3 stages,
      min_pages 1: 16/16 B=1 L = 1k / 32k 4.38 / 50.48 us against 6.73 /
      50.19 with the derived min_pages 3.
    * above 16 pairs: 4 stages, min_pages 1: 32/32 B=1 L = 1k / 8k / 32k
      5.95 / 27.93 / 96.75 us against 7.54 / - / 97.41 with min_pages 3 (2:
      5.94 / 27.97 / 95.96).
    * two tiles (GQA 9-16) at <= 8 pairs: half the splits (head_dim 64's
      measured trade for partials of 16 heads); no model has that shape at
      head_dim 96: unmeasured.
    """
    splits = max(1, 2 * num_sms // num_bh)
    if num_bh <= 8 and AttentionLayout(head_dim=96, gqa=gqa).num_tiles > 1:
        return DecodeAttentionConfig(max(1, num_sms // (2 * num_bh)), 4, 4, 1, False, 2, 96, gqa)
    if num_bh <= 8:
        return DecodeAttentionConfig(max(1, num_sms // num_bh), 4, 4, 1, False, 1, 96, gqa)
    if num_bh <= 16:
        return DecodeAttentionConfig(splits, 4, 3, 1, False, 2, 96, gqa)
    return DecodeAttentionConfig(splits, 4, 4, 1, False, 2, 96, gqa)


def _full_attention_d256(num_bh: int, num_sms: int, gqa: int) -> DecodeAttentionConfig:
    """head_dim 256 (16 KB slices, K and V held in turn): one 4-warp CTA per
    SM (num_sms // pairs splits), min_pages 1 (a 16 KB slice streams the
    bytes of two 8 KB ones); 2 stages up to 16 pairs, then 3. Derived by
    bytes from the head_dim-128 rule and measured (sweep run 13, 2026-12-01):

    * 1 pair (Gemma-3-1B 4/1, B=1): 132 splits with 4 CTAs merging from 40
      active, L = 1k / 8k / 32k 6.64 / 9.43 / 13.66 us; 66 splits 6.43 / 9.06 /
      17.38, 33 6.46 / 12.47 / 29.17, 132 with the last CTA alone 6.98 / 17.37
      / 21.99.
    * 8 pairs (Gemma-2-9B 16/8 B=1; Gemma-3 B=8): 16 splits of 2 stages, L =
      1k / 32k 6.59 / 65.62 us (3 stages 6.56 / 66.55, 8 splits 6.75 / 94.50,
      33 two per SM 6.40 / 80.43); window 4096 at 32k 10.66 (next best 11.30);
      Gemma-3 B=8 L=8k 21.82 (3 stages 22.10, 8 splits 27.69).
    * 64 pairs (Gemma-2 B=8 L=8k): 2 splits, 3 stages 124.54 us, 2 stages
      124.75, 1 split 180.48. Gemma-3 window 1024 at 32 pairs: 4 splits, 3
      stages 10.56 us (2 stages 10.13, 2 splits 14.89).
    """
    splits = max(1, num_sms // num_bh)
    if num_bh <= 16:
        return DecodeAttentionConfig(splits, 4, 2, 1, False, 1, 256, gqa, **_merge_by_four(splits, 256, gqa, 4))
    return DecodeAttentionConfig(splits, 4, 3, 1, False, 1, 256, gqa)


def all_configs(*, max_batch: int, num_kv_heads: int, sliding: bool, window: int | None,
                head_dim: int, gqa: int, page_size: int, num_sms: int,
                kv_dtype: str = "bf16") -> dict[int, DecodeAttentionConfig]:
    """batch -> config for batch 1..max_batch."""
    return {b: launch_config(batch=b, num_kv_heads=num_kv_heads, sliding=sliding, window=window,
                             head_dim=head_dim, gqa=gqa, page_size=page_size, num_sms=num_sms,
                             kv_dtype=kv_dtype)
            for b in range(1, max_batch + 1)}


def max_partials(configs: dict[int, DecodeAttentionConfig], num_kv_heads: int) -> int:
    """Split partials (one per (request, kv head, split)) the workspace must hold."""
    return max([b * num_kv_heads * c.num_splits for b, c in configs.items() if c.uses_partials] or [0])
