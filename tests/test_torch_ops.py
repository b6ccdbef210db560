"""torch.library registration: tracing on any machine, running on the GPU."""

import pytest
import torch

import flintgen
import flintgen.torch_ops  # noqa: F401  (registers torch.ops.flintgen.*)
from flintgen.references.rms_norm import bf16_ulp, rms_norm_ref

KEY = flintgen.get_preset("flint").canonical_json()


def _f(x, res, w):
    xn, r = torch.ops.flintgen.fused_add_rms_norm(x, res, w, 1e-6, KEY)
    return torch.ops.flintgen.rms_norm(xn * 2, w, 1e-6, KEY), r


def test_ops_registered_with_fake_impls():
    for name in ("rms_norm", "fused_add_rms_norm", "decode_attention", "qkv"):
        assert hasattr(torch.ops.flintgen, name)
    torch.library.opcheck  # noqa: B018 - available in this torch


def test_traces_on_meta_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 2048, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
        y, r = _f(x, x, torch.empty(2048, dtype=torch.bfloat16, device=x.device))
        assert y.shape == (4, 2048) and r.shape == (4, 2048) and y.dtype == torch.bfloat16


def test_fake_tracing_builds_a_graph_of_the_ops():
    """make_fx in fake mode traces through the ops via their fake impls (what
    torch.compile's AOT tracing does); no kernel runs, so this works on the CPU."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.empty(2, 2048, dtype=torch.bfloat16)
    gm = make_fx(_f, tracing_mode="fake")(x, x, torch.empty(2048, dtype=torch.bfloat16))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "flintgen.fused_add_rms_norm.default" in targets and "flintgen.rms_norm.default" in targets


@pytest.mark.gpu
def test_compiled_and_graph_captured_run():
    torch.manual_seed(0)
    x = torch.randn(3, 2048, device="cuda").bfloat16()
    res = torch.randn_like(x)
    w = torch.randn(2048, device="cuda").bfloat16()
    flintgen.warmup("flint", ["rms_norm"])
    fn = torch.compile(_f, fullgraph=True)
    y, r = fn(x, res, w)
    ref1, rr = rms_norm_ref(x, w, 1e-6, res)
    ref2, _ = rms_norm_ref((ref1.bfloat16() * 2), w, 1e-6)
    assert torch.equal(r, rr)
    assert ((y.float() - ref2).abs() <= 2 * bf16_ulp(ref2)).all()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        out = _f(x, res, w)
    x.copy_(torch.randn_like(x.float()).bfloat16())
    g.replay()
    torch.cuda.synchronize()
    ref1, rr = rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(out[1], rr)


def test_qkv_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = flintgen.get_preset("flint")
    with FakeTensorMode():
        x = torch.empty(3, 2048, dtype=torch.bfloat16)
        e = torch.empty(1)
        q, r = torch.ops.flintgen.qkv(x, x, e, e, e, e, e, e, e, e, e, e, e, None, 1e-6, 1e-6, KEY)
        assert q.shape == (3, spec.q_heads_per_rank * 128) and r.shape == (3, 2048)


def test_fake_tracing_qkv_and_decode_attention():
    """The mutating ops trace too: qkv (writes k_cache / v_cache) feeding
    decode_attention (writes out), as a decode step chains them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    spec = flintgen.get_preset("flint")
    hq, d, hkv = spec.q_heads_per_rank, spec.head_dim, spec.kv_heads_per_rank
    bf = torch.bfloat16

    def step(x, res, cache, bt, lens, sinks, pos, slots, out):
        k, v = cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)
        e = torch.empty(0)
        q, r = torch.ops.flintgen.qkv(x, res, e, e, e, e, e, e, e, pos, k, v, slots, None, 1e-6, 1e-6, KEY)
        torch.ops.flintgen.decode_attention(q.view(-1, hq, d), cache, bt, lens, sinks, 128, 0.08, out, KEY)
        return out, r

    args = (torch.empty(2, 2048, dtype=bf), torch.empty(2, 2048, dtype=bf), torch.empty(8, hkv, 16, 2 * d, dtype=bf),
            torch.empty(2, 4, dtype=torch.int32), torch.empty(2, dtype=torch.int32), torch.empty(hq),
            torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.int64), torch.empty(2, hq, d, dtype=bf))
    gm = make_fx(step, tracing_mode="fake")(*args)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "flintgen.qkv.default" in targets and "flintgen.decode_attention.default" in targets


