"""flintgen.layout: the one source of the slice, element-size and head-tile
numbers, what reads it, and the shapes it can describe beyond today's
kernels (multi-token decode, fp8 KV, 16-row tiles)."""

import ast
import dataclasses

import pytest

from flintgen import cache, codegen, layout
from flintgen.configs import decode_attention_config as dac
from flintgen.kernels import KERNELS
from flintgen.kernels.base import Target
from flintgen.layout import AttentionLayout
from flintgen.presets import FLINT, PRESETS

T132 = Target("sm_90a", 132)


@pytest.mark.parametrize("gqa, tiles, rows, pad", [(4, 1, 8, 4), (8, 1, 8, 0), (16, 2, 16, 0)])
@pytest.mark.parametrize("head_dim, slice_kb", [(64, 4), (128, 8)])
def test_decode_shapes(gqa, tiles, rows, pad, head_dim, slice_kb):
    lay = AttentionLayout(head_dim=head_dim, gqa=gqa)
    assert (lay.q_len, lay.kv_dtype, lay.tile) == (1, "bf16", 8)
    assert (lay.num_tiles, lay.tile_rows, lay.pad_rows, lay.q_rows) == (tiles, rows, pad, gqa)
    assert lay.kv_elem_bytes == 2 and lay.kv_row_bytes == 4 * head_dim
    assert lay.slice_bytes == slice_kb * 1024 == layout.SLICE_TOKENS * 2 * head_dim * 2
    assert [lay.slices_per_page(p) for p in (16, 32, 64)] == [1, 2, 4]


def test_config_reads_the_layout():
    cfg = dac.launch_config(batch=1, num_kv_heads=2, sliding=False, window=None, head_dim=128, gqa=16,
                            page_size=16, num_sms=132)
    assert cfg.layout == AttentionLayout(head_dim=128, gqa=16)
    assert cfg.tile_heads == 16 and cfg.slice_bytes == 8192
    assert cfg.ring_bytes == cfg.num_warps * cfg.num_stages * 8192


@pytest.mark.parametrize("q_len, gqa", [(n, g) for n in range(1, 9) for g in range(1, 9) if n * g <= 8])
def test_multi_token_rows_fill_one_tile(q_len, gqa):
    """Multi-token decode (speculative decoding): q_len x GQA <= 8 rows are
    one 8-row tile, rows token-major (row = token x gqa + head), padded."""
    lay = AttentionLayout(head_dim=128, gqa=gqa, q_len=q_len)
    assert lay.q_rows == q_len * gqa <= lay.tile_rows == 8
    assert lay.num_tiles == 1 and lay.pad_rows == 8 - q_len * gqa
    rows = [lay.row(n, h) for n in range(q_len) for h in range(gqa)]
    assert rows == list(range(q_len * gqa))


def test_rows_past_one_tile():
    assert AttentionLayout(head_dim=64, gqa=5, q_len=2).num_tiles == 2          # 10 rows: 2 tiles of 8
    assert AttentionLayout(head_dim=64, gqa=5, q_len=2).pad_rows == 6
    lay = AttentionLayout(head_dim=128, gqa=16, tile=16)                         # 16-row tiles: one
    assert (lay.num_tiles, lay.tile_rows) == (1, 16)
    assert AttentionLayout(head_dim=128, gqa=1, tile=16).pad_rows == 15


