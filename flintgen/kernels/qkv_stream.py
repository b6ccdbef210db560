"""The streaming design of the fused QKV GEMV (templates/qkv_stream.py.j2): its
launch config, variant parameters, argument table and workspace.

QKVDef (flintgen.kernels.qkv) renders a variant with ``design = "stream"``
from this template; everything else (spec checks, the RMSNorm kernel, the
epilogue's lane mapping, the op's validation) is the fused QKV step's.
Weights: bf16 (NVFP4 runs the cluster design).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from flintgen import layout
from flintgen.configs.qkv_stream_plan import (MAX_L2_PREFETCH, STREAM_STAGES, StreamConfig, StreamPlan,  # noqa: F401
                                             stream_config)
from flintgen.kernels.base import Target, Variant
from flintgen.kernels.workspace import DeviceBuffers
from flintgen.layout import EpilogueLanes
from flintgen.spec import Spec

TEMPLATE = "qkv_stream.py.j2"
DESIGN = "stream"
# What the design needs in every variant's PTX (tests/test_compile.py).
COUNTER_PTX = ("atom.acq_rel.gpu.global.add.s32", "st.relaxed.gpu.global.s32")   # the workspace finish's
REQUIRED_PTX = ("griddepcontrol.launch_dependents", "griddepcontrol.wait", "cp.async.cg.shared.global",
                "cp.async.wait_group") + COUNTER_PTX
MMA_PTX = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
WGMMA_PTX = ("wgmma.mma_async.sync.aligned", "fence.proxy.async.shared::cta", "wgmma.wait_group.sync.aligned")
CLUSTER_PTX = ("barrier.cluster.arrive", "barrier.cluster.wait", "mapa.shared::cluster.u32",
               "st.shared::cluster.v4.f32")
TMA_PTX = ("cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes", "mbarrier.try_wait",
           "elect.sync")


def required_ptx(v: Variant) -> tuple[str, ...]:
    """What a streaming variant's PTX must hold: the design's instructions and its MMA's."""
    p = dict(v.params)
    need = REQUIRED_PTX + (WGMMA_PTX if p.get("wgmma") else (MMA_PTX,))
    if p.get("tma"):   # no cp.async, so no proxy fence for it: TMA writes through the async proxy wgmma reads
        need = tuple(i for i in need if not i.startswith(("cp.async.", "fence.proxy.async"))) + TMA_PTX
    if p.get("dsmem_reduce"):   # partials reduced through DSMEM: no counter
        need = tuple(i for i in need if i not in COUNTER_PTX) + CLUSTER_PTX
    return need


def is_stream(v: Variant) -> bool:
    """Whether ``v`` is a binary of the streaming design."""
    return dict(v.params).get("design") == DESIGN


@dataclass(frozen=True)
class Arg:
    name: str
    ann: str   # annotation in the rendered signatures


def args_of(p: Mapping[str, Any]) -> list[Arg]:
    """The kernel's argument table (variant params ``p``), in call order: the
    template renders every signature from it and the op passes its tensors by it."""
    T = "cute.Tensor"
    out = [Arg("xn", T), Arg("weight", T)]
    if p["bias"]:
        out.append(Arg("bias", T))
    if p["qk_norm"]:
        out += [Arg("q_norm_weight", T), Arg("k_norm_weight", T)]
    if p["rope"]:
        out += [Arg("cos_sin", T), Arg("positions", T)]
    out += [Arg("slot_mapping", T), Arg("q", T), Arg("k_cache", T), Arg("v_cache", T)]
    if p.get("kv_dtype", "bf16") == "fp8_e4m3":
        out += [Arg("k_scale", T), Arg("v_scale", T)]
    out += [Arg("workspace", T), Arg("counters", T)]
    if p["debug"]:
        out.append(Arg("pre", T))
    if p["qk_norm"]:
        out.append(Arg("qk_eps", "Float32"))
    return out


def plan_of(p: Mapping[str, Any]) -> StreamPlan:
    return StreamPlan(hidden=p["hidden"], head_dim=p["head_dim"], heads=p["q_heads"] + 2 * p["kv_heads"],
                      ctas=p["ctas"], max_m=p["max_m"], stages=p["stages"], warp_tiles=p.get("warp_tiles", 1),
                      prefetch=p.get("prefetch", 0), ctas_per_sm=p.get("ctas_per_sm", 1),
                      wgmma=p.get("wgmma", False), finish_tokens=p.get("finish_tokens", 0),
                      l2_prefetch=p.get("l2_prefetch", 0), tma=p.get("tma", False), splits=p.get("splits", 0),
                      cluster=p.get("dsmem_reduce", False), unit_steps=p.get("unit_steps", 1))