def test_fake_tracing_decode_attention_with_softcap():
    """decode_attention's optional ``softcap`` (default None) traces as an op
    argument, and the op's schema declares it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    schema = str(torch.ops.flintgen.decode_attention.default._schema)
    assert schema.endswith("str spec, float? softcap=None, Tensor? k_scale=None, Tensor? v_scale=None) -> ()"), schema
    key = flintgen.get_preset("flint").replace(attn_logit_softcap=True).canonical_json()
    bf = torch.bfloat16

    def step(q, cache, bt, lens, sinks, out):
        torch.ops.flintgen.decode_attention(q, cache, bt, lens, sinks, None, 0.08, out, key, softcap=50.0)
        return out

    args = (torch.empty(2, 32, 128, dtype=bf), torch.empty(8, 4, 16, 256, dtype=bf),
            torch.empty(2, 4, dtype=torch.int32), torch.empty(2, dtype=torch.int32), torch.empty(32),
            torch.empty(2, 32, 128, dtype=bf))
    gm = make_fx(step, tracing_mode="fake")(*args)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "decode_attention" in str(n.target)]
    assert len(calls) == 1 and 50.0 in list(calls[0].args) + list(calls[0].kwargs.values())


@pytest.mark.gpu
def test_qkv_then_decode_attention_ops_compiled_and_graph_replayed():
    """The mutating ops on the GPU: torch.compile(fullgraph) of a decode step
    (qkv writes the new token's K/V into flint's HND cache, decode_attention
    reads it) gives the bits of the kernels called directly, attention is
    within the fp64 reference's bound, and a CUDA graph of the compiled step
    replays with new activations, positions, slots and lengths."""
    from test_qkv import Case as QKVCase

    from flintgen.references.decode_attention import (decode_attention_ref, decode_attention_seed_rounding,
                                                      rel_error)

    spec = flintgen.get_preset("flint")
    hq, d, hkv, page = spec.q_heads_per_rank, spec.head_dim, spec.kv_heads_per_rank, spec.page_size
    b, blocks, width = 4, 48, 12
    flintgen.warmup(spec, ["qkv", "decode_attention"])
    gen = torch.Generator().manual_seed(21)
    c = QKVCase(spec, b, seed=21, hnd=True)
    cache = (torch.randn(blocks, hkv, page, 2 * d, generator=gen) * 0.5).bfloat16().cuda()
    tables = torch.randperm(blocks, generator=gen)[: b * width].view(b, width).int().cuda()
    lens = torch.zeros(b, dtype=torch.int32, device="cuda")
    pos = torch.zeros(b, dtype=torch.int64, device="cuda")
    slots = torch.zeros(b, dtype=torch.int64, device="cuda")
    sinks = torch.randn(hq, generator=gen).cuda()
    out = torch.full((b, hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    x, res = c.x.clone(), c.residual.clone()

    def set_lens(new_lens):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        p = lens.long() - 1
        pos.copy_(p)
        slots.copy_(tables.long()[torch.arange(b, device="cuda"), p // page] * page + p % page)

    def step(x, res):
        k, v = cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)
        q, r = torch.ops.flintgen.qkv(x, res, c.norm_weight, c.weight, c.weight_scale, c.global_scale, c.q_norm,
                                      c.k_norm, c.cos_sin, pos, k, v, slots, c.bias, spec.rms_eps, spec.rms_eps,
                                      KEY)
        torch.ops.flintgen.decode_attention(q.view(b, hq, d), cache, tables, lens, sinks, None, spec.scale, out,
                                            KEY)
        return q, r

    def direct():
        """The same step through get_kernel, on a copy of the cache."""
        kc = cache.clone()
        q, r = flintgen.get_kernel(spec, "qkv")(x, res, c.norm_weight, c.weight, c.weight_scale, c.global_scale,
                                                c.q_norm, c.k_norm, c.cos_sin, pos, kc[..., :d].transpose(1, 2),
                                                kc[..., d:].transpose(1, 2), slots, c.bias)
        o = torch.empty_like(out)
        flintgen.get_kernel(spec, "decode_attention")(q.view(b, hq, d), kc, tables, lens, sinks, None,
                                                      spec.scale, o)
        return q.clone(), r.clone(), kc, o

    def check(q, r, label):
        want_q, want_r, want_cache, want_out = direct_result
        assert torch.equal(q, want_q) and torch.equal(r, want_r), f"{label}: qkv op differs from the kernel"
        assert torch.equal(cache, want_cache), f"{label}: cache writes differ from the kernel's"
        assert torch.equal(out, want_out), f"{label}: attention op differs from the kernel"
        a = (q.view(b, hq, d), cache, tables, lens, sinks, None, spec.scale)
        ek, et = rel_error(out, decode_attention_ref(*a)), rel_error(decode_attention_seed_rounding(*a),
                                                                    decode_attention_ref(*a))
        assert ek <= 2 * et + 1e-6 and ek < 1e-2, (label, ek, et)

    compiled = torch.compile(step, fullgraph=True)
    set_lens([1, 17, 100, 160])
    direct_result = direct()
    q, r = compiled(x, res)
    torch.cuda.synchronize()
    check(q, r, "compiled")

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        compiled(x, res)                               # warm the compiled graph on the capture stream
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            gq, gr = compiled(x, res)
    torch.cuda.synchronize()
    for i, new_lens in enumerate(([33, 2, 191, 64], [160, 161, 16, 15], [5, 80, 120, 1])):
        x.copy_(torch.randn(x.shape, generator=gen).bfloat16())
        res.copy_(torch.randn(res.shape, generator=gen).bfloat16())
        set_lens(new_lens)
        direct_result = direct()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(gq, gr, f"replay {i}")


def test_fp8_scales_in_the_schemas_and_fake_tracing_with_fp8_caches():
    """qkv and decode_attention take k_scale / v_scale (optional, last); their
    fake implementations trace with uint8 (vLLM) and float8 caches."""
    from torch.fx.experimental.proxy_tensor import make_fx

    for name in ("qkv", "decode_attention"):
        schema = str(getattr(torch.ops.flintgen, name).default._schema)
        assert "str spec" in schema and "Tensor? k_scale=None, Tensor? v_scale=None)" in schema, schema
    spec = flintgen.get_preset("flint").replace(kv_cache_dtype="fp8_e4m3")
    key = spec.canonical_json()
    hq, d, hkv = spec.q_heads_per_rank, spec.head_dim, spec.kv_heads_per_rank
    bf = torch.bfloat16

    def step(x, res, cache, bt, lens, sinks, pos, slots, out, ks, vs):
        k, v = cache[..., :d].transpose(1, 2), cache[..., d:].transpose(1, 2)
        e = torch.empty(0)
        q, r = torch.ops.flintgen.qkv(x, res, e, e, e, e, e, e, e, pos, k, v, slots, None, 1e-6, 1e-6, key, ks, vs)
        torch.ops.flintgen.decode_attention(q.view(-1, hq, d), cache, bt, lens, sinks, 128, 0.08, out, key,
                                            k_scale=ks, v_scale=vs)
        return out, r

    for dtype in (torch.uint8, torch.float8_e4m3fn):
        args = (torch.empty(2, 2048, dtype=bf), torch.empty(2, 2048, dtype=bf),
                torch.empty(8, hkv, 16, 2 * d, dtype=dtype), torch.empty(2, 4, dtype=torch.int32),
                torch.empty(2, dtype=torch.int32), torch.empty(hq), torch.empty(2, dtype=torch.int64),
                torch.empty(2, dtype=torch.int64), torch.empty(2, hq, d, dtype=bf), torch.ones(1), torch.ones(1))
        gm = make_fx(step, tracing_mode="fake")(*args)
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and "flintgen" in str(n.target)]
        assert [str(n.target) for n in calls] == ["flintgen.qkv.default", "flintgen.decode_attention.default"]
        for n in calls:
            scale_args = [a for a in list(n.args) + list(n.kwargs.values()) if isinstance(a, torch.fx.Node)
                          and a.name in ("ks_1", "vs_1")]
            assert len(scale_args) == 2, (n.target, n.args, n.kwargs)


def test_qkv_fake_shapes_token_tiles():
    """A max_tokens-64 spec: the fake implementation gives every M its shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = flintgen.get_preset("flint").replace(max_tokens=64)
    key = spec.canonical_json()
    with FakeTensorMode():
        for m in (1, 9, 33, 64):
            x = torch.empty(m, 2048, dtype=torch.bfloat16)
            e = torch.empty(1)
            q, r = torch.ops.flintgen.qkv(x, x, e, e, e, e, e, e, e, e, e, e, e, None, 1e-6, 1e-6, key)
            assert q.shape == (m, spec.q_heads_per_rank * 128) and r.shape == (m, 2048)


