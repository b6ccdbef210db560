"""The QKV benchmark's --configs labels (benchmarks/qkv.py): no GPU, no kernels."""

import os
import re
import sys
from dataclasses import replace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import qkv as bq  # noqa: E402  (imports on a machine without a GPU)
from flintgen.configs.qkv_config import QKVConfig, token_tiles  # noqa: E402
from flintgen.kernels.base import Target  # noqa: E402
from flintgen.kernels.qkv_stream import MAX_L2_PREFETCH, StreamConfig  # noqa: E402

SM90 = Target("sm_90a", 132)
GPU_RUN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_run.sh")


def _configs(monkeypatch, labels: str):
    monkeypatch.setattr(sys, "argv", ["qkv", "--stream", "--no-fill", "--configs", labels])
    return bq.stream_configs()


def test_labels_parse(monkeypatch):
    labels = "s6g,s4c2gtl8,s6gf32k2,s8gk2d,L,L8,T,TL16,gl1G8k2de"
    got = {label: (cfg, kd) for label, cfg, kd in _configs(monkeypatch, labels)}
    assert got["stream s6g"][0] == StreamConfig(stages=6, wgmma=True)
    assert got["stream gl1G8k2de"][0] == StreamConfig(wgmma=True, l2_prefetch=1, l2_prefetch_group=8, splits=2,
                                                      cluster=True, evict_first=True)
    assert got["stream s6gf32k2"][0] == StreamConfig(stages=6, wgmma=True, finish_tokens=32, splits=2)
    assert got["stream s8gk2d"][0] == StreamConfig(stages=8, wgmma=True, splits=2, cluster=True)
    assert got["stream s4c2gtl8"][0] == StreamConfig(stages=4, ctas_per_sm=2, wgmma=True, tma=True, l2_prefetch=8)
    for label, l2, tma in (("L", MAX_L2_PREFETCH, False), ("L8", 8, False), ("T", 0, True), ("TL16", 16, True)):
        cfg, kd = got[f"production {label}"]
        assert cfg is None and (kd.l2, kd.tma, kd.evict) == (l2, tma, None), label


def test_evict_labels_change_only_the_read_policy(monkeypatch):
    """E / N (after T / L): the op's configuration per tile with its weights read L2 evict-first or not, nothing
    else; the streaming tiles' own policy is evict-first (stream_config), the cluster design's not."""
    got = {label: kd for label, _, kd in _configs(monkeypatch, "E,N,L8E,s6gu2e")}
    assert (got["production E"].l2, got["production E"].evict) == (0, True)
    assert (got["production N"].l2, got["production N"].evict) == (0, False)
    assert (got["production L8E"].l2, got["production L8E"].evict) == (8, True)
    assert _configs(monkeypatch, "s6gu2e")[-1][1] == StreamConfig(stages=6, wgmma=True, unit_steps=2, evict_first=True)
    spec = bq.token_specs()[1][0]   # flint-bf16, max_tokens 64: the cluster design at 8 tokens, streaming above
    for t in token_tiles(spec.max_tokens):
        base = bq.KDEF.config(spec, t, SM90)
        assert base.evict_first == isinstance(base, StreamConfig), t
        for label, ev in (("production E", True), ("production N", False)):
            assert got[label].config(spec, t, SM90) == replace(base, evict_first=ev), (label, t)


def test_control_label_is_production_again(monkeypatch):
    """P: the op's own configuration through an op of its own, labelled apart from production (a control)."""
    got = _configs(monkeypatch, "s6g,P")
    labels = [label for label, _, _ in got]
    assert labels == ["production", "stream s6g", "production control"]
    assert got[-1][1] is None and got[-1][2] is bq.KDEF


def test_production_variant_def_changes_one_thing():
    """The op's own configuration per tile, with L2 prefetch and / or TMA on its streaming tiles."""
    spec = bq.token_specs()[2][0]   # hidden 4096, max_tokens 64
    kd = bq.ProductionVariantDef(l2=8, tma=True)
    for t in token_tiles(spec.max_tokens):
        base, cfg = bq.KDEF.config(spec, t), kd.config(spec, t)
        if isinstance(base, QKVConfig):   # the cluster design: its rows' rest prefetched, nothing else
            assert cfg == QKVConfig(base.rows, base.cluster, base.warps, base.prefetch, base.early_dequant, True)
        else:
            assert cfg == StreamConfig(**{**base.__dict__, "l2_prefetch": 8, "l2_prefetch_group": 1, "tma": True,
                                          "unit_steps": 1, "evict_first": False})


