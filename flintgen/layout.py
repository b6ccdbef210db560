"""Layout numbers of the kernels and the KV cache (cute-free).

The one place that says how many tokens a streamed slice holds, how many
bytes a KV-cache element takes, how q rows are padded into mma tiles, how
the fused QKV GEMV steps through hidden and which lane of its epilogue owns
which elements of a head (``EpilogueLanes``), and the Hopper limits the
configs size shared memory and clusters by. Configs, kernel hosts,
templates (through ``render_params``) and the ``flintgen.device`` helpers
read these numbers from here; nothing imports cutlass, so serving machines
and configs can import it. Device modules import numbers from here, never
from ``flintgen.configs``: a kernel's cache key hashes the modules it
imports (``cache.helpers_hash``), so a heuristic's edit does not rebuild
binaries it leaves unchanged.

KV cache (HND; ``E = kv_elem_bytes``)::

    kv[block, kv_head, token, 0:D]     K      [blocks, kv_heads, page_size, 2 D]
    kv[block, kv_head, token, D:2D]    V      one token row: 2 D x E bytes

    slice = SLICE_TOKENS consecutive token rows of one (block, kv head):
            [SLICE_TOKENS, 2 D] -> SLICE_TOKENS x 2 D x E bytes
            (bf16: 8 KB at D = 128, 4 KB at D = 64)
    page  = page_size // SLICE_TOKENS consecutive slices

q tile of one kv head (the rows one CTA computes against each slice)::

    q[b, kv_head * gqa + head] for token in q_len
        (q_len, gqa, D) -> (q_rows = q_len x gqa, D), row = token x gqa + head
        -> (num_tiles x tile, D): rows q_rows .. tile_rows - 1 are padding
           (q = 0, computed, never stored)

``tile`` is the rows of one mma tile: 8 today, q rows being the N = 8
columns of ``mma.sync.m16n8k16`` (S^T = K Q^T); 16 would put q in the M
rows. GQA 4 pads one tile of 8, GQA 16 runs two. Decode is ``q_len`` 1;
multi-token decode (speculative decoding) fills the same tile with
q_len x gqa rows.
"""

from __future__ import annotations

from dataclasses import dataclass

# Hopper (sm_90) limits every config sizes shared memory and clusters by
SMEM_PER_SM = 228 * 1024        # shared memory per SM (H100 / H200)
SMEM_PER_CTA_MAX = 227 * 1024   # opt-in maximum of one CTA
CTA_SMEM_RESERVED = 1024        # shared memory the hardware reserves per CTA
MAX_CLUSTER = 8                 # CTAs of a thread-block cluster (the portable limit, no opt-in attribute)

SLICE_TOKENS = 16       # tokens per streamed slice: the mma's M (and K of P V)
HEAD_TILE = 8           # q rows per mma tile: mma.sync.m16n8k16's N = 8 columns
HEAD_TILES = (8, 16)    # tile sizes a layout can describe (m16n8k16's N or M)
Q_ELEM_BYTES = 2        # q and out are bf16 whatever the cache dtype


@dataclass(frozen=True, kw_only=True)
class KVDtype:
    """One KV-cache element type: ``name`` as in ``Spec.kv_cache_dtype``,
    its size, and the cutlass / torch type names the generated modules and
    the host checks use."""

    name: str
    elem_bytes: int
    cutlass_type: str
    torch_dtype: str


# Element types the layout can describe. What a kernel supports is its
# validation's business (Spec.SUPPORTED_KV_DTYPES, decode_attention_config
# .check_supported): decode attention reads fp8 e4m3 pages (converted to f16
# fragments: its fragment registers are those of 16-bit pairs whatever the
# cache, AttentionLayout.slice_bytes halves).
KV_DTYPES = {
    d.name: d for d in (
        KVDtype(name="bf16", elem_bytes=2, cutlass_type="BFloat16", torch_dtype="bfloat16"),
        KVDtype(name="fp8_e4m3", elem_bytes=1, cutlass_type="Float8E4M3FN", torch_dtype="float8_e4m3fn"),
    )
}


