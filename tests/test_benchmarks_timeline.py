"""benchmarks/decode_attention_timeline.py's text patches (no GPU): every row's stamped module, split launches
included, applies each patch exactly once (patched_source raises otherwise) and is valid Python with its stamps."""

import pytest

from benchmarks import decode_attention_timeline as timeline
from flintgen import toolchain

TARGET = toolchain.resolve_target(arch="sm_90a", num_sms=132)
ROWS = timeline.rows()


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_every_row_is_stamped(row):
    label, spec, b, _, w, cfg = row
    v = timeline.variant_of(spec, b, w, TARGET, cfg)
    src = timeline.patched_source(spec, v)
    compile(src, label, "exec")
    for point in ("_gt(st_row)", "_clk(st_row + 8)", "_clk(st_row + 16)", "_clk(st_row + 24)", "_clk(st_row + 32)",
                  "_clk(st_row + 40)", "_gt(st_row + 48)", "_smid(st_row + 56)"):
        assert src.count(point) == 1, (label, point)


def test_split_goal_rows_are_there():
    """The 16/2 goal rows (and B = 1 x 1k with sweep run 24's 132 four-warp splits) run split launches (the reason
    the stamps moved before the partials)."""
    splits = {r[0]: dict(timeline.variant_of(r[1], r[2], r[4], TARGET, r[5]).params)["num_splits"]
              for r in ROWS if "16/2" in r[0]}
    assert len(splits) == 3 and all(n > 1 for n in splits.values()), splits
    assert splits["bf16 16/2 d128 B=1 L=1k 132 splits x 4 warps"] == 132


def test_patch_that_no_longer_applies_is_refused(monkeypatch):
    label, spec, b, _, w, cfg = ROWS[0]
    v = timeline.variant_of(spec, b, w, TARGET, cfg)
    monkeypatch.setattr(timeline, "PATCHES", timeline.PATCHES + [("no such line\n", "x\n")])
    with pytest.raises(RuntimeError, match="occurs 0 times"):
        timeline.patched_source(spec, v)
