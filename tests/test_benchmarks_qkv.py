"""The QKV benchmark's --configs labels (benchmarks/qkv.py): no GPU, no kernels."""

import os
import re
import sys

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
    got = {label: (cfg, kd) for label, cfg, kd in _configs(monkeypatch, "s6g,s4c2gtl8,L,L8,T,TL16")}
    assert got["stream s6g"][0] == StreamConfig(stages=6, wgmma=True)
    assert got["stream s4c2gtl8"][0] == StreamConfig(stages=4, ctas_per_sm=2, wgmma=True, tma=True, l2_prefetch=8)
    for label, l2, tma in (("L", MAX_L2_PREFETCH, False), ("L8", 8, False), ("T", 0, True), ("TL16", 16, True)):
        cfg, kd = got[f"production {label}"]
        assert cfg is None and (kd.l2, kd.tma) == (l2, tma), label


def test_production_variant_def_changes_one_thing():
    """The op's own configuration per tile, with L2 prefetch and / or TMA on its streaming tiles."""
    spec = bq.token_specs()[2][0]   # hidden 4096, max_tokens 64
    kd = bq.ProductionVariantDef(l2=8, tma=True)
    for t in token_tiles(spec.max_tokens):
        base, cfg = bq.KDEF.config(spec, t), kd.config(spec, t)
        if isinstance(base, QKVConfig):   # the cluster design: its rows' rest prefetched, nothing else
            assert cfg == QKVConfig(base.rows, base.cluster, base.warps, base.prefetch, base.early_dequant, True)
        else:
            assert cfg == StreamConfig(**{**base.__dict__, "l2_prefetch": 8, "tma": True})


def test_gpu_run_stream_ab_labels_build_variants(monkeypatch):
    """Every label of gpu_run.sh's stream-ab parses and gives a variant for every tile of both specs."""
    text = open(GPU_RUN).read()
    labels = re.search(r"stream-ab\) .*--configs (\S+)", text).group(1)
    for label, cfg, kd in _configs(monkeypatch, labels):
        for spec, _ in bq.token_specs()[1:]:
            for t in token_tiles(spec.max_tokens):
                assert kd.variant(spec, config=cfg, max_m=t, target=SM90).name, (label, spec.name, t)


def test_bad_label_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"--configs label 'x9' is not"):
        _configs(monkeypatch, "x9")