def test_production_variant_def_keeps_the_ops_l2_prefetch():
    """T alone (no L) leaves the cluster design as the op builds it: flint-bf16's 8-token tile keeps its L2
    prefetch (21 MB of weights, QKVConfig.from_heuristic), the streaming tiles take TMA only."""
    spec = bq.token_specs()[1][0]   # flint-bf16, max_tokens 64
    kd = bq.ProductionVariantDef(tma=True)
    base, cfg = bq.KDEF.config(spec, 8, SM90), kd.config(spec, 8, SM90)
    assert isinstance(base, QKVConfig) and base.l2_prefetch and cfg == base
    base, cfg = bq.KDEF.config(spec, 16, SM90), kd.config(spec, 16, SM90)
    assert cfg == StreamConfig(**{**base.__dict__, "tma": True, "unit_steps": 1, "evict_first": False})


def test_production_variant_def_without_l2_prefetch(monkeypatch):
    """X: the op's own configuration at every tile with no L2 prefetch on either design (XN: nor evict-first
    reads), nothing else changed."""
    got = dict((label, kd) for label, _, kd in _configs(monkeypatch, "X,XN"))
    for spec, _ in bq.token_specs()[1:]:   # flint-bf16 (cluster design up to 8 tokens), hidden 4096 (streaming)
        for t in token_tiles(spec.max_tokens):
            base = bq.KDEF.config(spec, t, SM90)
            x, xn = got["production X"].config(spec, t, SM90), got["production XN"].config(spec, t, SM90)
            if isinstance(base, QKVConfig):
                assert x == xn == QKVConfig(base.rows, base.cluster, base.warps, base.prefetch, base.early_dequant,
                                            False)
            else:
                assert x == StreamConfig(**{**base.__dict__, "l2_prefetch": 0, "l2_prefetch_group": 1})
                assert xn == StreamConfig(**{**x.__dict__, "evict_first": False})
    assert any(isinstance(bq.KDEF.config(s, t, SM90), StreamConfig) and bq.KDEF.config(s, t, SM90).l2_prefetch
               for s, _ in bq.token_specs() for t in token_tiles(s.max_tokens))   # X changes something
    with pytest.raises(ValueError, match="no_l2 with l2 = 8"):
        bq.ProductionVariantDef(l2=8, no_l2=True)


def test_gpu_run_stream_ab_labels_build_variants(monkeypatch):
    """Every label of gpu_run.sh's stream-ab parses and gives a variant for every tile of both specs."""
    text = open(GPU_RUN).read()
    labels = re.search(r"stream-ab\) .*--configs (\S+)", text).group(1)
    for label, cfg, kd in _configs(monkeypatch, labels):
        for spec, _ in bq.token_specs()[1:]:
            for t in token_tiles(spec.max_tokens):
                assert kd.variant(spec, config=cfg, max_m=t, target=SM90).name, (label, spec.name, t)


def test_bad_label_is_refused(monkeypatch):
    # x9, and the labels of options since removed (h: tail heads, d: pool steps, n: fused norm)
    for label in ("x9", "s6gf8h10", "s8gf8d13", "s8gn"):
        with pytest.raises(ValueError,
                           match=rf"--configs label '{label}' is not one of: .*f<tokens>l<units>\[G<units>\]k<splits>\[d\]u<steps>\[e\] \("):
            _configs(monkeypatch, label)


def test_timeline_patches_apply():
    """benchmarks/qkv_timeline.py stamps every row's QKV binary and the RMSNorm: each stamp once, the stamp
    buffer in every signature and call of the module, and what it leaves parses."""
    import ast

    from benchmarks import qkv_timeline as tl

    seen = set()
    for label, spec, m, cfg in tl.rows():
        v, norm = tl.variants(spec, m, cfg, SM90)
        for kdef, var in ((tl.KDEF, v), (tl.RMS, norm)):
            src = tl.patched_source(kdef, spec, var)
            ast.parse(src)
            for slot in (8, 16, 24, 32, 40, 48):   # clk entry / waited / streamed / done, gt exit, smid
                assert src.count(f"(st_row + {slot})") == 1, (label, var.name, slot)
            assert src.count("_gt(st_row)") == 1 and src.count("st_row = stamps.iterator.toint()") == 1
            sigs = src.count("slot_mapping: cute.Tensor") or src.count("        weight: cute.Tensor,\n")
            assert src.count("stamps: cute.Tensor") == sigs, (label, var.name)
            # every stamp inside the kernel's body (where st_row is), not in a method after it
            body = src[src.index("    def kernel("):]
            body = body[:min(i for i in (body.find("\n    def ", 1), body.find("\n    @cute.jit", 1),
                                         body.find("\ndef ", 1)) if i > 0)]
            assert body.count("st_row") == src.count("st_row"), (label, var.name)
            seen.add(tl.kind_of(kdef, var))
    assert seen == {"rms_norm", "cluster", "stream"}


