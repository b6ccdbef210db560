"""The fused QKV step's per-head epilogue on the CPU: its lane mapping
(flintgen.layout.EpilogueLanes: head_dim 96, partial rotary,
NeoX / interleaved pairs) emulated index by index against the fp32
reference, the refusals of rotary dims it cannot split, and the references
of the GPU tests (tests/test_qkv.py, ROPE_CASES) telling the variants apart:
a kernel computing plain whole-head NeoX, or w instead of (1 + w), fails them.
"""

from __future__ import annotations

import pytest
import torch

from flintgen import quant
from flintgen.layout import EpilogueLanes
from flintgen.presets import FLINT
from flintgen.references.qkv import qk_norm_rope_ref, within_ulp
from test_qkv import KDEF, ROPE_CASES, SPECS, T132


def _emulate_epilogue(pre, lanes, w=None, offset=0, cs=None, eps=1e-6):
    """The per-head epilogue's index math on the CPU, one token row: ``pre``
    [D] fp32, ``w`` [D] (q/k norm weight), ``cs`` [R] (cos | sin row). Each of
    the 32 lanes loads what head_epilogue loads (clamped past the active
    lanes), the sum of squares adds the active lanes only, and active lanes
    store. Returns (out [D], stores per element)."""
    D, R, P, S = lanes.head_dim, lanes.rope_dim, lanes.pair_e, lanes.pass_e
    out = torch.full((D,), float("nan"))
    count = torch.zeros(D, dtype=torch.int64)
    per_lane, ss = [], torch.zeros((), dtype=torch.float32)
    for lane in range(32):
        lp = min(lane, lanes.pair_lanes - 1)
        if lanes.interleaved:
            run = lp * 2 * P + torch.arange(2 * P)
            ia, ib = run[0::2], run[1::2]
        else:
            ia = lp * P + torch.arange(P)
            ib = ia + R // 2
        cols = lp * P + torch.arange(P)                       # cos columns (sin: + R/2)
        ip = R + min(lane, lanes.pass_lanes - 1) * S + torch.arange(S) if S else torch.arange(0)
        for idx in (ia, ib, ip):
            assert ((0 <= idx) & (idx < D)).all()
        assert (cols < R // 2).all()
        if lane < lanes.pair_lanes:
            ss = ss + (pre[ia] ** 2 + pre[ib] ** 2).sum()
        if S and lane < lanes.pass_lanes:
            ss = ss + (pre[ip] ** 2).sum()
        per_lane.append((lane, ia, ib, ip, cols))
    rstd = torch.rsqrt(ss / D + eps) if w is not None else None
    for lane, ia, ib, ip, cols in per_lane:
        xa, xb, xp = pre[ia], pre[ib], pre[ip]
        if w is not None:
            f = w + float(offset)
            xa, xb, xp = xa * rstd * f[ia], xb * rstd * f[ib], xp * rstd * f[ip]
        if cs is not None:
            c, s_ = cs[cols], cs[R // 2 + cols]
            xa, xb = xa * c - xb * s_, xb * c + xa * s_
        if lane < lanes.pair_lanes:
            out[ia], out[ib] = xa, xb
            count[ia] += 1
            count[ib] += 1
        if S and lane < lanes.pass_lanes:
            out[ip] = xp
            count[ip] += 1
    return out, count


def _emulate_v(lanes):
    """Elements the v copy stores, per element (must be 1 each)."""
    D, E = lanes.head_dim, lanes.v_e
    count = torch.zeros(D, dtype=torch.int64)
    for lane in range(lanes.v_lanes):
        run = lane * E + torch.arange(E)
        count[run] += 1
        count[run + D // 2] += 1
    return count


LANE_CASES = [(128, 128, False), (96, 96, False), (64, 64, False), (256, 256, False), (128, 64, True),
              (128, 64, False), (128, 96, False), (128, 128, True), (96, 96, True), (96, 24, False),
              (256, 64, False), (256, 256, True), (128, 32, True), (64, 16, False), (256, 128, True)]


@pytest.mark.parametrize("d, r, inter", LANE_CASES, ids=[f"d{d}r{r}{'i' if i else 'n'}" for d, r, i in LANE_CASES])
def test_epilogue_lane_mapping_matches_reference(d, r, inter):
    """Every element stored exactly once, pairs and cos / sin columns as the
    reference pairs them, the norm over all D dims: the emulated epilogue is
    within 1 ulp of qk_norm_rope_ref for norm + rope, norm only and rope only."""
    lanes = EpilogueLanes.of(d, r, inter)
    assert torch.equal(_emulate_v(lanes), torch.ones(d, dtype=torch.int64))
    g = torch.Generator().manual_seed(d + r + inter)
    pre = torch.randn(1, d, generator=g).bfloat16()
    w = (torch.randn(d, generator=g) * 0.3).bfloat16()
    cs = torch.rand(4, r, generator=g) * 2 - 1
    pos = torch.tensor([2])
    style = "interleaved" if inter else "neox"
    for norm, rope, off in ((True, True, 0), (True, True, 1), (True, False, 0), (False, True, 0)):
        out, count = _emulate_epilogue(pre[0].float(), lanes, w.float() if norm else None, off,
                                       cs[2] if rope else None)
        assert torch.equal(count, torch.ones(d, dtype=torch.int64)), count
        ref, mag = qk_norm_rope_ref(pre, d, w if norm else None, 1e-6, cs if rope else None, pos, style, off)
        ok = within_ulp(out[None].bfloat16(), ref, floor=2.0 ** -19 * mag)
        assert ok.all(), (norm, rope, off, int((~ok).sum()))


def test_unsplittable_rotary_dims_are_refused():
    """rotary_dims whose runs would not be aligned: ValueError with the value,
    what is supported and the fix (at build time, before any compile)."""
    for bad, what in ((FLINT.replace(rotary_dim=2), r"rotary_dim = 2 is not supported with head_dim 128: the 126 "
                                                    r"pass-through dims go 4 per lane.*use a rotary_dim that is"),
                      (FLINT.replace(head_dim=256, num_q_heads=16, num_kv_heads=2, rotary_dim=132),
                       r"rotary_dim = 132 .*multiple of 4 \(supported: rotary_dim <= 64 any even, <= 128 a multiple "
                       r"of 4, <= 256 a multiple of 8\); use the whole head")):
        with pytest.raises(ValueError, match=r"kernel qkv \(spec 'flint'\): qkv: " + what):
            KDEF.variants(bad, T132)


def _wrong_refs(spec):
    """(label, kwargs) of what a kernel ignoring one of the spec's epilogue
    features would compute instead: NeoX for interleaved, the whole-head
    table for partial rotary, w for (1 + w)."""
    out = []
    if spec.rope_style == "interleaved":
        out.append(("neox pairs", dict(rope_style="neox")))
    if spec.rope_style == "neox" and spec.rope_dim < spec.head_dim:
        out.append(("interleaved pairs", dict(rope_style="interleaved")))
    if spec.rope_dim < spec.head_dim:
        whole = spec.replace(rotary_dim=None, rope_scaling="none", rope_scaling_params={})
        out.append(("whole-head neox", dict(cos_sin=quant.rope_table(whole, 4096), rope_style="neox")))
    if spec.norm_weight_offset:
        out.append(("w instead of 1 + w", dict(norm_weight_offset=0)))
    return out


@pytest.mark.parametrize("name", [n for n in ROPE_CASES if _wrong_refs(SPECS[n])])
def test_references_tell_rope_variants_apart(name):
    """The GPU check (Case.check's criterion) would fail a kernel that
    computed plain whole-head NeoX, or ignored the norm offset: each such
    result differs from the spec's reference on most rotated elements (the
    offset: on most elements)."""
    spec = SPECS[name]
    d, h = spec.head_dim, 4
    g = torch.Generator().manual_seed(5)
    pre = torch.randn(3, h * d, generator=g).bfloat16()
    shift = 0.0 if spec.norm_weight_offset else 1.0
    w = (torch.randn(d, generator=g) * 0.3 + shift).bfloat16() if spec.qk_norm else None
    pos = torch.tensor([100, 1777, 4000])
    right = dict(cos_sin=quant.rope_table(spec, 4096), rope_style=spec.rope_style,
                 norm_weight_offset=spec.norm_weight_offset)

    def ref(**k):
        a = dict(right, **k)
        return qk_norm_rope_ref(pre, d, w, 1e-6, a["cos_sin"], pos, a["rope_style"], a["norm_weight_offset"])

    want, mag = ref()
    for label, change in _wrong_refs(spec):
        got, _ = ref(**change)
        bad = ~within_ulp(got.bfloat16(), want, floor=2.0 ** -19 * mag)
        frac = bad.view(3, h, d)[..., :spec.rope_dim].float().mean()
        assert frac > 0.5, (label, float(frac))
    if spec.rope_dim < d:                                  # the pass-through dims are the normalized rows
        x = pre.float().view(3, h, d)
        if w is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.float() + spec.norm_weight_offset)
        assert torch.equal(want.view(3, h, d)[..., spec.rope_dim:], x[..., spec.rope_dim:])