@pytest.mark.gpu
def test_qkv_op_token_tiles_compiled_and_graph_replayed():
    """max_tokens 64: after flintgen.warmup (every token tile's binary), the
    compiled op at M = 9, 33 and 64 gives the kernel's bits, and a CUDA graph
    captured at each M replays them."""
    from test_qkv import Case as QKVCase

    spec = flintgen.get_preset("flint").replace(max_tokens=64)
    key = spec.canonical_json()
    flintgen.warmup(spec, ["qkv"])
    op = flintgen.get_kernel(spec, "qkv")

    def step(c, k, v):
        return torch.ops.flintgen.qkv(c.x, c.residual, c.norm_weight, c.weight, c.weight_scale, c.global_scale,
                                      c.q_norm, c.k_norm, c.cos_sin, c.positions, k, v, c.slots, c.bias,
                                      spec.rms_eps, spec.rms_eps, key)

    compiled = torch.compile(step, fullgraph=True)
    for m in (9, 33, 64):
        c = QKVCase(spec, m, seed=40 + m, n_slots=m - 2)
        want_q, want_r = (t.clone() for t in op(*c.args()))
        want_k, want_v = c.k_cache.clone(), c.v_cache.clone()
        c.poison()
        q, r = compiled(c, c.k_cache, c.v_cache)
        torch.cuda.synchronize()
        assert torch.equal(q, want_q) and torch.equal(r, want_r), f"M={m}"
        assert torch.equal(c.k_cache.nan_to_num(7.0), want_k.nan_to_num(7.0)), f"M={m}"
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            compiled(c, c.k_cache, c.v_cache)
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                gq, gr = compiled(c, c.k_cache, c.v_cache)
        c.poison()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(gq, want_q) and torch.equal(gr, want_r), f"replay M={m}"
        assert torch.equal(c.v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0)), f"replay M={m}"