def test_timeline_patch_mismatch_is_refused(monkeypatch):
    from benchmarks import qkv_timeline as tl

    spec = tl.specs()[0]
    _, norm = tl.variants(spec, 1, None, SM90)
    monkeypatch.setitem(tl.PATCHES, "rms_norm", [("no such line\n", "x", 1)])
    with pytest.raises(RuntimeError, match=r"'no such line\\n' occurs 0 times, expected 1"):
        tl.patched_source(tl.RMS, spec, norm)


def _stamp_rows(rows, ns_per_clk=0.5):
    """Stamp buffer rows (entry gt ns, waited / streamed / done offsets in ns, smid) -> int64 [CTAs x 8]."""
    import torch

    out = []
    for gt0, waited, streamed, done, sm in rows:
        clk0 = 1000 + 7 * sm    # clock64 counters differ per SM: only differences count
        out.append([gt0, clk0, clk0 + waited / ns_per_clk, clk0 + streamed / ns_per_clk,
                    clk0 + done / ns_per_clk, gt0 + done, sm, 0])
    return torch.tensor(out, dtype=torch.float64).round().to(torch.int64).flatten()


def test_timeline_analyse_places_phases():
    """analyse(): times after the previous call's last QKV exit, from globaltimer entries and clock64 phases
    at one clock rate; the RMSNorm's wait and exit; CTAs per SM."""
    from benchmarks import qkv_timeline as tl

    # call 0: QKV CTAs exit at 10_000 and 12_000 ns; call 1: two CTAs entering at 11_000 / 12_500
    q0 = _stamp_rows([(0, 1000, 8000, 10_000, 0), (2000, 1000, 9000, 10_000, 1)])
    q1 = _stamp_rows([(11_000, 3000, 9000, 10_000, 0), (12_500, 2000, 8000, 9000, 0)])
    r0 = _stamp_rows([(0, 0, 0, 500, 0)])
    r1 = _stamp_rows([(12_100, 900, 900, 1500, 2)])   # waits until 13_000, exits at 13_600
    (res,) = tl.analyse([q0, q1], [r0, r1], sms=4)
    assert res["r"] == pytest.approx((0.1, 1.0, 1.6))
    assert res["q_entry"] == pytest.approx((-1.0, -1.0, 0.5))      # the median of two: torch takes the lower
    assert res["q_waited"] == pytest.approx((2.0, 2.5))                   # 11_000 + 3000, 12_500 + 2000
    assert res["q_exit"] == pytest.approx((9.0, 9.5))                      # 21_000 and 21_500 - 12_000
    assert res["q_stream_phase"] == pytest.approx(6.0)
    assert res["q_finish_phase"] == pytest.approx(1.0)
    assert res["ctas_per_sm"] == (0, 2)
    assert res["q_waited_after_r"] == pytest.approx((14_000 - 13_600) / 1e3)   # median wait 14_000 (lower)
    # the tail: the last streamed point (12_500 + 8000 - 12_000), the longest finish phase (1000 ns), CTAs over 200
    assert res["tail"] == pytest.approx((8.5, 1.0, 2))
    (res,) = tl.analyse([q0, q1], [r0, r1], sms=4, lens=[12, 11])   # stream phases 6000 / 6000 ns by range length
    assert (res["phase_11"], res["phase_12"]) == pytest.approx((6.0, 6.0))


def test_write_report_goes_to_out_or_fallback(tmp_path, monkeypatch, capsys):
    from benchmarks.harness import write_report

    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    write_report("r1", "# r1\n", fallback_dir=str(tmp_path / "fb"))
    assert (tmp_path / "out" / "r1.md").read_text() == "# r1\n" and not (tmp_path / "fb").exists()
    monkeypatch.delenv("OUT")
    write_report("r2", "# r2\n", fallback_dir=str(tmp_path / "fb"))
    assert (tmp_path / "fb" / "r2.md").read_text() == "# r2\n"
    write_report("r3", "# r3\n")      # neither: printed only
    assert not list(tmp_path.rglob("r3.md")) and "# r3" in capsys.readouterr().out


def test_stream_shapes_mode(monkeypatch):
    """--stream --shapes: the BF16 models of --shapes (hidden 1024..8192), max_tokens the largest tile of --ms,
    into their own results file; every label's variant builds at each tile."""
    monkeypatch.setattr(sys, "argv", ["qkv", "--stream", "--shapes", "--ms", "1,8,64", "--no-fill", "--configs", "s8g"])
    plan, name = bq.mode_plan()
    assert name == "qkv_stream_shapes"
    assert [(s.hidden_size, s.weight_format, s.max_tokens, ms) for s, ms in plan] == [
        (h, "bf16", 64, (1, 8, 64)) for h in (1024, 3072, 3584, 5120, 8192)]
    for s, _ in plan:
        for label, cfg, kd in bq.stream_configs():
            for t in token_tiles(s.max_tokens):
                assert kd.variant(s, config=cfg, max_m=t, target=SM90).name, (label, s.name, t)