def test_fp8_kv_is_described_and_read_by_decode_attention():
    lay = AttentionLayout(head_dim=128, gqa=8, kv_dtype="fp8_e4m3")
    assert lay.kv_elem_bytes == 1 and lay.slice_bytes == 4096 and lay.kv_row_bytes == 256
    dac.check_supported(head_dim=128, gqa=8, page_size=16, kv_dtype="fp8_e4m3")
    assert FLINT.replace(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"   # the spec takes it


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=0, gqa=8), r"head_dim must be an int >= 1, got 0"),
    (dict(head_dim=100, gqa=8), r"head_dim = 100 must be a multiple of 16"),
    (dict(head_dim=128, gqa=True), r"gqa must be an int >= 1, got True"),
    (dict(head_dim=128, gqa=8, q_len=0), r"q_len must be an int >= 1, got 0"),
    (dict(head_dim=128, gqa=8, tile=12), r"tile = 12 is not an mma.sync.m16n8k16 tile: use one of \[8, 16\]"),
    (dict(head_dim=128, gqa=8, kv_dtype="fp16"), r"kv dtype 'fp16' is not described .* known are \['bf16', 'fp8_e4m3'\]"),
])
def test_rejections(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionLayout(**kwargs)


def test_rejections_of_derived_values():
    lay = AttentionLayout(head_dim=128, gqa=4, q_len=2)
    with pytest.raises(ValueError, match=r"token 2, head 0 outside q_len = 2, gqa = 4"):
        lay.row(2, 0)
    with pytest.raises(ValueError, match=r"page_size = 24 is not a whole number of 16-token slices"):
        lay.slices_per_page(24)


def test_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        AttentionLayout(128, 8)  # noqa: the fields are keyword-only
    lay = AttentionLayout(head_dim=128, gqa=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.gqa = 4
    assert hash(lay) == hash(AttentionLayout(head_dim=128, gqa=8))


def test_cache_key_covers_the_layout_module(tmp_path, monkeypatch):
    """Device helpers read flintgen/layout.py: editing it rebuilds the
    kernels that import it (decode attention), not the others (RMSNorm)."""
    kdef = KERNELS["decode_attention"]
    v = kdef.variants(FLINT, T132)[0]
    params = dict(kdef.render_params(FLINT, v))
    e = cache.make_entry(v, kdef.template, params, T132, str(tmp_path))
    assert "flintgen.layout" in cache._imports(cache._read_module("flintgen.device.paged_kv").decode(),
                                               "flintgen.device")
    real = cache._read_module
    monkeypatch.setattr(cache, "_read_module",
                        lambda n: real(n) + (b"\n# edited" if n == "flintgen.layout" else b""))
    assert cache.make_entry(v, kdef.template, params, T132, str(tmp_path)).key != e.key
    rms = KERNELS["rms_norm"]
    rv = rms.variants(FLINT, T132)[0]
    re_ = cache.make_entry(rv, rms.template, dict(rms.render_params(FLINT, rv)), T132, str(tmp_path))
    monkeypatch.setattr(cache, "_read_module", real)
    assert cache.make_entry(rv, rms.template, dict(rms.render_params(FLINT, rv)), T132, str(tmp_path)).key \
        == re_.key


def _locals(tree) -> set[str]:
    """Names bound inside the module's functions (arguments, assignments,
    loop targets, nested defs)."""
    out = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.arg):
                    out.add(node.arg)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    out.add(node.id)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not fn:
                    out.add(node.name)
    return out


@pytest.mark.parametrize("kernel", ["decode_attention", "qkv"])
def test_no_template_name_is_a_python_local(kernel):
    """A Jinja name must mean one thing: none is also a local of the
    generated code (``num_splits`` was both the static and the active count)."""
    kdef = KERNELS[kernel]
    for spec in PRESETS.values():
        for v in kdef.variants(spec, T132):
            params = dict(kdef.render_params(spec, v))
            src = codegen.render(v.kernel, kdef.template_of(v), params)
            clash = set(params) & _locals(ast.parse(src))
            assert not clash, f"{v.name}: template names used as Python locals: {sorted(clash)}"


def test_decode_template_renders_layout_constants():
    kdef = KERNELS["decode_attention"]
    v = kdef.variants(FLINT, T132)[0]
    src = codegen.render(v.kernel, kdef.template, dict(kdef.render_params(FLINT, v)))
    lines = {ln.split("#")[0].strip() for ln in src.splitlines()}
    for line in ("SLICE_TOKENS = 16", "KV_ELEM_BYTES = 2", "KV_TYPE = cutlass.BFloat16", "HEAD_TILE = 8",
                 "NUM_TILES = 1", "TILE_HEADS = 8", "SLICE_BYTES = 8192", "SLICES_PER_PAGE = 1"):
        assert line in lines
