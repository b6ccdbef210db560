"""Host side of split-KV paged decode attention (cute-free).

    op = flintgen.get_kernel(spec, "decode_attention")
    op(q, kv_cache, block_tables, seq_lens, sinks, window, scale, out)
    op(q, kv_cache, block_tables, seq_lens, sinks, window, scale, out, softcap=50.0)  # attn_logit_softcap specs
    op(q, kv_cache, block_tables, seq_lens, sinks, window, scale, out, k_scale=ks, v_scale=vs)  # fp8_e4m3 specs

Design: templates/decode_attention.py.j2 and the device modules it imports;
launch heuristics: flintgen/configs/decode_attention_config.py.

fp8 e4m3 caches (spec ``kv_cache_dtype="fp8_e4m3"``): the variants carry
``kv_fp8`` (template constant KV_FP8); the pages stream as bytes, become f16
fragments exactly (``paged_kv``), and run the f16 mma (``decode_mma``); the
per-layer ``k_scale`` / ``v_scale`` are kernel arguments (device tensors):
k_scale multiplies the logits' factor, v_scale the output's normalization
(``attention_combine.inv_norm``). bf16 variants keep their names and PTX.

Contracts the op relies on (documented on ``DecodeAttentionOp``):

* seq_lens and block_tables are read by the kernel *before* its
  grid-dependency wait (as are the cache pages other than the one holding
  the current token), so no kernel of the PDL chain leading into the launch
  may write them: they come from host-to-device copies ahead of the decode
  step. q, the current token's page, out and the workspace may be written by
  the kernel right before. With an fp8 cache the per-layer ``k_scale`` /
  ``v_scale`` tensors are read before the wait too (same rule; being read
  from device memory at every launch, a captured CUDA graph sees values
  updated in place).
* The workspace (fp32 split partials + self-resetting arrival counters) is
  allocated once per device, zeroed once, and never replaced, so CUDA graphs
  keep valid pointers. Launches sharing it must be ordered: an eager launch
  from another stream than the previous launch first makes its stream wait
  for that one (the seed's rule). Launches recorded in a CUDA graph are
  ordered by the graph; replaying a graph on one stream while launching
  eagerly on another is the caller's to order.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from flintgen import layout
from flintgen.configs import decode_attention_config as dac
from flintgen.kernels import kv_scales
from flintgen.kernels.base import KernelDef, Loader, Target, Variant
from flintgen.kernels.workspace import DeviceBuffers
from flintgen.knobs import knobs
from flintgen.spec import Spec

LOG2E = 1.4426950408889634


def _gqa(spec: Spec) -> int:
    """q heads per kv head on one rank. Not ``spec.gqa`` (the model's ratio):
    when tensor parallelism replicates kv heads (tp_size > num_kv_heads) a
    rank holds fewer q heads per kv head, e.g. 32 q / 4 kv at TP 8 gives
    4 q heads and 1 kv head per rank."""
    return spec.q_heads_per_rank // spec.kv_heads_per_rank


def _layer_kinds(spec: Spec) -> list[bool]:
    """``sliding`` flags of the layer kinds the spec has (sliding first)."""
    return [s for s, present in ((True, spec.has_sliding), (False, spec.has_full)) if present]


def _configs(spec: Spec, target: Target, sliding: bool) -> dict[int, dac.DecodeAttentionConfig]:
    return dac.all_configs(
        max_batch=spec.max_batch, num_kv_heads=spec.kv_heads_per_rank, sliding=sliding,
        window=spec.sliding_window if sliding else None, head_dim=spec.head_dim, gqa=_gqa(spec),
        page_size=spec.page_size, num_sms=target.num_sms, kv_dtype=spec.kv_cache_dtype,
    )  # fmt: skip


def _fp8(spec: Spec) -> bool:
    return spec.kv_cache_dtype == "fp8_e4m3"


def _variant(spec: Spec, sliding: bool, cfg: dac.DecodeAttentionConfig) -> Variant:
    # softcap and kv_fp8 only where present: the other variants keep their names.
    cap = {"softcap": True} if spec.attn_logit_softcap else {}
    fp8 = {"kv_fp8": True} if _fp8(spec) else {}
    return Variant.of(
        "decode_attention", kv_heads=spec.kv_heads_per_rank, gqa=_gqa(spec), head_dim=spec.head_dim,
        page_size=spec.page_size, sliding=sliding, **cap, **fp8, **cfg.as_params(),
    )  # fmt: skip


def launch_scalars(scale: float, softcap: float | None) -> tuple[float, ...]:
    """The kernel's scalar arguments after ``window``, from the op's ``scale``
    and ``softcap`` (computed in fp64, rounded to fp32 by the launch).

    Without capping: ``(scale * log2 e,)``, the logits' factor in exp2.
    With: ``(log2 e, 2 log2(e) scale / cap, cap)``: the kernel soft-caps the
    raw logits to ``cap * tanh(s * scale / cap)`` (already scaled, so exp2's
    factor is log2 e, consistent with the uncapped sink's ``sink * log2 e``).
    """
    if softcap is None:
        return (float(scale) * LOG2E,)
    return (LOG2E, 2.0 * LOG2E * float(scale) / float(softcap), float(softcap))


class DecodeAttentionDef(KernelDef):
    name = "decode_attention"
    template = "decode_attention.py.j2"
    description = ("split-KV paged decode attention with sinks, sliding window and logit soft-capping "
                   "(GQA 1-16, head_dim 64/96/128/256, page 16/32/64, bf16 or fp8 e4m3 cache)")
    required_ptx = (
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
        "mbarrier.try_wait.parity",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "griddepcontrol.wait",
        "griddepcontrol.launch_dependents",
        "ex2.approx.ftz.f32",
    )
    # An fp8 variant runs the f16 mma on converted e4m3 bytes instead of the bf16 one.
    FP8_PTX = ("cvt.rn.f16x2.e4m3x2", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
               "cvt.rn.satfinite.f16x2.f32")
    BF16_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"

    def variant_ptx(self, variant: Variant) -> tuple[str, ...]:
        """PTX the variant's binary must contain (CI checks): ``required_ptx``,
        with the f16 mma and the e4m3 conversions in place of the bf16 mma for
        an fp8 cache."""
        if not dict(variant.params).get("kv_fp8"):
            return self.required_ptx
        return tuple(p for p in self.required_ptx if p != self.BF16_MMA) + self.FP8_PTX

    def variants(self, spec: Spec, target: Target) -> list[Variant]:
        dac.check_supported(head_dim=spec.head_dim, gqa=_gqa(spec), page_size=spec.page_size,
                            kv_dtype=spec.kv_cache_dtype)
        out: list[Variant] = []
        for sliding in _layer_kinds(spec):
            for cfg in dict.fromkeys(_configs(spec, target, sliding).values()):
                v = _variant(spec, sliding, cfg)
                if v not in out:
                    out.append(v)
        return out

    def render_params(self, spec: Spec, variant: Variant) -> Mapping[str, Any]:
        p = dict(variant.params)
        cfg = dac.DecodeAttentionConfig(**{k: p[k] for k in (
            "num_splits", "num_warps", "num_stages", "min_pages", "cluster", "ctas_per_sm", "head_dim", "gqa",
            "merge_ctas", "merge_from", "early_release")}, kv_dtype="fp8_e4m3" if p.get("kv_fp8") else "bf16",
            kv_evict_first=p.get("kv_evict_first", False))
        pad = 0
        if cfg.ctas_per_sm:
            pad = max(0, layout.SMEM_PER_SM // (cfg.ctas_per_sm + 1) + 1 - cfg.ring_bytes)
        p["pad_bytes"] = pad
        p["merge_dims"] = cfg.merge_dims
        p["softcap"] = bool(p.get("softcap", False))
        p["kv_fp8"] = bool(p.get("kv_fp8", False))
        p["kv_evict_first"] = cfg.kv_evict_first
        lay = cfg.layout
        p.update(slice_tokens=layout.SLICE_TOKENS, slices_per_page=lay.slices_per_page(p["page_size"]),
                 kv_type=layout.kv_dtype(lay.kv_dtype).cutlass_type, kv_elem_bytes=lay.kv_elem_bytes,
                 q_elem_bytes=layout.Q_ELEM_BYTES,
                 slice_bytes=lay.slice_bytes, head_tile=lay.tile, num_tiles=lay.num_tiles,
                 tile_rows=lay.tile_rows, kv_parts=cfg.kv_parts)
        return p

    def bind(self, spec: Spec, target: Target, load: Loader) -> "DecodeAttentionOp":
        self.variants(spec, target)  # raises for unsupported shapes at build time
        return DecodeAttentionOp(spec, target, load)


class _Workspace:
    """Per-device persistent buffers (see the module docstring)."""

    def __init__(self, part_o, part_ml, counters):
        self.part_o = part_o
        self.part_ml = part_ml
        self.counters = counters


class DecodeAttentionOp:
    """``op(q, kv_cache, block_tables, seq_lens, sinks, window, scale, out, *, softcap=None, k_scale=None, v_scale=None) -> out``

    Paged decode attention with sinks, one query token per request, on the
    current CUDA stream with programmatic dependent launch. Shapes (B requests,
    Hq = spec q heads per rank, Hkv = spec kv heads per rank, Hq / Hkv in
    1..16, D = head_dim in {64, 96, 128, 256}, P = page_size in {16, 32, 64}):

    * ``q``: [B, Hq, D] bf16; last dim contiguous, row strides multiples of 8
      elements, 16-byte aligned (a view into a fused qkv output is fine).
    * ``kv_cache``: [num_blocks, Hkv, P, 2 * D] HND cache, K in
      ``[..., :D]`` and V in ``[..., D:]``; each (block, kv head) page of
      P x 2D contiguous, block / head strides multiples of 16 bytes (8 bf16
      elements, 16 e4m3 ones), 16-byte aligned. bf16 for a bf16 spec; for
      ``kv_cache_dtype="fp8_e4m3"`` e4m3 bytes as ``torch.float8_e4m3fn`` or
      ``torch.uint8`` (vLLM allocates fp8 caches as uint8; the bytes are
      read as e4m3fn either way), layout and strides the same in 1-byte
      elements::

          dequantized K = e4m3(kv[..., :D]) * k_scale,  V = e4m3(kv[..., D:]) * v_scale
    * ``block_tables``: [B, max_blocks] int32, last dim contiguous; entries of
      the attended pages must be valid block ids (others are never read).
    * ``seq_lens``: [B] int32 KV lengths including the current token; 0 writes
      zeros; values above ``max_blocks * P`` are clamped to it.
    * ``sinks``: [Hq] fp32 sink logits, or None when the spec has no sinks (a
      per-device -inf buffer is used: exp2(-inf) adds nothing).
    * ``window``: None for full attention, else attend to the last ``window``
      positions (int >= 1). The launch config was tuned for the spec's window;
      another length is correct, just not tuned, and never recompiles.
    * ``scale``: softmax scale (finite, > 0).
    * ``out``: [B, Hq, D] bf16, same layout rules as ``q``.
    * ``softcap`` (keyword): the logit cap when the spec has
      ``attn_logit_softcap`` (required then, a finite number > 0, e.g. 50.0 for
      Gemma 2; None otherwise). Logits become ``softcap * tanh(s * scale /
      softcap)`` before the softmax, as transformers applies Gemma 2's
      ``attn_logit_softcapping``; sink logits are not capped. A runtime
      argument: another cap never recompiles (a CUDA graph keeps the cap it
      was captured with, as it keeps ``scale`` and ``window``). The kernel's
      tanh is within 5.5e-7 * cap of fp64 in the logit (``decode_mma.softcap_logit``).
    * ``k_scale``, ``v_scale`` (keyword): for an fp8 spec (required then,
      None otherwise), vLLM's per-layer scales: CUDA fp32 tensors of one
      element (any shape, e.g. 0-d), contract finite and > 0 (checked under
      FLINTGEN_CHECK_INPUTS=1). Read by the kernel before its
      grid-dependency wait (like seq_lens: no kernel of the PDL chain ahead
      may write them), at every launch: a CUDA graph replays with the values
      they hold then. k_scale multiplies the logits' factor (scale * k_scale;
      soft-capped: cap * tanh(q.k * scale * k_scale / cap)), v_scale the
      output's normalization (O * v_scale / l), once. Numerics: K and V are
      exact (e4m3 -> f16), q is converted to f16 (|q| past 65504 saturates
      to +-65504: FLINTGEN_CHECK_INPUTS=1 refuses such q), P is rounded to
      f16; f16 mma with fp32 accumulation.

    seq_lens and block_tables are read before the kernel's grid-dependency
    wait: no kernel of the PDL chain ahead of the launch may write them (use
    host-to-device copies, as a serving loop does). B must be <= spec.max_batch.
    CUDA graphs: call ``warmup`` first (loads every variant, allocates the
    workspace); the launch shape depends only on B.
    """

    name = "decode_attention"

    def __init__(self, spec: Spec, target: Target, load: Loader):
        self.spec = spec
        self.target = target
        self._load = load
        self.q_heads = spec.q_heads_per_rank
        self.kv_heads = spec.kv_heads_per_rank
        self.gqa = _gqa(spec)
        self.head_dim = spec.head_dim
        self.page = spec.page_size
        self.layout = layout.AttentionLayout(head_dim=spec.head_dim, gqa=self.gqa, kv_dtype=spec.kv_cache_dtype)
        self.fp8 = _fp8(spec)
        self._configs = {s: _configs(spec, target, s) for s in _layer_kinds(spec)}
        self._variants = {s: {b: _variant(spec, s, c) for b, c in cfgs.items()}
                          for s, cfgs in self._configs.items()}  # fmt: skip
        self._max_partials = max(dac.max_partials(c, self.kv_heads) for c in self._configs.values())
        self._workspaces = DeviceBuffers("decode_attention", self._make_workspace)
        self._no_sinks: dict[Any, Any] = {}

    # ------------------------------------------------------------ validation
    def _check(self, q, kv_cache, block_tables, seq_lens, sinks, window, scale, out, softcap=None,
               k_scale=None, v_scale=None) -> int:
        """Validate every argument; returns B. Types, dtypes, shapes and
        strides are checked before devices, so every rejection but the device
        ones is reachable with CPU tensors (and none needs a kernel load)."""
        import torch

        hq, hkv, d, page = self.q_heads, self.kv_heads, self.head_dim, self.page
        spec = self.spec
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, int):
                raise TypeError(f"window must be None or an int, got {type(window).__name__} {window!r}")
            if not 1 <= window < 2**31:
                raise ValueError(f"window must be >= 1 (positions attended, the current one included) "
                                 f"or None for full attention, got {window}")
            if not spec.has_sliding:
                raise ValueError(f"window={window} but spec {spec.name!r} has no sliding layers: pass window=None")
        elif not spec.has_full:
            raise ValueError(f"window=None (full attention) but spec {spec.name!r} has only sliding layers: "
                             f"pass window={spec.sliding_window}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or scale <= 0:
            raise ValueError(f"scale must be a finite number > 0, got {scale!r} (typically "
                             f"{spec.scale:.6g} = head_dim ** -0.5)")
        _check_softcap(spec, softcap, scale)

        _typed("q", q, torch.bfloat16)
        if q.dim() != 3 or tuple(q.shape[1:]) != (hq, d):
            raise ValueError(f"q must have shape [B, {hq}, {d}] (spec {spec.name!r}: {hq} q heads per rank, "
                             f"head_dim {d}), got {tuple(q.shape)}")
        batch = q.shape[0]
        _check_rows("q", q)
        _typed("out", out, torch.bfloat16)
        if tuple(out.shape) != (batch, hq, d):
            raise ValueError(f"out must have shape {(batch, hq, d)} like q, got {tuple(out.shape)}")
        _check_rows("out", out)
        if self.fp8:
            if not isinstance(kv_cache, torch.Tensor):
                raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
            if kv_cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise TypeError(f"kv_cache must be torch.float8_e4m3fn or torch.uint8 (e4m3 bytes) for spec "
                                f"{spec.name!r} (kv_cache_dtype='fp8_e4m3'), got {kv_cache.dtype}: pass the fp8 "
                                "cache itself (or .view(torch.uint8) of it), not a dequantized copy")
        else:
            _typed("kv_cache", kv_cache, getattr(torch, layout.kv_dtype(self.layout.kv_dtype).torch_dtype))
        if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (hkv, page, 2 * d):
            raise ValueError(
                f"kv_cache must be the HND cache [num_blocks, {hkv}, {page}, {2 * d}] (kv heads, page size, "
                f"K | V of head_dim {d}), got {tuple(kv_cache.shape)}"
            )
        st = kv_cache.stride()
        align = 16 // self.layout.kv_elem_bytes  # elements in 16 bytes
        if st[3] != 1 or st[2] != 2 * d or st[1] % align or st[0] % align:
            raise ValueError(
                f"kv_cache strides {st} are not supported: each (block, kv head) page must be contiguous "
                f"(strides [.., .., {2 * d}, 1]) with block and head strides multiples of {align} elements "
                "(16 bytes, for bulk copies); pass the cache tensor itself, not a permuted view"
            )
        _typed("block_tables", block_tables, torch.int32)
        if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
            raise ValueError(f"block_tables must have shape [B={batch}, max_blocks >= 1], got "
                             f"{tuple(block_tables.shape)}")
        if block_tables.stride(1) != 1:
            raise ValueError(f"block_tables rows must be contiguous (stride(1) == 1), got strides "
                             f"{block_tables.stride()}: call .contiguous()")
        _typed("seq_lens", seq_lens, torch.int32)
        if tuple(seq_lens.shape) != (batch,) or (batch > 1 and seq_lens.stride(0) != 1):
            raise ValueError(f"seq_lens must be a contiguous [B={batch}] tensor, got shape "
                             f"{tuple(seq_lens.shape)}, strides {seq_lens.stride()}")
        tensors = [("q", q), ("out", out), ("kv_cache", kv_cache), ("block_tables", block_tables),
                   ("seq_lens", seq_lens)]  # fmt: skip
        tensors += kv_scales.check_scales(spec, k_scale, v_scale)
        if spec.sinks:
            if sinks is None:
                raise ValueError(f"spec {spec.name!r} has sinks=True: pass sinks, a [{hq}] fp32 tensor of "
                                 "per-head sink logits")
            _typed("sinks", sinks, torch.float32)
            if tuple(sinks.shape) != (hq,) or sinks.stride(0) != 1:
                raise ValueError(f"sinks must be a contiguous [{hq}] fp32 tensor (one logit per q head), got "
                                 f"shape {tuple(sinks.shape)}")
            tensors.append(("sinks", sinks))
        elif sinks is not None:
            raise ValueError(f"spec {spec.name!r} has sinks=False: pass sinks=None (or build a spec with "
                             "sinks=True)")
        if batch > spec.max_batch:
            raise ValueError(f"batch {batch} exceeds spec {spec.name!r} max_batch = {spec.max_batch}: build "
                             "a spec with a larger max_batch")
        dev = q.device
        for name, t in tensors:
            if t.device.type != "cuda":
                raise ValueError(f"{name} must be on a CUDA device, got {t.device}: move it with .cuda()")
            if t.device != dev:
                raise ValueError(f"{name} is on {t.device} but q is on {dev}: put every input on one device")
        for name, t in tensors:
            align = 16 if name in ("q", "out", "kv_cache") else 4  # 16: bulk copies / vector loads
            if t.numel() and t.data_ptr() % align:
                raise ValueError(f"{name} must be {align}-byte aligned (data_ptr % {align} = "
                                 f"{t.data_ptr() % align}): pass a fresh allocation or .clone() it")
        return batch

    # ------------------------------------------------------------ launch
    def config(self, batch: int, sliding: bool) -> dac.DecodeAttentionConfig:
        return self._configs[sliding][batch]

    def __call__(self, q, kv_cache, block_tables, seq_lens, sinks, window, scale, out, *, softcap=None,
                 k_scale=None, v_scale=None):
        batch = self._check(q, kv_cache, block_tables, seq_lens, sinks, window, scale, out, softcap,
                            k_scale, v_scale)
        if batch == 0:
            return out
        sliding = window is not None
        fn = self._load(self._variants[sliding][batch])
        ws = self._workspaces.get(q.device)
        self._workspaces.order(q.device)
        if sinks is None:
            sinks = self._sinks_none(q.device)
        if knobs.check_inputs:
            _check_device_inputs(kv_cache, block_tables, seq_lens)
            if self.fp8:
                check_fp8_inputs(q, k_scale, v_scale)
        scale_log2, *cap = launch_scalars(scale, softcap)
        scales = ()
        if self.fp8:
            import torch

            if kv_cache.dtype == torch.uint8:
                kv_cache = kv_cache.view(torch.float8_e4m3fn)   # same bytes and strides
            scales = (k_scale.reshape(1), v_scale.reshape(1))   # views: the kernel reads their memory
        fn(q, kv_cache, block_tables, seq_lens, sinks, out, ws.part_o, ws.part_ml, ws.counters, *scales,
           scale_log2, 0 if window is None else int(window), *cap)  # fmt: skip
        return out

    def _make_workspace(self, device) -> _Workspace:
        import torch

        n = max(self._max_partials, 1)
        # Partials hold the real heads only (padded tile heads publish nothing).
        g, d = self.layout.q_rows, self.head_dim
        return _Workspace(
            torch.empty(n * g * d, dtype=torch.float32, device=device),
            torch.empty(n * 2 * g, dtype=torch.float32, device=device),
            # Zeroed once; every launch leaves them at zero again.
            torch.zeros(max(self.spec.max_batch * self.kv_heads, 1), dtype=torch.int32, device=device),
        )

    def _sinks_none(self, device):
        import torch

        t = self._no_sinks.get(device)
        if t is None:
            t = torch.full((self.q_heads,), float("-inf"), dtype=torch.float32, device=device)
            self._no_sinks[device] = t
        return t

    def variants(self) -> list[Variant]:
        return list(dict.fromkeys(v for per in self._variants.values() for v in per.values()))

    def warmup(self, device) -> None:
        """Load every variant, allocate the workspace and run each binary once
        (batch of its smallest size, seq_len 0; with soft-capping any cap, here
        1.0: nothing is attended) so nothing loads during a CUDA-graph capture."""
        import torch

        device = torch.device(device)
        hq, d = self.q_heads, self.head_dim
        kv_dtype = getattr(torch, layout.kv_dtype(self.layout.kv_dtype).torch_dtype)
        kv = torch.zeros(1, self.kv_heads, self.page, 2 * d, dtype=kv_dtype, device=device)
        sinks = torch.zeros(hq, dtype=torch.float32, device=device) if self.spec.sinks else None
        softcap = 1.0 if self.spec.attn_logit_softcap else None
        one = torch.ones((), dtype=torch.float32, device=device) if self.fp8 else None
        for sliding, per in self._variants.items():
            seen = set()
            for b, v in per.items():
                if v in seen:
                    continue
                seen.add(v)
                q = torch.zeros(b, hq, d, dtype=torch.bfloat16, device=device)
                out = torch.empty_like(q)
                bt = torch.zeros(b, 1, dtype=torch.int32, device=device)
                lens = torch.zeros(b, dtype=torch.int32, device=device)
                self(q, kv, bt, lens, sinks, self.spec.sliding_window if sliding else None,
                     self.spec.scale, out, softcap=softcap, k_scale=one, v_scale=one)  # fmt: skip


def _check_softcap(spec: Spec, softcap, scale) -> None:
    """``softcap``: a finite number > 0 when the spec soft-caps, None otherwise."""
    if not spec.attn_logit_softcap:
        if softcap is not None:
            raise ValueError(f"softcap={softcap!r} but spec {spec.name!r} has attn_logit_softcap=False: pass "
                             "softcap=None, or build a spec with attn_logit_softcap=True")
        return
    if softcap is None:
        raise ValueError(f"spec {spec.name!r} has attn_logit_softcap=True: pass softcap, the logit cap (a finite "
                         "number > 0, e.g. 50.0 for Gemma 2's attn_logit_softcapping)")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number (the logit cap), got {type(softcap).__name__} {softcap!r}: "
                        "pass e.g. softcap=50.0")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a finite number > 0 (the logit cap), got {softcap!r}: pass e.g. "
                         "softcap=50.0, or build a spec with attn_logit_softcap=False for no capping")
    _, k, _ = launch_scalars(scale, softcap)
    if not (2.0**-125 <= min(k, softcap) and max(k, softcap) <= 2.0**126):
        raise ValueError(f"softcap={softcap!r} with scale={scale!r} is outside fp32's range (the kernel takes "
                         f"cap and 2 log2(e) scale / cap = {k:.3g}, both within 2^-125..2^126): pass a cap "
                         "in a sensible range, e.g. 1.0 .. 1000.0")


def _typed(name, t, dtype) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}: convert it with .to({dtype})")


def _check_rows(name, t) -> None:
    s = t.stride()
    if s[2] != 1 or s[1] % 8 or s[0] % 8:
        raise ValueError(f"{name} must have a contiguous last dim and row strides that are multiples of 8 "
                         f"elements (16-byte rows), got strides {s}: call .contiguous()")


F16_MAX = 65504.0


def check_fp8_inputs(q, k_scale, v_scale) -> None:
    """FLINTGEN_CHECK_INPUTS=1 with an fp8 cache: the scales are finite and
    > 0, and q lies within f16's range (the kernel converts q to f16 with
    saturation: larger magnitudes would be clamped to 65504). Works on any
    device (synchronizes)."""
    kv_scales.check_scale_values(k_scale, v_scale)
    if q.numel():
        big = float(q.detach().abs().float().amax().item())
        if not big <= F16_MAX:
            raise ValueError(f"q has |values| up to {big!r}, outside f16's range (|q| <= {F16_MAX:g}): the fp8 "
                             "path runs the f16 mma and would saturate them to +-65504 (NaN stays NaN); "
                             "scale q down (fold the factor into scale) or use a bf16 cache")


def _check_device_inputs(kv_cache, block_tables, seq_lens) -> None:
    """FLINTGEN_CHECK_INPUTS=1: synchronize and check the device-side contract
    (block ids of attended pages in range, seq_lens within the table)."""
    import torch

    page = kv_cache.shape[2]
    lens = seq_lens.to(torch.int64).cpu()
    width = block_tables.shape[1]
    if (lens < 0).any() or (lens > width * page).any():
        raise ValueError(f"seq_lens must lie in [0, max_blocks * {page} = {width * page}], got "
                         f"{lens.tolist()}")
    pages = (lens + page - 1) // page
    cols = torch.arange(width)
    used = cols[None, :] < pages[:, None]
    ids = block_tables.cpu()[used]
    if ids.numel() and (ids.min() < 0 or ids.max() >= kv_cache.shape[0]):
        raise ValueError(f"block_tables has ids outside [0, {kv_cache.shape[0]}) in attended pages")
