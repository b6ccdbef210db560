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


# One composed shape per head dim the presets lack: Phi-3-mini's 96 (3-CTA QKV
# clusters, MHA decode) and Gemma-3-1B's 256 (q / k norm weights as (1 + w),
# K then V per slice, window and full layers).
COMPOSED = {
    "phi3-mini": PRESETS["flint"].replace(name="compose-phi3", hidden_size=3072, num_q_heads=32, num_kv_heads=32,
                                          head_dim=96, sinks=False, layer_types=("full",), sliding_window=None,
                                          weight_format="bf16", rope_theta=10000.0, tp_size=1, max_batch=8),
    "gemma-3-1b": PRESETS["flint"].replace(name="compose-gemma3", hidden_size=1152, num_q_heads=4, num_kv_heads=1,
                                           head_dim=256, sinks=False, sliding_window=512, norm_weight_offset=1,
                                           rope_theta=1e6, tp_size=1, max_batch=8),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PRESETS) + sorted(COMPOSED))
def test_preset_qkv_then_attention(name):
    """Every preset's kernels (and COMPOSED's head dims) composed on the H200:
    the QKV step writes the new token's K/V into the HND cache, decode
    attention (each layer kind the spec has) reads it; compared with the fp64
    reference."""
    import torch

    import flintgen
    from flintgen.references.decode_attention import decode_attention_ref, decode_attention_seed_rounding, rel_error
    from test_qkv import Case

    spec = PRESETS[name] if name in PRESETS else COMPOSED[name]
    qkv, attn = flintgen.get_kernel(spec, "qkv"), flintgen.get_kernel(spec, "decode_attention")
    b, d, page, kv, hq = 4, spec.head_dim, spec.page_size, spec.kv_heads_per_rank, spec.q_heads_per_rank
    blocks, width = 48, 12
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    c = Case(spec, b, seed=3, hnd=True)
    c.cache = (torch.randn(blocks, kv, page, 2 * d, generator=gen) * 0.5).bfloat16().cuda()
    c.k_cache, c.v_cache = c.cache[..., :d].permute(0, 2, 1, 3), c.cache[..., d:].permute(0, 2, 1, 3)
    lens = torch.tensor([1, 17, 129, 190], dtype=torch.int32)
    tables = torch.randperm(blocks, generator=gen)[: b * width].view(b, width).to(torch.int32)
    pos = (lens - 1).long()
    c.positions = pos.cuda()
    c.slots = (tables[torch.arange(b), pos // page].long() * page + pos % page).cuda()
    for t in range(b):
        s = int(c.slots[t])
        c.cache[s // page, :, s % page] = float("nan")
    q, _ = c.run(qkv, debug=False)
    assert not c.cache.isnan().any(), "the QKV step left a new slot unwritten"
    qv = q.view(b, hq, d)
    sinks = torch.randn(hq, generator=gen).cuda() if spec.sinks else None
    windows = ([spec.sliding_window] if spec.has_sliding else []) + ([None] if spec.has_full else [])
    for window in windows:
        out = torch.full_like(qv, float("nan"))
        a = (qv, c.cache, tables.cuda(), lens.cuda(), sinks, window, spec.scale)
        attn(*a, out)
        torch.cuda.synchronize()
        ref = decode_attention_ref(*a)
        ek, et = rel_error(out, ref), rel_error(decode_attention_seed_rounding(*a), ref)
        assert ek <= 2 * et + 1e-6 and ek < 1e-2, (name, window, ek, et)


def test_named_and_set_ops_are_one_object(monkeypatch):
    """get_kernel(spec, name) and get_kernel(spec)[name] share the op (one
    workspace, one warmup), and a kernel the rest of the set refuses does not
    stop its sibling: a head_dim-96 spec binds decode attention alone."""
    monkeypatch.setenv("FLINTGEN_ARCH", "sm_90a")
    monkeypatch.setenv("FLINTGEN_NUM_SMS", "132")
    import flintgen

    spec = flintgen.get_preset("flint").replace(name="one-op")
    assert flintgen.get_kernel(spec, "decode_attention") is flintgen.get_kernel(spec)["decode_attention"]
    phi3 = spec.replace(name="phi3-like", num_q_heads=32, num_kv_heads=32, head_dim=96, hidden_size=3072)
    assert flintgen.get_kernel(phi3, "decode_attention").head_dim == 96
