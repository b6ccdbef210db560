"""rms_norm / fused_add_rms_norm: validation on any machine, numerics on the GPU."""

import pytest
import torch

import flintgen
from flintgen.presets import FLINT
from flintgen.references.rms_norm import bf16_ulp, rms_norm_ref

H = FLINT.hidden_size


@pytest.fixture(scope="module")
def norm():
    return flintgen.get_kernel(FLINT, "rms_norm") if torch.cuda.is_available() else None


def _op():
    """An op bound without a GPU (validation happens before any load)."""
    from flintgen.kernels.rms_norm import RMSNormDef
    from flintgen.kernels.base import Target

    d = RMSNormDef()
    t = Target("sm_90a", 132)

    def load(v):
        raise AssertionError("validation must fail before loading")

    return d.bind(FLINT, t, load)


@pytest.mark.compile
@pytest.mark.parametrize("residual", [False, True])
def test_weight_prefetch_precedes_the_grid_dependency_wait(tmp_cache, sm90, residual):
    """The weight is loaded before griddepcontrol.wait with coherent,
    side-effecting loads (ptxas sinks ld.global.nc past the wait to its
    first use: seen in the QKV kernel's SASS); activations only after it."""
    from flintgen import cache
    from flintgen.kernels.rms_norm import RMSNormDef

    d = RMSNormDef()
    v = d.variants(FLINT, sm90)[int(residual)]
    entry = cache.make_entry(v, d.template, dict(d.render_params(FLINT, v)), sm90, str(tmp_cache))
    cache.get_or_build(entry)
    with open(entry.path("kernel.ptx")) as f:
        ptx = f.read()
    wait = ptx.index("griddepcontrol.wait")
    weight = ptx.index("ld.global.L1::no_allocate.v4.u32")
    assert weight < wait < ptx.index("ld.global.v4.u32")
    assert "ld.global.nc" not in ptx


def test_config_covers_every_hidden_size():
    """Every hidden size the kernel admits (multiples of 16 in its limits, the
    fused QKV step's 512..16384 among them): warp-multiple CTAs of <= 1024
    threads whose vectors cover the row, with fewer than a warp's worth of
    threads idle per vector round."""
    from flintgen.configs.rms_norm_config import RMSNormConfig
    from flintgen.kernels.rms_norm import RMSNormDef

    lo, hi = RMSNormDef.limits["hidden_size"]
    for h in range(lo, hi + 1, 16):
        c = RMSNormConfig.for_hidden(h)
        vecs = h // 8
        assert c.threads % 32 == 0 and 32 <= c.threads <= 1024, (h, c)
        assert c.threads * c.vec_per_thread >= vecs > c.threads * (c.vec_per_thread - 1), (h, c)
        if vecs <= 1024:
            assert c.threads - vecs < 32, (h, c)


def test_norm_weight_offset_is_a_variant_parameter():
    from flintgen.kernels.base import Target
    from flintgen.kernels.rms_norm import RMSNormDef

    d, t = RMSNormDef(), Target("sm_90a", 132)
    plain = d.variants(FLINT, t)
    assert [v.name for v in plain] == ["rms_norm-has_residual0-hidden2048", "rms_norm-has_residual1-hidden2048"]
    gemma = d.variants(FLINT.replace(norm_weight_offset=1), t)
    assert [v.name for v in gemma] == [v.name + "-norm_weight_offset1" for v in plain]
    assert [d.render_params(FLINT, v)["norm_weight_offset"] for v in plain + gemma] == [0, 0, 1, 1]


@pytest.mark.compile
@pytest.mark.parametrize("hidden", [896, 16384])
def test_norm_weight_offset_compiles(tmp_cache, sm90, hidden):
    """(f32(w) + 1) in fp32: an fp32 add of 1.0 to the weight feeds the
    product; no spills; the offset-0 binary has no such add."""
    from flintgen import cache
    from flintgen.kernels.rms_norm import RMSNormDef

    d = RMSNormDef()
    ptx = {}
    for off in (0, 1):
        spec = FLINT.replace(hidden_size=hidden, norm_weight_offset=off)
        v = d.variants(spec, sm90)[1]
        entry = cache.make_entry(v, d.template, dict(d.render_params(spec, v)), sm90, str(tmp_cache))
        cache.get_or_build(entry)
        res = cache.read_meta(entry)["resources"]
        assert res["spill_store_bytes"] == 0 and res["spill_load_bytes"] == 0 and not res["local_memory"], res
        with open(entry.path("kernel.ptx")) as f:
            ptx[off] = f.read()
        assert not [p for p in d.required_ptx if p not in ptx[off]]
    assert "add.f32" in ptx[1] and "0f3F800000" in ptx[1]     # + 1.0 in fp32
    assert "0f3F800000" not in ptx[0]


