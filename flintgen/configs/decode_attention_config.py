"""Launch configuration of split-KV paged decode attention (cute-free).

Provenance: the rule in ``launch_config`` is the hand-written Flint kernel's
``_launch_config`` (the design page, shared/seeds/000_*.txt), tuned there on an
H200 (132 SMs) for Flint's 4 kv heads, GQA 8, head_dim 128, 16-token pages and
a 128-token window. It is restated here in (request, kv head) pairs, so for 4
kv heads it picks exactly what the seed picks; other head counts and long
windows are extrapolations, marked as such below, not measurements.

Terms: a *split* is one CTA of a (request, kv head); its ``num_warps`` warps
each stream whole 8 KB pages (16 tokens x [K | V]) through a private ring of
``num_stages`` bulk-copy slots. ``min_pages``: a split is active only when
each of its warps gets at least that many pages. ``cluster``: the splits of a
(request, kv head) form a thread-block cluster and merge through distributed
shared memory instead of global fp32 partials + a last-CTA merge.
"""

from __future__ import annotations

from dataclasses import dataclass

# What this kernel generation handles; a later issue generalizes these.
SUPPORTED_HEAD_DIMS = (128,)
SUPPORTED_GQA = (8,)
SUPPORTED_PAGE_SIZES = (16,)

PAGE_BYTES = 16 * 2 * 128 * 2          # 16 tokens x (K | V) x 128 dims x bf16 = 8 KB
SMEM_PER_SM = 228 * 1024               # H100/H200 shared memory per SM
SMEM_PER_CTA_MAX = 227 * 1024          # opt-in maximum of one CTA
# Epilogue scratch reuses the ring: per warp 8 heads x 128 dims of partial O
# plus m[8], l[8] (fp32), then the split merge's m/l table.
WARP_SCRATCH_FLOATS = 8 * 128 + 16
# Windows up to this many pages (496 tokens at page 16: 31 pages + 1 for an
# unaligned start) count as "short": the cluster design was measured with
# window 128 (8-9 pages). Longer windows use the full-attention rule.
SHORT_WINDOW_MAX_PAGES = 32
MAX_CLUSTER = 8                        # portable thread-block cluster size


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

    def __post_init__(self) -> None:
        if self.num_warps not in (4, 8):
            raise ValueError(f"num_warps = {self.num_warps} is not supported: the epilogue maps "
                             "8 heads x 128 dims onto 4 or 8 warps (8 or 4 dims per thread)")
        if not 2 <= self.num_stages <= 4:
            raise ValueError(f"num_stages = {self.num_stages}: supported are 2..4 ring slots per warp")
        if self.num_splits < 1 or self.min_pages < 1 or self.ctas_per_sm < 0:
            raise ValueError(f"invalid decode-attention config {self}")
        if self.ring_bytes > SMEM_PER_CTA_MAX - 4096:
            raise ValueError(f"ring of {self.ring_bytes} B does not fit one CTA's shared memory")
        if self.scratch_bytes > self.ring_bytes:
            raise ValueError(f"{self.num_splits} splits need {self.scratch_bytes} B of epilogue "
                             f"scratch, more than the {self.ring_bytes} B ring it reuses")
        if self.cluster:
            # Rank r merges head dims [r * 128 / splits, ...): the slice must hold
            # whole per-thread chunks of E dims and split evenly over the CTA.
            dpr = 128 // max(self.num_splits, 1)
            e = self.dims_per_thread
            if (self.num_splits not in (2, 4, 8) or dpr % e or (8 * dpr) % (32 * self.num_warps)):
                raise ValueError(f"cluster merge needs 2, 4 or 8 splits with 4 warps, got {self}")

    @property
    def ring_bytes(self) -> int:
        return self.num_warps * self.num_stages * PAGE_BYTES

    @property
    def dims_per_thread(self) -> int:
        """Epilogue: consecutive dims of one head per thread (8 heads x 128 dims)."""
        return 1024 // (32 * self.num_warps)

    @property
    def scratch_bytes(self) -> int:
        return 4 * (self.num_warps * WARP_SCRATCH_FLOATS + 16 * self.num_splits + 16)

    @property
    def uses_partials(self) -> bool:
        """Whether launches write global fp32 split partials + arrival counters."""
        return self.num_splits > 1 and not self.cluster

    def as_params(self) -> dict:
        return {"num_splits": self.num_splits, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "min_pages": self.min_pages,
                "cluster": self.cluster, "ctas_per_sm": self.ctas_per_sm}


def check_supported(*, head_dim: int, gqa: int, page_size: int) -> None:
    """Raise NotImplementedError for shapes this kernel does not handle yet."""
    for name, value, ok in (("head_dim", head_dim, SUPPORTED_HEAD_DIMS), ("GQA (q heads per kv head)", gqa, SUPPORTED_GQA),
                            ("page_size", page_size, SUPPORTED_PAGE_SIZES)):
        if value not in ok:
            raise NotImplementedError(
                f"decode_attention: {name} = {value} is not supported yet (supported: {list(ok)}; "
                "the mma fragment layouts assume GQA 8, head_dim 128, 16-token pages). "
                "Use a spec with those values, or wait for the generalizing issue."
            )


