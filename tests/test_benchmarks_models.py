"""The --models benchmark's row plan (benchmarks/models.py): no GPU, no kernels."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import decode_attention as da  # noqa: E402  (imports on a machine without a GPU)
from benchmarks import models as M  # noqa: E402
from benchmarks.harness import Row, write_results  # noqa: E402
from flintgen.kernels.base import Target  # noqa: E402
from flintgen.spec import SUPPORTED_HEAD_DIMS  # noqa: E402

SM90 = Target("sm_90a", 132)
WINDOWED = {"Gemma-2-9B", "Gemma-3-1B"}


def test_every_model_has_its_rows():
    assert len(M.MODELS) == 8
    for m in M.MODELS:
        rows = M.rows_for(m)
        full = [(r.batch, r.seq_len) for r in rows if r.window is None]
        assert full == [(1, 1024), (1, 32768), (8, 8192), (64, 8192), (128, 8192)], m.name
        windowed = [(r.batch, r.seq_len, r.window) for r in rows if r.window is not None]
        assert windowed == ([(32, 8192, 1024)] if m.name in WINDOWED else []), m.name
        assert sum(r.floor_goal for r in rows) == 1


def test_groups_cover_every_model_once_within_a_run():
    names = [n for g in M.GROUPS.values() for n in g]
    assert sorted(names) == sorted(m.name for m in M.MODELS)
    for g in M.GROUPS:
        name, models = M.select(str(g))
        rows = M.plan(models)
        assert len(rows) <= M.MAX_ROWS_PER_GROUP and name == f"decode_attention_models_g{g}"
        assert len(M.xqa_modules(rows)) <= 6    # XQA's nvcc compiles in one run
    assert len(M.plan(M.select("all")[1])) == 42


def test_selection():
    assert [m.name for m in M.select(None, "gemma-2-9b, Qwen3-1.7B")[1]] == ["Gemma-2-9B", "Qwen3-1.7B"]
    for bad in [dict(group=None), dict(group="3"), dict(only="Llama-9")]:
        with pytest.raises(SystemExit):
            M.select(**bad)


def test_specs_are_the_models():
    for m in M.MODELS:
        for r in M.rows_for(m):
            try:
                spec = r.spec()
            except ValueError:
                # Only a head_dim the Spec does not take yet (96 for Phi-3) may refuse.
                assert m.head_dim not in SUPPORTED_HEAD_DIMS, m.name
                continue
            assert (spec.q_heads_per_rank, spec.kv_heads_per_rank, spec.head_dim) == (m.q_heads, m.kv_heads,
                                                                                      m.head_dim)
            assert spec.page_size == 16 and spec.sinks is False and spec.tp_size == 1
            assert spec.sliding_window == (r.window or m.window)
            assert spec.has_sliding == (m.window is not None) and spec.has_full
            if m.softcap:
                assert spec.attn_logit_softcap is True
    assert M.BY_NAME["gemma-3-1b"].spec().sliding_window == 512


def test_listing_needs_no_kernels():
    text = M.listing(SM90)
    for m in M.MODELS:
        assert m.name in text
    assert "42 rows in 2 groups" in text


def test_refusals_are_cells():
    per = [{"flintgen": "head_dim 256 refused", "XQA": 10.0 + i, "FA4": "fa4 failed: X"} for i in range(3)]
    med, peers, extra = da.summarize(per)
    assert med is None and peers == {"XQA": 11.0} and extra["XQA_spread_us"] == 2.0
    assert extra["flintgen_error"] == "head_dim 256 refused" and extra["FA4_error"] == "fa4 failed: X"
    assert extra["beats_peers_beyond_spread"] is False
    med, peers, extra = da.summarize([{"flintgen": 5.0 + i, "XQA": 10.0, "FA4": 20.0} for i in range(3)])
    assert med == 6.0 and extra["spread_us"] == 2.0 and extra["beats_peers_beyond_spread"]
    assert extra["runs_us"] == [5.0, 6.0, 7.0] and extra["XQA_runs_us"] == [10.0] * 3


def test_results_with_a_refused_row(tmp_path):
    meta = {"date": "d", "commit": "c", "device": "H200", "sms": 132, "torch": "t", "cuda": "u"}
    rows = [Row({"model": "x"}, None, 3.0, {"XQA": 4.0}), Row({"model": "y"}, 2.0, 1.0, {"XQA": 4.0})]
    md = write_results("t", rows, 4.4e12, out_dir=str(tmp_path), meta=meta)
    assert "| x | — | 3.00 | — | 4.00 |" in md and "| y | 2.00 | 1.00 | 50% | 4.00 |" in md
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["rows"][0]["pct_of_floor"] is None and data["meta"]["device"] == "H200"


def test_fp8_rows_selects_by_label():
    """--fp8 --rows: the rows whose label contains one of the strings, in table order."""
    assert da.fp8_rows() is da.FP8_ROWS
    rows = da.fp8_rows("64/8 d64 B=64 L=8k, 64/8 d128 B=32")
    assert [da._fp8_row_label(*r) for r in rows] == ["flint 64/8 d128 B=32 L=8k w128", "gpt-oss-20b 64/8 d64 B=64 L=8k"]
    assert len(da.fp8_rows("gpt-oss-20b")) == 12


@pytest.mark.parametrize("select", ["B=3 L", " , ", "64/8 d64 B=64 L=8k,nope"])
def test_fp8_rows_refuses_a_string_matching_no_row(select):
    with pytest.raises(ValueError, match=r"matches no --fp8 row; give parts of the labels that --fp8 --list prints"):
        da.fp8_rows(select)


def test_fp8_table_rotates_the_timing_order():
    """--fp8 times the three implementations in a rotated order per run: each is first once in three runs, every
    run times all of them once."""
    names = ("flintgen", "flintgen bf16", "XQA-fp8")
    orders = [da.rotated(names, i) for i in range(4)]
    assert orders[0] == names and orders[3] == names
    assert [o[0] for o in orders[:3]] == list(names)
    assert all(sorted(o) == sorted(names) for o in orders)