def variant(spec: Spec, cfg: StreamConfig, target: Target, max_m: int, debug: bool) -> Variant:
    if spec.weight_format != "bf16":
        raise ValueError(f"qkv: the streaming design takes bf16 weights, spec {spec.name!r} has "
                         f"{spec.weight_format!r}: use the cluster design (QKVConfig) for NVFP4")
    p = dict(design=DESIGN, hidden=spec.hidden_size, q_heads=spec.q_heads_per_rank,
             kv_heads=spec.kv_heads_per_rank, head_dim=spec.head_dim, weight_format="bf16", bias=spec.qkv_bias,
             rope=spec.rope_style != "none", rope_dim=spec.rope_dim, interleaved=spec.rope_style == "interleaved",
             qk_norm=spec.qk_norm, norm_offset=spec.norm_weight_offset if spec.qk_norm else 0, debug=debug,
             max_m=max_m, ctas=target.num_sms, stages=cfg.stages, kv_dtype=spec.kv_cache_dtype)
    # the defaults stay out of the params (and the cache keys of binaries built before them)
    for name, default in (("warp_tiles", 1), ("prefetch", 0), ("ctas_per_sm", 1), ("wgmma", False),
                          ("l2_prefetch", 0), ("tma", False), ("splits", 0), ("unit_steps", 1),
                          ("evict_first", False), ("l2_prefetch_group", 1)):
        if getattr(cfg, name) != default:
            p[name] = getattr(cfg, name)
    # StreamConfig.cluster (a bool here; the cluster design's "cluster" param counts CTAs), at every tile:
    # ranks past the tile's n-tiles finish no tokens (StreamPlan.slice_tokens)
    if cfg.cluster:
        p["dsmem_reduce"] = True
    if cfg.finish_tokens:
        p["finish_tokens"] = cfg.tokens_for(max_m)
    plan_of(p)   # raises where the shape does not fit
    return Variant.of("qkv", **p)


def render_params(p: Mapping[str, Any]) -> dict[str, Any]:
    plan = plan_of(p)
    kv = layout.kv_dtype(p["kv_dtype"])
    lanes = EpilogueLanes.of(p["head_dim"], p["rope_dim"] if p["rope"] else p["head_dim"], p["interleaved"])
    args = args_of(p)
    return {
        "args": args, "arg_names": ", ".join(a.name for a in args),
        "arg_sig": ", ".join(f"{a.name}: {a.ann}" for a in args), "hidden": p["hidden"], "head_dim": p["head_dim"], "q_heads": p["q_heads"],
        "kv_heads": p["kv_heads"], "n_rows": (p["q_heads"] + 2 * p["kv_heads"]) * p["head_dim"],
        "max_m": p["max_m"], "block_rows": plan.block_rows, "warps": plan.warps, "warp_tiles": plan.warp_tiles,
        "blocks_per_head": plan.blocks_per_head, "units": plan.units, "grid": plan.grid,
        "max_segments": plan.max_segments, "max_contributors": plan.max_contributors,
        "stages": 0 if plan.prefetch else plan.ring_stages, "stage_bytes": plan.stage_bytes,
        "lookahead": 0 if plan.prefetch else plan.lookahead,
        "prefetch": plan.prefetch, "ctas_per_sm": plan.ctas_per_sm, "use_wgmma": plan.wgmma, "xn_slots": plan.xn_slots,
        "xn_by_unit": plan.xn_by_unit, "merge_floats": plan.merge_floats, "merge_ntiles": plan.merge_ntiles,
        "finish_slices": plan.finish_slices if plan.finish_tokens else 0, "finish_total": plan.finish_total,
        "max_owned": plan.max_owned, "l2_prefetch": plan.l2_prefetch, "max_units": plan.max_units,
        "tma": plan.tma, "evict_first": p.get("evict_first", False),
        "l2_group": p.get("l2_prefetch_group", 1), "splits": plan.splits, "cluster": plan.cluster,
        "slice_values": plan.slice_values,
        "recv_bytes": plan.recv_bytes, "unit_steps": plan.unit_steps, "slice_tokens": plan.slice_tokens,
        "workspace_floats": plan.workspace_floats, "has_bias": p["bias"], "has_rope": p["rope"],
        "has_qk_norm": p["qk_norm"], "norm_offset": p["norm_offset"], "rope_dim": lanes.rope_dim,
        "interleaved": lanes.interleaved, "pair_e": lanes.pair_e, "pair_lanes": lanes.pair_lanes,
        "pass_e": lanes.pass_e, "pass_lanes": lanes.pass_lanes, "debug": p["debug"],
        "kv_type": kv.cutlass_type, "kv_elem_bytes": kv.elem_bytes, "kv_fp8": kv.name == "fp8_e4m3",
    }


def workspace(floats: int, heads: int) -> DeviceBuffers:
    """An op's buffers for its streaming binaries, per device: fp32 partials
    (``floats``: the largest plan's) and per-head arrival counters, zeroed
    once; every launch leaves the counters at zero again."""
    import torch

    return DeviceBuffers("qkv", lambda device: (
        torch.empty(max(floats, 1), dtype=torch.float32, device=device),
        torch.zeros(max(heads, 1), dtype=torch.int32, device=device)))
