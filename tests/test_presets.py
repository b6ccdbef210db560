"""Sibling presets match the published config.json files shipped in examples/."""

import os

import pytest

from flintgen import PRESETS, spec_from_hf_config
from flintgen.kernels import KERNELS
from flintgen.kernels.base import Target

CFG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_configs")


@pytest.mark.parametrize("name", ["gpt-oss-20b", "qwen3-8b", "llama-3.1-8b"])
def test_preset_matches_config_json(name):
    assert spec_from_hf_config(os.path.join(CFG, f"{name}.json"), name=name) == PRESETS[name]


def test_unneeded_variants_are_not_built():
    """No window -> no sliding (cluster) variant of decode attention."""
    t = Target("sm_90a", 132)
    for name in ("qwen3-8b", "llama-3.1-8b"):
        vs = KERNELS["decode_attention"].variants(PRESETS[name], t)
        assert vs and not any(dict(v.params)["sliding"] for v in vs)
    vs = KERNELS["decode_attention"].variants(PRESETS["gpt-oss-20b"], t)
    assert any(dict(v.params)["sliding"] for v in vs) and any(not dict(v.params)["sliding"] for v in vs)