def is_short_window(window: int | None, page_size: int) -> bool:
    return window is not None and -(-window // page_size) + 1 <= SHORT_WINDOW_MAX_PAGES


def launch_config(*, batch: int, num_kv_heads: int, sliding: bool, window: int | None,
                  head_dim: int, gqa: int, page_size: int, num_sms: int) -> DecodeAttentionConfig:
    """The configuration for a static batch size (launch shape depends on it alone).

    ``window``: the spec's sliding-window length (used only when ``sliding``).
    """
    check_supported(head_dim=head_dim, gqa=gqa, page_size=page_size)
    if batch < 1 or num_kv_heads < 1 or num_sms < 1:
        raise ValueError(f"batch={batch}, num_kv_heads={num_kv_heads}, num_sms={num_sms} must be >= 1")
    num_bh = batch * num_kv_heads
    if sliding and is_short_window(window, page_size):
        # Window 128 = 8-9 pages per (request, kv head): too little work to
        # split across SMs through global memory, so the splits of a pair form
        # a cluster and merge in DSMEM. Seed, measured at 4 kv heads: batch <= 2
        # (8 pairs) -> 8 splits of 4 warps (one page per warp, 2 stages
        # suffice); batch <= 16 (64 pairs) -> 4 splits, 3 stages; above that
        # one CTA per pair already fills the GPU (68+ CTAs) and a cluster merge
        # only adds barriers.
        #
        # flintgen's own H200 timings (2026-11-29; CUDA-graph replay of 20
        # back-to-back launches, window 128, seq_len 8199 = 9 pages; see
        # benchmarks/results/decode_attention_correctness.md), not adopted
        # yet because the seed measured inside the model and the benchmark
        # harness should confirm: batch 16 (64 pairs) takes 7.24 us with the
        # seed's 4-CTA clusters vs 4.19 us with 2-CTA clusters and 4.28 us
        # with one split (256 clustered CTAs look like more than one wave);
        # batch 8: 4.27 / 3.73 / 3.97 us; batch 12: 4.47 / 4.25 / 4.16 us;
        # batch 256: 30.8 us with 3 stages vs 27.9 us with 2.
        if num_bh <= 8:
            return DecodeAttentionConfig(8, 4, 2, 1, True, 0)
        if num_bh <= 64:
            return DecodeAttentionConfig(4, 4, 3, 1, True, 0)
        return DecodeAttentionConfig(1, 4, 3, 1, False, 0)
    # Full attention (and, unmeasured, windows longer than 32 pages): split the
    # pages of each pair across the SMs. Seed, at 4 kv heads: batch <= 2 (<= 8
    # pairs) -> one 8-warp CTA per SM (132 // pairs splits, 2 stages);
    # otherwise two 4-warp CTAs per SM (2 * 132 // pairs splits), 2 stages
    # while batch <= 4 (16 pairs), then 3 (deeper rings pay once each warp
    # streams many pages). min_pages 2: a warp with a single page spends more
    # on its prologue and the merge than on streaming. flintgen's H200
    # timings (same method as above) agree at long contexts: batch 1 x 32k
    # 21.4 us (3.2 TB/s) vs 25.8 with 66 x 4-warp splits; batch 8 x 8k 37.9 us
    # vs 41-43 with 16 splits, 8 warps or 4 stages; batch 128 x 8k 490 us
    # (4.4 TB/s) for every variant tried. Short contexts are the lead: batch
    # 1 x 1k takes 7.1 us vs 6.0 with 4 warps (33 splits) or min_pages 1.
    #
    # Deviation from the seed, measured (benchmarks/decode_attention_sweep.py,
    # H200, 2026-11-29, 16/2 heads, B=1): min_pages 1 instead of 2 for these
    # small batches. At L=1k (64 pages per pair) min_pages 2 leaves 4 active
    # 8-warp splits, min_pages 1 eight: 7.24 -> 6.15 us (and 4.83 us once the
    # merge stopped loading inactive splits); at L=32k every split is active
    # either way (11.27 us).
    if num_bh <= 8:
        splits = max(1, num_sms // num_bh)
        warps, stages, min_pages = 8, 2, 1
    else:
        splits = max(1, 2 * num_sms // num_bh)
        warps, stages, min_pages = 4, (2 if num_bh <= 16 else 3), 2
    return DecodeAttentionConfig(splits, warps, stages, min_pages, False, 8 // warps)


def all_configs(*, max_batch: int, num_kv_heads: int, sliding: bool, window: int | None,
                head_dim: int, gqa: int, page_size: int, num_sms: int) -> dict[int, DecodeAttentionConfig]:
    """batch -> config for batch 1..max_batch."""
    return {b: launch_config(batch=b, num_kv_heads=num_kv_heads, sliding=sliding, window=window,
                             head_dim=head_dim, gqa=gqa, page_size=page_size, num_sms=num_sms)
            for b in range(1, max_batch + 1)}


def max_partials(configs: dict[int, DecodeAttentionConfig], num_kv_heads: int) -> int:
    """Split partials (one per (request, kv head, split)) the workspace must hold."""
    return max([b * num_kv_heads * c.num_splits for b, c in configs.items() if c.uses_partials] or [0])
