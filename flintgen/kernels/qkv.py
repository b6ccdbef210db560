"""Host side of the fused QKV step: (fused_add_)rms_norm, then the QKV GEMV
with per-head q/k RMSNorm, RoPE (NeoX or interleaved pairs, whole head or
partial rotary) and the paged KV-cache write.

    q, residual_out = op(x, residual, norm_weight, weight, weight_scale, global_scale,
                         q_norm_weight, k_norm_weight, cos_sin_cache, positions,
                         k_cache, v_cache, slot_mapping, bias=None, eps=None, qk_eps=None,
                         *, k_scale=None, v_scale=None)

Shapes (per tensor-parallel rank; D = head_dim, N = (q_heads + 2 kv_heads) D):

    x, residual      [M, hidden] bf16, M <= spec.max_tokens (at most 64; residual None on the first layer:
                     residual_out is then x itself)
    norm_weight      [hidden] bf16
    weight           bf16 [N, hidden], or NVFP4 packed uint8 [N, hidden/2]
    weight_scale     NVFP4 only: e4m3 (or its uint8 view) [roundup(N,128), roundup(hidden/16,4)],
                     128x4-swizzled (see flintgen.device.nvfp4 / flintgen.quant)
    global_scale     NVFP4 only: fp32, one element (ModelOpt weight_scale_2; multiplies)
    q/k_norm_weight  [D] bf16 (spec.qk_norm), else None; the norm scales by w, or by
                     (1 + w) in fp32 for spec.norm_weight_offset = 1 (Gemma)
    cos_sin_cache    [max_pos, R] fp32, cos | sin (flintgen.rope_table; R = spec.rope_dim, the
                     rotary dims: the first R of each head rotate, NeoX pairs (i, i + R/2) or
                     interleaved (2i, 2i + 1) per spec.rope_style; the rest pass through), else None
    positions        [M] int64, each < max_pos (checked under FLINTGEN_CHECK_INPUTS=1)
    k_cache, v_cache [blocks, block_size, kv_heads, D] views with equal strides, last stride 1
                     (e.g. flint's HND cache[..., :D].transpose(1, 2)), of the spec's
                     kv_cache_dtype: bf16, or for "fp8_e4m3" torch.float8_e4m3fn or its uint8
                     view (vLLM allocates fp8 caches as uint8); strides in elements (= bytes
                     for fp8), multiples of 16 bytes
    slot_mapping     [<= M] int64; negative slots and tokens past its length are not written
    bias             [N] bf16 when spec.qkv_bias, added in fp32
    k_scale, v_scale kv_cache_dtype "fp8_e4m3" only (keyword-only, required there): the
                     layer's fp32 scales, one element each on the inputs' CUDA device
                     (vLLM's convention: dequantized value = e4m3 x scale); K is stored as
                     e4m3(k_bf16 / k_scale), V as e4m3(v_bf16 / v_scale), bit-exact with
                     (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn) of the bf16
                     rows the bf16 path stores. Read before the kernel's grid-dependency
                     wait (the kernel launched just before must not write them), so a
                     captured CUDA graph sees values updated in place; finite and > 0
                     (checked under FLINTGEN_CHECK_INPUTS=1). Per-kv-head scale vectors
                     are not supported.

Returns q [M, q_heads D] bf16 and the new residual.
"""

from __future__ import annotations

from typing import Any, Mapping

from flintgen import layout
from flintgen.configs.qkv_config import HIDDEN_RANGE, QKVConfig, QKVSmem, token_tile, token_tiles
from flintgen.kernels import checks, kv_scales, qkv_stream
from flintgen.kernels.base import KernelDef, Loader, Target, Variant
from flintgen.layout import K_STEP, MMA_N, EpilogueLanes
from flintgen.spec import MAX_TOKENS_LIMIT, Spec

_PARAM_KEYS = ("hidden", "q_heads", "kv_heads", "head_dim", "weight_format", "bias", "rope",
               "rope_dim", "interleaved", "qk_norm", "norm_offset", "debug", "rows", "cluster", "warps",
               "prefetch", "early_dequant")
