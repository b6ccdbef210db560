"""Layout numbers of decode attention and the KV cache (cute-free).

The one place that says how many tokens a streamed slice holds, how many
bytes a KV-cache element takes and how q rows are padded into mma tiles.
Configs, kernel hosts, templates (through ``render_params``) and the
``flintgen.device`` helpers read these numbers from here; nothing imports
cutlass, so serving machines and configs can import it.

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