def kv_dtype(name: str) -> KVDtype:
    """The ``KVDtype`` called ``name``; ValueError naming the known ones."""
    try:
        return KV_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"kv dtype {name!r} is not described by flintgen.layout: known are "
                         f"{sorted(KV_DTYPES)}; add a KVDtype to layout.KV_DTYPES") from None


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"AttentionLayout.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class AttentionLayout:
    """The layout of one (request, kv head) of decode attention: its q tile
    and the KV slices it streams (shapes in the module docstring).

    ``head_dim``: D; ``gqa``: q heads per kv head on one rank; ``q_len``:
    query tokens per request (1: decode); ``kv_dtype``: the cache's element
    type (a ``KV_DTYPES`` name); ``tile``: q rows per mma tile.
    """

    head_dim: int
    gqa: int
    q_len: int = 1
    kv_dtype: str = "bf16"
    tile: int = HEAD_TILE

    def __post_init__(self) -> None:
        for name in ("head_dim", "gqa", "q_len"):
            _positive_int(name, getattr(self, name))
        if self.head_dim % SLICE_TOKENS:
            raise ValueError(f"AttentionLayout.head_dim = {self.head_dim} must be a multiple of "
                             f"{SLICE_TOKENS} (the mma's k-step of 16 dims)")
        if self.tile not in HEAD_TILES:
            raise ValueError(f"AttentionLayout.tile = {self.tile!r} is not an mma.sync.m16n8k16 tile: "
                             f"use one of {list(HEAD_TILES)} rows")
        kv_dtype(self.kv_dtype)

    # ------------------------------------------------------------ q tile
    @property
    def q_rows(self) -> int:
        """Real q rows per kv head: q_len x gqa."""
        return self.q_len * self.gqa

    @property
    def num_tiles(self) -> int:
        """mma tiles that hold the q rows: ceil(q_rows / tile)."""
        return -(-self.q_rows // self.tile)

    @property
    def tile_rows(self) -> int:
        """q rows computed and merged, padding included: num_tiles x tile."""
        return self.num_tiles * self.tile

    @property
    def pad_rows(self) -> int:
        """Padding rows of the last tile (q = 0, never stored)."""
        return self.tile_rows - self.q_rows

    def row(self, token: int, head: int) -> int:
        """Tile row of query ``token`` (< q_len) and q head ``head`` (< gqa)
        of the kv head: ``token x gqa + head``."""
        if not (0 <= token < self.q_len and 0 <= head < self.gqa):
            raise ValueError(f"token {token}, head {head} outside q_len = {self.q_len}, gqa = {self.gqa}")
        return token * self.gqa + head

    # ------------------------------------------------------------ KV slices
    @property
    def kv_elem_bytes(self) -> int:
        return kv_dtype(self.kv_dtype).elem_bytes

    @property
    def kv_row_bytes(self) -> int:
        """One token's K | V row: 2 D elements."""
        return 2 * self.head_dim * self.kv_elem_bytes

    @property
    def slice_bytes(self) -> int:
        """One slice: SLICE_TOKENS token rows."""
        return SLICE_TOKENS * self.kv_row_bytes

    @staticmethod
    def slices_per_page(page_size: int) -> int:
        """Consecutive slices in a page of ``page_size`` tokens."""
        if page_size % SLICE_TOKENS or page_size < SLICE_TOKENS:
            raise ValueError(f"page_size = {page_size} is not a whole number of {SLICE_TOKENS}-token slices")
        return page_size // SLICE_TOKENS


# ---------------------------------------------------------------- the fused QKV GEMV
# Weights W [N, hidden] (bf16, or NVFP4 with one scale per 16 values) times xn [M, hidden]: the GEMV
# walks hidden in K steps, the tokens are the mma's N.
K_STEP = 64             # hidden values per K step: 4 quads x 16 (one NVFP4 scale block each); a stream unit's step
MMA_N = 8               # tokens per MMA (mma.m16n8k16's N)
ROW_STRIDE = 144        # bytes per staged row of the mma.sync ring: 128 of data + 16 of padding (conflict-free lds.128)
XN_SLOT_BYTES = 128     # one token's K_STEP values, staged (the streaming register path)
WARPGROUP_ROWS = 64     # weight rows of one wgmma (its M)


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


@dataclass(frozen=True)
class EpilogueLanes:
    """Which elements of a head each lane of the per-head epilogue owns
    (rank 0 of a head's cluster, one warp per token; flintgen.device.head_epilogue).

    A head of D elements is the rotary part [0, R) (R = rotary_dim; R = D
    without RoPE) and the pass-through part [R, D). The R/2 rotary pairs
    share frequency i with table columns i (cos) and R/2 + i (sin) of the
    ``[max_pos, R]`` cos|sin table; pair i is

        neox:        (x[i], x[i + R/2])
        interleaved: (x[2i], x[2i + 1])

    Lane l < ``pair_lanes`` owns the P = ``pair_e`` pairs i in [P l, P l + P),
    i.e. the elements (one vector access per run)

        neox:        [P l, P l + P) and [R/2 + P l, R/2 + P l + P)
        interleaved: [2P l, 2P l + 2P)
        cos | sin:   columns [P l, P l + P) and [R/2 + P l, R/2 + P l + P)

    and lane l < ``pass_lanes`` the S = ``pass_e`` elements [R + S l, R + S l + S)
    (S = 0: no pass-through part). Lanes past ``pair_lanes`` / ``pass_lanes``
    address those of the last such lane (in bounds) but add nothing to the
    norm and store nothing. P and S are powers of two (1, 2, 4, 8); runs start
    at multiples of their length (aligned vector accesses).

    flint (D = R = 128, NeoX): P = 2 on all 32 lanes, elements [2l, 2l + 2) and
    [64 + 2l, 64 + 2l + 2). D = R = 96: P = 2 on 24 lanes. GLM-4 (128, R = 64):
    P = 1 on 32 lanes, S = 2 on 32 lanes. Phi-4-mini (128, R = 96, NeoX): P = 2
    on 24 lanes, S = 1 on 32 lanes.
    """

    head_dim: int
    rope_dim: int
    interleaved: bool
    pair_e: int
    pair_lanes: int
    pass_e: int
    pass_lanes: int

    @classmethod
    def of(cls, head_dim: int, rope_dim: int, interleaved: bool) -> "EpilogueLanes":
        if rope_dim % 2 or not 2 <= rope_dim <= head_dim:
            raise ValueError(f"qkv epilogue: rotary_dim = {rope_dim} must be even in 2..head_dim = {head_dim}")
        half = rope_dim // 2
        pe = _pow2_at_least(-(-half // 32))
        if half % pe:
            raise ValueError(
                f"qkv: rotary_dim = {rope_dim} is not supported with head_dim {head_dim}: the epilogue gives "
                f"each lane {pe} consecutive rotary pairs and needs rotary_dim / 2 = {half} to be a multiple of "
                f"{pe} (supported: rotary_dim <= 64 any even, <= 128 a multiple of 4, <= 256 a multiple of 8); "
                "use the whole head (rotary_dim = head_dim) or the unfused path")
        rest = head_dim - rope_dim
        se = _pow2_at_least(-(-rest // 32)) if rest else 0
        if rest and (rest % se or rope_dim % se):
            raise ValueError(
                f"qkv: rotary_dim = {rope_dim} is not supported with head_dim {head_dim}: the {rest} "
                f"pass-through dims go {se} per lane, so rotary_dim and head_dim - rotary_dim must be "
                f"multiples of {se}; use a rotary_dim that is, or the unfused path")
        return cls(head_dim, rope_dim, bool(interleaved), pe, half // pe, se, rest // se if rest else 0)

    @property
    def v_e(self) -> int:
        """v heads (bits copied): the NeoX mapping of the whole head, ``v_e``
        elements per run, runs [E l, E l + E) and [D/2 + E l, ..) on ``v_lanes`` lanes."""
        return EpilogueLanes.of(self.head_dim, self.head_dim, False).pair_e

    @property
    def v_lanes(self) -> int:
        return self.head_dim // 2 // self.v_e