# Cache element types the epilogue writes: the bf16 rows, or e4m3 of row / scale
# (flintgen.device.kv_quant).
KV_DTYPES = ("bf16", "fp8_e4m3")


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


class QKVDef(KernelDef):
    name = "qkv"
    template = "qkv_gemv.py.j2"
    description = ("fused QKV GEMV (bf16 / NVFP4, M <= 64 in token tiles of 8 / 16 / 32 / 64) with q/k RMSNorm, RoPE (NeoX / interleaved, "
                   "partial rotary) and the paged KV-cache write; clusters per head (DSMEM), bf16 tiles of 16+ tokens (8 from hidden 3584) "
                   "as a persistent split-K stream into wgmma; PDL")
    # What the design needs in every variant's PTX (tests/test_compile.py).
    required_ptx = (
        "griddepcontrol.launch_dependents", "griddepcontrol.wait",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "barrier.cluster.arrive", "barrier.cluster.wait", "mapa.shared::cluster.u32",
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster",
    )

    def config(self, spec: Spec, max_m: int = MMA_N,
               target: Target | None = None) -> QKVConfig | qkv_stream.StreamConfig:
        """The design and launch configuration of token tile ``max_m`` on ``target``: the
        streaming design where ``qkv_stream_plan.stream_config`` gives one
        (bf16: 16 tokens and more, and 8 from hidden 3584), else the cluster design's QKVConfig.
        Without a target the design is the same but the streaming grid's SM-count rule (``splits``) is left out."""
        stream = qkv_stream.stream_config(spec.weight_format, max_m, spec.head_dim, hidden=spec.hidden_size,
                                          heads=spec.q_heads_per_rank + 2 * spec.kv_heads_per_rank,
                                          ctas=target.num_sms if target else 0)
        if stream is not None:
            return stream
        return self.cluster_config(spec, max_m)

    @staticmethod
    def cluster_config(spec: Spec, max_m: int = MMA_N) -> QKVConfig:
        """The cluster design's configuration of token tile ``max_m`` (what ``config`` picks where the
        op does not stream; selectable there too)."""
        return QKVConfig.from_heuristic(spec.hidden_size, spec.head_dim, spec.weight_format, max_m,
                                        out_features=spec.qkv_out_features)

    def variant(self, spec: Spec, *, debug: bool = False, config: QKVConfig | qkv_stream.StreamConfig | None = None,
                max_m: int = MMA_N, target: Target | None = None) -> Variant:
        """The binary of token tile ``max_m`` (8, 16, 32, 64: it serves M <= max_m)
        for ``spec``; ``debug`` adds the pre-norm output; ``config`` overrides the
        heuristic (benchmark sweeps): a QKVConfig (cluster design) or a
        StreamConfig (streaming design, whose grid is ``target``'s SM count)."""
        cfg = config or self.config(spec, max_m, target)
        if isinstance(cfg, qkv_stream.StreamConfig):
            if target is None:
                raise ValueError("qkv: a streaming variant needs the target (its grid is one CTA per SM)")
            return qkv_stream.variant(spec, cfg, target, max_m, debug)
        # The shared-memory plan of this launch (whole xn rows, or K-chunks where they
        # do not fit a CTA); raises if not even chunks fit.
        QKVSmem.plan(spec.hidden_size, spec.head_dim, cfg.rows, cfg.warps, max_m)
        if cfg.rows * cfg.cluster != spec.head_dim:
            raise ValueError(f"qkv config rows {cfg.rows} x cluster {cfg.cluster} must cover head_dim = "
                             f"{spec.head_dim} (one cluster per head): use cluster = {spec.head_dim // cfg.rows}")
        # Keys the first binaries predate stay out of their names: bf16 caches, the 8-token tile.
        extra = {} if spec.kv_cache_dtype == "bf16" else {"kv_dtype": spec.kv_cache_dtype}
        if max_m != MMA_N:
            extra["max_m"] = max_m
        if cfg.l2_prefetch:
            extra["l2_prefetch"] = True
        if cfg.evict_first:
            extra["evict_first"] = True
        return Variant.of(
            self.name, **extra, hidden=spec.hidden_size, q_heads=spec.q_heads_per_rank,
            kv_heads=spec.kv_heads_per_rank, head_dim=spec.head_dim,
            weight_format=spec.weight_format, bias=spec.qkv_bias,
            rope=spec.rope_style != "none", rope_dim=spec.rope_dim,
            interleaved=spec.rope_style == "interleaved", qk_norm=spec.qk_norm,
            norm_offset=spec.norm_weight_offset if spec.qk_norm else 0, debug=debug,
            rows=cfg.rows, cluster=cfg.cluster, warps=cfg.warps, prefetch=cfg.prefetch,
            early_dequant=cfg.early_dequant if spec.weight_format == "nvfp4" else 0,
        )

    # Compiled spill-free for hidden 512 ... 16384 (multiples of 64), bf16 and NVFP4
    # (tests/test_qkv_grid.py); xn is staged in K-chunks above about 13k (QKVSmem).
    limits = {"hidden_size": HIDDEN_RANGE, "max_tokens": (1, MAX_TOKENS_LIMIT)}

    def check_limits(self, spec: Spec) -> None:
        super().check_limits(spec)
        if spec.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kernel qkv: kv_cache_dtype {spec.kv_cache_dtype!r} (spec {spec.name!r}) is not "
                             f"written by the QKV step: it writes {list(KV_DTYPES)}; use one of those")
        # NeoX and interleaved pairing, whole head or partial rotary, norm_weight_offset 0 / 1
        # are all in the epilogue; the lane mapping refuses the rotary_dims it cannot split
        # (ValueError naming them). Per-layer-type RoPE needs nothing here (one table per layer).
        self.lanes(spec)

    @staticmethod
    def lanes(spec: Spec) -> EpilogueLanes:
        """The per-head epilogue's lane mapping of ``spec`` (rank 0 of a head's cluster)."""
        rope = spec.rope_style != "none"
        try:
            return EpilogueLanes.of(spec.head_dim, spec.rope_dim if rope else spec.head_dim,
                                    spec.rope_style == "interleaved")
        except ValueError as e:
            raise ValueError(f"kernel qkv (spec {spec.name!r}): {e}") from None

    def variants(self, spec: Spec, target: Target) -> list[Variant]:
        """One binary per token tile up to spec.max_tokens' (just the 8-token one
        for max_tokens <= 8). The debug variants (pre-norm rows) are built on demand only."""
        self.check_limits(spec)
        return [self.variant(spec, max_m=t, target=target) for t in token_tiles(spec.max_tokens)]

    def variant_ptx(self, variant: Variant) -> tuple[str, ...]:
        """What ``variant``'s design needs in its PTX."""
        return qkv_stream.required_ptx(variant) if qkv_stream.is_stream(variant) else self.required_ptx

    def template_of(self, variant: Variant) -> str:
        return qkv_stream.TEMPLATE if qkv_stream.is_stream(variant) else self.template

    def render_params(self, spec: Spec, variant: Variant) -> Mapping[str, Any]:
        p = dict(variant.params)
        if qkv_stream.is_stream(variant):
            return qkv_stream.render_params(p)
        missing = [k for k in _PARAM_KEYS if k not in p]
        if missing:
            raise ValueError(f"qkv variant {variant.name} lacks parameters {missing}")
        n_rows = (p["q_heads"] + 2 * p["kv_heads"]) * p["head_dim"]
        kv = layout.kv_dtype(p.get("kv_dtype", "bf16"))  # bf16 variants predate the key: their names stay
        max_m = p.get("max_m", MMA_N)   # the 8-token tile's variants predate the key
        sm = QKVSmem.plan(p["hidden"], p["head_dim"], p["rows"], p["warps"], max_m)
        per_warp = -(-(p["hidden"] // K_STEP) // p["warps"])
        lanes = EpilogueLanes.of(p["head_dim"], p["rope_dim"] if p["rope"] else p["head_dim"], p["interleaved"])
        return {
            "max_m": max_m, "chains": QKVConfig.chains(max_m, per_warp),
            "early_tokens": QKVConfig.early_tokens(max_m),
            "min_ctas": QKVConfig.min_ctas_per_sm(max_m, sm.total_bytes), "xn_chunks": sm.chunks, "chunk_steps": sm.chunk_steps,
            "chunk_row_bytes": sm.chunk_row_bytes, "xs_stride": sm.xs_stride, "red_stride": sm.red_stride,
            "hidden": p["hidden"], "q_heads": p["q_heads"], "kv_heads": p["kv_heads"],
            "head_dim": p["head_dim"], "n_rows": n_rows, "weight_format": p["weight_format"],
            "is_nvfp4": p["weight_format"] == "nvfp4", "has_bias": p["bias"], "has_rope": p["rope"],
            "has_qk_norm": p["qk_norm"], "norm_offset": p["norm_offset"], "rope_dim": lanes.rope_dim,
            "interleaved": lanes.interleaved, "pair_e": lanes.pair_e, "pair_lanes": lanes.pair_lanes,
            "pass_e": lanes.pass_e, "pass_lanes": lanes.pass_lanes,
            "debug": p["debug"], "rows": p["rows"],
            "cluster": p["cluster"], "warps": p["warps"], "prefetch": p["prefetch"],
            "early_dequant": p["early_dequant"], "l2_prefetch": p.get("l2_prefetch", False),
            "evict_first": p.get("evict_first", False),
            "scale_rows": _roundup(n_rows, 128), "scale_cols": _roundup(p["hidden"] // 16, 4),
            "kv_type": kv.cutlass_type, "kv_elem_bytes": kv.elem_bytes, "kv_fp8": kv.name == "fp8_e4m3",
        }

    def bind(self, spec: Spec, target: Target, load: Loader) -> "QKVOp":
        self.check_limits(spec)
        return QKVOp(self, spec, target, load)


class QKVOp:
    """The composed QKV step (RMSNorm kernel + GEMV kernel, chained with PDL).

    ``op(...)`` as in the module docstring (``k_scale`` / ``v_scale``: an fp8
    cache's per-layer scales, keyword-only). Keyword-only outputs for buffer
    reuse: ``q_out`` [M, q_heads D], ``xn_out`` (the normalized activations,
    [M, hidden]), ``residual_out`` (may be ``residual``: in-place update);
    ``pre_norm_out`` [M, N] bf16 selects the debug binary, which also writes
    the GEMV's rows before q/k norm and RoPE. ``config`` overrides the launch
    heuristic of every token tile (tests and benchmark sweeps).

    One GEMV binary per token tile up to spec.max_tokens' (``variants()``): M
    tokens run the binary of ``token_tile(M)``, whose launch shape (grid, block,
    cluster, shared memory) depends on that tile alone, so a CUDA graph captured
    at one M replays that binary with M as a kernel argument.
    """

    name = "qkv"

    def __init__(self, kdef: QKVDef, spec: Spec, target: Target, load: Loader,
                 config: QKVConfig | qkv_stream.StreamConfig | None = None):
        self.spec = spec
        self.target = target
        self._def = kdef
        self._load = load
        self.tiles = token_tiles(spec.max_tokens)
        self._variants = {t: kdef.variant(spec, config=config, max_m=t, target=target) for t in self.tiles}
        # debug binaries: built on the first call with pre_norm_out
        self._debug_variants = {t: kdef.variant(spec, debug=True, config=config, max_m=t, target=target)
                                for t in self.tiles}
        # one workspace for every streaming tile, sized for the largest: allocated once per device
        # (warmup), never replaced, so a captured graph's buffer stays the op's
        stream_plans = [qkv_stream.plan_of(dict(v.params)) for v in self._variants.values() if qkv_stream.is_stream(v)]
        self._workspace_size = (max((pl.workspace_floats for pl in stream_plans), default=0),
                                max((pl.heads for pl in stream_plans), default=0))
        self._workspace = qkv_stream.workspace(*self._workspace_size)
        self._norm = None
        h = spec.head_dim
        self.hidden = spec.hidden_size
        self.head_dim = h
        self.q_heads = spec.q_heads_per_rank
        self.kv_heads = spec.kv_heads_per_rank
        self.n_rows = spec.qkv_out_features
        self.is_nvfp4 = spec.weight_format == "nvfp4"
        self.rope = spec.rope_style != "none"
        self.rope_dim = spec.rope_dim
        self.max_tokens = spec.max_tokens
        self.kv_fp8 = spec.kv_cache_dtype == "fp8_e4m3"

    # ------------------------------------------------------------------ helpers
    def norm_op(self):
        """The spec's RMSNorm op, loaded for the same target as this op."""
        if self._norm is None:
            from flintgen.kernels import get_def
            from flintgen.runtime import load_variant

            rms = get_def("rms_norm")
            spec, target = self.spec, self.target
            self._norm = rms.bind(spec, target, lambda v: load_variant(rms, spec, v, target)[0])
        return self._norm

    def variants(self) -> list[Variant]:
        """The production binaries, one per token tile."""
        return list(self._variants.values())

    # ------------------------------------------------------------------ validation
    def _check_m(self, x) -> int:
        import torch

        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must have shape [M, {self.hidden}] (M tokens x hidden), got {tuple(x.shape)}")
        m = x.shape[0]
        if m > self.max_tokens:
            raise ValueError(
                f"M = {m} tokens exceeds spec.max_tokens = {self.max_tokens} of the fused QKV step "
                f"(spec {self.spec.name!r}; its binaries serve M <= {self.max_tokens}): build the spec "
                f"with a larger max_tokens (up to {MAX_TOKENS_LIMIT}: spec.replace(max_tokens=...), "
                "flintgen build --max-tokens N), split the batch into chunks of "
                f"<= {self.max_tokens} tokens, or use an unfused path for larger M (rms_norm + a GEMM "
                "such as torch.nn.functional.linear on the dequantized weight, then q/k norm, RoPE "
                "and the cache write)")
        if m == 0:
            raise ValueError("x has M = 0 tokens: nothing to compute (skip the call)")
        return m

    def _validate(self, x, residual, norm_weight, weight, weight_scale, global_scale,
                  q_norm_weight, k_norm_weight, cos_sin_cache, positions, k_cache, v_cache,
                  slot_mapping, bias, q_out, xn_out, residual_out, pre_norm_out, k_scale=None, v_scale=None):
        """Every check that needs no device: dtypes, shapes, strides, then
        devices last (so a CPU tensor gets 'must be on a CUDA device')."""
        import torch

        m = self._check_m(x)
        h, d, n = self.hidden, self.head_dim, self.n_rows
        T = []  # (name, tensor) to device-check

        def want(name, t, dtype, shape, contiguous=True, align=16):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
                raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
            if shape is not None and tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
            if contiguous and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (strides {t.stride()}): call .contiguous()")
            if align and t.numel() and t.data_ptr() % align:
                raise ValueError(f"{name} must be {align}-byte aligned: pass a fresh allocation or .clone() it")
            T.append((name, t))
            return t

        def absent(name, t, why):
            if t is not None:
                raise ValueError(f"{name} must be None: {why}")

        want("x", x, torch.bfloat16, (m, h))
        if residual is not None:
            want("residual", residual, torch.bfloat16, (m, h))
        want("norm_weight", norm_weight, torch.bfloat16, (h,))
        if self.is_nvfp4:
            want("weight", weight, (torch.uint8,), (n, h // 2))
            if weight_scale is None:
                raise ValueError("weight_scale is required for NVFP4 weights (e4m3 block scales, "
                                 "128x4-swizzled): see flintgen.quant.quantize_nvfp4")
            want("weight_scale", weight_scale, (torch.float8_e4m3fn, torch.uint8),
                 (_roundup(n, 128), _roundup(h // 16, 4)))
            if global_scale is None:
                raise ValueError("global_scale is required for NVFP4 weights (fp32 weight_scale_2)")
            want("global_scale", global_scale, torch.float32, None, align=4)
            if global_scale.numel() != 1:
                raise ValueError(f"global_scale must hold one fp32 value, got shape {tuple(global_scale.shape)}")
        else:
            want("weight", weight, torch.bfloat16, (n, h))
            absent("weight_scale", weight_scale, "the spec's weights are bf16 (weight_format='bf16')")
            absent("global_scale", global_scale, "the spec's weights are bf16 (weight_format='bf16')")
        if self.spec.qk_norm:
            want("q_norm_weight", q_norm_weight, torch.bfloat16, (d,))
            want("k_norm_weight", k_norm_weight, torch.bfloat16, (d,))
        else:
            absent("q_norm_weight", q_norm_weight, "the spec has qk_norm=False")
            absent("k_norm_weight", k_norm_weight, "the spec has qk_norm=False")
        if self.rope:
            r = self.rope_dim
            what = "head_dim" if r == d else "rotary_dim"
            if cos_sin_cache is None:
                raise ValueError(f"cos_sin_cache [max_pos, {r}] fp32 is required (rope_style="
                                 f"{self.spec.rope_style!r}): build it with flintgen.rope_table(spec, max_pos)")
            want("cos_sin_cache", cos_sin_cache, torch.float32, None)
            if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != r or cos_sin_cache.shape[0] < 1:
                raise ValueError(f"cos_sin_cache must have shape [max_pos, {r}] (cos | sin, {what} = {r}), "
                                 f"got {tuple(cos_sin_cache.shape)}: build it with flintgen.rope_table(spec, max_pos)")
        else:
            absent("cos_sin_cache", cos_sin_cache, "the spec has rope_style='none'")
        want("positions", positions, torch.int64, (m,), align=8)
        want("slot_mapping", slot_mapping, torch.int64, None, align=8)
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] > m:
            raise ValueError(f"slot_mapping must be 1-D with at most M = {m} entries, got shape "
                             f"{tuple(slot_mapping.shape)}")
        self._check_cache(k_cache, v_cache)
        T += [("k_cache", k_cache), ("v_cache", v_cache)]
        T += kv_scales.check_scales(self.spec, k_scale, v_scale)
        if self.spec.qkv_bias:
            if bias is None:
                raise ValueError(f"bias [{n}] bf16 is required: the spec has qkv_bias=True")
            want("bias", bias, torch.bfloat16, (n,))
        else:
            absent("bias", bias, "the spec has qkv_bias=False")
        if q_out is not None:
            want("q_out", q_out, torch.bfloat16, (m, self.q_heads * d))
        if xn_out is not None:
            want("xn_out", xn_out, torch.bfloat16, (m, h))
        if residual_out is not None:
            if residual is None:
                raise ValueError("residual_out was given without residual: on the first layer the "
                                 "new residual is x itself; drop residual_out")
            want("residual_out", residual_out, torch.bfloat16, (m, h))
        if pre_norm_out is not None:
            want("pre_norm_out", pre_norm_out, torch.bfloat16, (m, n))
        dev = None
        for name, t in T:
            if t.device.type != "cuda":
                raise ValueError(f"{name} must be on a CUDA device, got {t.device}: move it with .cuda()")
            if dev is None:
                dev = t.device
            elif t.device != dev:
                raise ValueError(f"{name} is on {t.device} but x is on {dev}: put every input on one device")
        return m

    def _check_cache(self, k_cache, v_cache) -> None:
        import torch

        kv, d = self.kv_heads, self.head_dim
        elem = layout.kv_dtype(self.spec.kv_cache_dtype)
        dtypes, align = (getattr(torch, elem.torch_dtype),), 16 // elem.elem_bytes
        if elem.elem_bytes == 1:
            dtypes += (torch.uint8,)   # vLLM allocates fp8 caches as uint8: the same bytes
        want = " or ".join(str(t) for t in dtypes)
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(c, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(c).__name__}")
            if c.dtype not in dtypes:
                fix = (": for an fp8 cache use a spec with kv_cache_dtype='fp8_e4m3'"
                       if c.dtype in (torch.float8_e4m3fn, torch.uint8) else
                       f": allocate the cache as {want}" if elem.elem_bytes == 1 else "")
                raise TypeError(f"{name} must be {want} (spec kv_cache_dtype {elem.name!r}), got {c.dtype}{fix}")
            if c.dim() != 4 or c.shape[2] != kv or c.shape[3] != d:
                raise ValueError(f"{name} must be a [blocks, block_size, {kv}, {d}] view "
                                 f"(kv_heads per rank, head_dim), got shape {tuple(c.shape)}")
            if c.stride(3) != 1 or any(s % align for s in c.stride()[:3]):
                raise ValueError(f"{name} strides {c.stride()} are not supported: the last must be 1 and "
                                 f"the others multiples of {align} elements of {elem.elem_bytes} byte"
                                 f"{'s' if elem.elem_bytes > 1 else ''} (16 bytes)")
            if c.data_ptr() % 16:
                raise ValueError(f"{name} must start 16-byte aligned")
        if k_cache.dtype != v_cache.dtype:
            raise TypeError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}: "
                            "view both as the same one (e.g. .view(torch.uint8))")
        if tuple(k_cache.shape) != tuple(v_cache.shape) or k_cache.stride() != v_cache.stride():
            raise ValueError(f"k_cache and v_cache must have equal shapes and strides, got "
                             f"{tuple(k_cache.shape)}/{k_cache.stride()} and "
                             f"{tuple(v_cache.shape)}/{v_cache.stride()}")

    def _check_device_contracts(self, positions, cos_sin_cache, slot_mapping, k_cache, k_scale=None,
                                v_scale=None) -> None:
        """FLINTGEN_CHECK_INPUTS=1: sync and check the device-side contracts."""
        if self.kv_fp8:
            kv_scales.check_scale_values(k_scale, v_scale)
        pos = positions.cpu()
        if self.rope:
            max_pos = cos_sin_cache.shape[0]
            bad = (pos < 0) | (pos >= max_pos)
            if bool(bad.any()):
                raise ValueError(f"positions {pos[bad].tolist()} are outside [0, max_pos = {max_pos}) "
                                 "of cos_sin_cache: build a longer table")
        slots = slot_mapping.cpu()
        cap = k_cache.shape[0] * k_cache.shape[1]
        bad = slots >= cap
        if bool(bad.any()):
            raise ValueError(f"slot_mapping values {slots[bad].tolist()} are >= blocks x block_size = {cap}")

    # ------------------------------------------------------------------ call
    def __call__(self, x, residual, norm_weight, weight, weight_scale, global_scale,
                 q_norm_weight, k_norm_weight, cos_sin_cache, positions, k_cache, v_cache,
                 slot_mapping, bias=None, eps: float | None = None, qk_eps: float | None = None, *,
                 k_scale=None, v_scale=None, q_out=None, xn_out=None, residual_out=None, pre_norm_out=None):
        import torch

        m = self._validate(x, residual, norm_weight, weight, weight_scale, global_scale,
                           q_norm_weight, k_norm_weight, cos_sin_cache, positions, k_cache, v_cache,
                           slot_mapping, bias, q_out, xn_out, residual_out, pre_norm_out, k_scale, v_scale)
        eps = self.spec.rms_eps if eps is None else checks.positive_float("eps", eps)
        qk_eps = self.spec.rms_eps if qk_eps is None else checks.positive_float("qk_eps", qk_eps)
        from flintgen.knobs import knobs

        if knobs.check_inputs:
            self._check_device_contracts(positions, cos_sin_cache, slot_mapping, k_cache, k_scale, v_scale)

        xn = xn_out if xn_out is not None else torch.empty_like(x)
        norm = self.norm_op()
        if residual is None:
            norm(x, norm_weight, eps, out=xn)
            res_out = x
        else:
            _, res_out = norm(x, norm_weight, eps, residual, out=xn, residual_out=residual_out)
        q = q_out if q_out is not None else torch.empty(m, self.q_heads * self.head_dim,
                                                         dtype=torch.bfloat16, device=x.device)
        kc, vc = k_cache, v_cache
        if self.kv_fp8:
            # a uint8 cache is viewed as e4m3 (same bytes), the kernel's cache element
            kv_t = getattr(torch, layout.kv_dtype(self.spec.kv_cache_dtype).torch_dtype)
            kc, vc = k_cache.view(kv_t), v_cache.view(kv_t)
        v = (self._debug_variants if pre_norm_out is not None else self._variants)[token_tile(m)]
        if qkv_stream.is_stream(v):
            # the streaming binary: its argument table, tensors by name; its workspace in stream order
            ws, counters = self._workspace.get(x.device)
            self._workspace.order(x.device)
            named = dict(xn=xn, weight=weight, bias=bias, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
                         cos_sin=cos_sin_cache, positions=positions, slot_mapping=slot_mapping, q=q,
                         k_cache=kc, v_cache=vc,
                         k_scale=k_scale.reshape(1) if self.kv_fp8 else None,
                         v_scale=v_scale.reshape(1) if self.kv_fp8 else None,
                         workspace=ws, counters=counters, pre=pre_norm_out, qk_eps=qk_eps)
            args = [named[a.name] for a in qkv_stream.args_of(dict(v.params))]
        else:
            args = [xn, weight]
            if self.is_nvfp4:
                args += [weight_scale.view(torch.uint8), global_scale.reshape(1)]
            if self.spec.qkv_bias:
                args.append(bias)
            if self.spec.qk_norm:
                args += [q_norm_weight, k_norm_weight]
            if self.rope:
                args += [cos_sin_cache, positions]
            args += [slot_mapping, q, kc, vc]
            if self.kv_fp8:
                args += [k_scale.reshape(1), v_scale.reshape(1)]
            if pre_norm_out is not None:
                args.append(pre_norm_out)
            if self.spec.qk_norm:
                args.append(qk_eps)
        self._load(v)(*args)
        return q, res_out

    def warmup(self, device) -> None:
        """Load both kernels and run every GEMV binary (one per token tile, at M =
        1 and at M = each larger tile) on zero-filled inputs (module load happens
        on the first call, which must precede a graph capture)."""
        import torch

        from flintgen.quant import rope_table

        dev = torch.device(device)
        h, d, n = self.hidden, self.head_dim, self.n_rows
        bf = dict(dtype=torch.bfloat16, device=dev)
        if self.is_nvfp4:
            w = torch.zeros(n, h // 2, dtype=torch.uint8, device=dev)
            ws = torch.zeros(_roundup(n, 128), _roundup(h // 16, 4), dtype=torch.uint8, device=dev)
            gs = torch.ones(1, dtype=torch.float32, device=dev)
        else:
            w, ws, gs = torch.zeros(n, h, **bf), None, None
        nw = torch.ones(d, **bf) if self.spec.qk_norm else None
        cs = rope_table(self.spec, 1, dev) if self.rope else None
        kv_t = getattr(torch, layout.kv_dtype(self.spec.kv_cache_dtype).torch_dtype)
        cache = torch.zeros(1, 16, self.kv_heads, d, dtype=torch.uint8 if self.kv_fp8 else kv_t, device=dev)
        slots = torch.full((1,), -1, dtype=torch.int64, device=dev)
        b = torch.zeros(n, **bf) if self.spec.qkv_bias else None
        sc = {}
        if self.kv_fp8:
            one = torch.ones(1, dtype=torch.float32, device=dev)
            sc = dict(k_scale=one, v_scale=one)

        def run(m: int, residual: bool) -> None:
            x = torch.zeros(m, h, **bf)
            pos = torch.zeros(m, dtype=torch.int64, device=dev)
            self(x, x.clone() if residual else None, torch.ones(h, **bf), w, ws, gs, nw, nw, cs, pos, cache,
                 cache.clone(), slots, b, **sc)

        run(1, False)        # rms_norm without a residual, the 8-token tile
        run(1, True)         # rms_norm with one
        for tile in self.tiles[1:]:
            run(tile, False)