def test_rejects_cpu_tensor():
    x = torch.zeros(2, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x must be on a CUDA device, got cpu"):
        _op()(x, torch.ones(H, dtype=torch.bfloat16))


def test_rejects_dtype():
    with pytest.raises(TypeError, match=r"x must be torch.bfloat16, got torch.float32"):
        _op()(torch.zeros(2, H), torch.ones(H, dtype=torch.bfloat16))


def test_rejects_non_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        _op()([1.0], None)


def _meta(*shape, dtype=torch.bfloat16):
    # CUDA tensors are needed to get past the device check, so the shape and
    # layout rejections run on the GPU machine.
    return torch.empty(*shape, dtype=dtype, device="cuda")


@pytest.mark.gpu
class TestValidationOnGPU:
    def test_shapes(self):
        op = _op()
        with pytest.raises(ValueError, match=r"x must have last dimension 2048 \(the spec's size\), got shape \(2, 1024\)"):
            op(_meta(2, 1024), _meta(H))
        with pytest.raises(ValueError, match=r"weight must have shape \(2048,\), got \(1024,\)"):
            op(_meta(2, H), _meta(1024))
        with pytest.raises(ValueError, match=r"residual must have shape \(2, 2048\), got \(3, 2048\)"):
            op(_meta(2, H), _meta(H), residual=_meta(3, H))
        with pytest.raises(ValueError, match="x must be 2-D"):
            op(_meta(2, 2, H), _meta(H))

    def test_layout_and_args(self):
        op = _op()
        with pytest.raises(ValueError, match="x must be contiguous"):
            op(_meta(H, 4).t(), _meta(H))
        with pytest.raises(ValueError, match="x must be 16-byte aligned"):
            op(_meta(2 * H + 1)[1:].view(2, H), _meta(H))
        with pytest.raises(ValueError, match="eps must be a finite number > 0, got -1"):
            op(_meta(2, H), _meta(H), -1.0)
        with pytest.raises(ValueError, match="residual_out was given without residual"):
            op(_meta(2, H), _meta(H), residual_out=_meta(2, H))


def _check(out, ref):
    assert not torch.isnan(out).any()
    diff = (out.float() - ref).abs()
    assert (diff <= bf16_ulp(ref)).all(), f"max diff {diff.max().item()} exceeds 1 bf16 ulp"


def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def _run_poisoned(norm, x, w, eps, res):
    """(out, residual_out or None) of one call into NaN-poisoned outputs."""
    out = torch.full_like(x, float("nan"))
    res_out = None
    if res is not None:
        res_out = torch.full_like(x, float("nan"))
        norm(x, w, eps, res, out=out, residual_out=res_out)
    else:
        norm(x, w, eps, out=out)
    torch.cuda.synchronize()
    return out, res_out


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 3000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_numerics(norm, m, with_residual):
    torch.manual_seed(m * 2 + with_residual)
    x, w = _rand(m, H, scale=3.0), _rand(H, scale=0.5) + 1
    res = _rand(m, H, scale=3.0) if with_residual else None
    eps = 1e-6 if m % 2 else 1e-2  # eps is a runtime argument
    out, res_out = _run_poisoned(norm, x, w, eps, res)
    ref, r = rms_norm_ref(x, w, eps, res)
    _check(out, ref)
    if with_residual:
        assert torch.equal(res_out, r), "residual must be bit-exact against torch's bf16 add"


OFFSET_CASES = [(896, 1, False), (896, 8, True), (2048, 3, True), (3584, 5, False), (16384, 8, True),
                (16384, 2, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("hidden, m, with_residual", OFFSET_CASES,
                         ids=[f"h{h}-M{m}-{'res' if r else 'nores'}" for h, m, r in OFFSET_CASES])
def test_norm_weight_offset_numerics(hidden, m, with_residual):
    """spec.norm_weight_offset = 1 (Gemma): xn = bf16(r rstd (f32(w) + 1)),
    within 1 bf16 ulp of the fp64 reference, on Gemma-like weights stored
    around 0; poisoned outputs. Columns with w = -1 scale by exactly 0; on
    columns with w = 3 * 2^-10 (1 + w needs 10 bits: bf16(1 + w) = 1) the
    output is the correctly rounded fp64 value, which a kernel scaling by
    bf16(1 + w) misses on a good part of them (checked on the reference), and
    scaling by w alone fails the 1-ulp bound."""
    spec = FLINT.replace(hidden_size=hidden, norm_weight_offset=1)
    norm = flintgen.get_kernel(spec, "rms_norm")
    gen = torch.Generator().manual_seed(hidden + 10 * m + with_residual)
    x = (torch.randn(m, hidden, generator=gen) * 3).bfloat16().cuda()
    w = (torch.randn(hidden, generator=gen) * 0.3).bfloat16()
    fine = slice(5, None, 7)
    w[fine] = 3 * 2.0 ** -10
    w[::97] = -1.0
    w = w.cuda()
    res = (torch.randn(m, hidden, generator=gen) * 3).bfloat16().cuda() if with_residual else None
    eps = 1e-6
    out, res_out = _run_poisoned(norm, x, w, eps, res)
    ref, r = rms_norm_ref(x, w, eps, res, offset=1, dtype=torch.float64)
    _check(out, ref)
    if with_residual:
        assert torch.equal(res_out, r), "residual must be bit-exact against torch's bf16 add"
    assert (out[:, ::97] == 0).all()               # w = -1: (1 + w) = 0
    exact = (out[:, fine] == ref[:, fine].bfloat16()).double().mean().item()
    assert exact > 0.97, f"only {exact:.3f} of the w = 3 * 2^-10 outputs correctly rounded"
    rounded, _ = rms_norm_ref(x, (w.float() + 1).bfloat16(), eps, res, dtype=torch.float64)
    assert (rounded[:, fine].bfloat16() == ref[:, fine].bfloat16()).double().mean().item() < 0.9
    wrong, _ = rms_norm_ref(x, w, eps, res, dtype=torch.float64)
    assert ((out.double() - wrong).abs() > bf16_ulp(wrong)).any(), "the offset made no difference"


@pytest.mark.gpu
def test_in_place_residual_and_chain(norm):
    """A chain of layers reusing buffers, launched back to back (PDL), equals
    the same chain with a device sync between layers (which cannot race)."""
    torch.manual_seed(0)
    m, layers = 8, 16
    ws = [_rand(H, scale=0.5) + 1 for _ in range(layers)]
    x0, res0 = _rand(m, H), _rand(m, H)

    def chain(sync):
        x, res, out = x0.clone(), res0.clone(), torch.full_like(x0, float("nan"))
        for w in ws:  # out feeds the next layer; the residual is updated in place
            norm(x, w, 1e-6, res, out=out, residual_out=res)
            if sync:
                torch.cuda.synchronize()
            x, out = out, x
        torch.cuda.synchronize()
        return x, res

    fast, slow = chain(False), chain(True)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    # and the first layer against the reference, in place
    x, res, out = x0.clone(), res0.clone(), torch.empty_like(x0)
    norm(x, ws[0], 1e-6, res, out=out, residual_out=res)
    ref, r = rms_norm_ref(x0, ws[0], 1e-6, res0)
    assert torch.equal(res, r)
    _check(out, ref)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_inputs(norm):
    flintgen.warmup(FLINT, ["rms_norm"])
    m = 4
    x, res, w = _rand(m, H), _rand(m, H), _rand(H) + 1
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        norm(x, w, 1e-6, res, out=out, residual_out=res_out)
    for i in range(50):
        x.copy_(_rand(m, H, scale=1 + i))
        res.copy_(_rand(m, H))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, r = rms_norm_ref(x, w, 1e-6, res)
        assert torch.equal(res_out, r)
        _check(out, ref)


@pytest.mark.gpu
def test_first_use_inside_capture_raises():
    spec = FLINT.replace(hidden_size=1024)  # never loaded in this process
    norm = flintgen.get_kernel(spec, "rms_norm")
    x, w = _rand(2, 1024), _rand(1024)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"inside a CUDA-graph capture: call flintgen.warmup"):
        with torch.cuda.graph(g):
            norm(x, w)
