"""Inputs and checks shared by the decode-attention tests (GPU launches and
the CPU emulator, tests/da_emulator.py).

Error figures are appended to the file named by FLINTGEN_DA_RESULTS (one
line per checked case) when it is set.
"""

import os
import random

import torch

from flintgen.layout import SLICE_TOKENS
from flintgen.references.decode_attention import (
    decode_attention_ref,
    decode_attention_seed_rounding,
    dequantize_kv,
    head_errors,
    quantize_kv,
    rel_error,
)

SLICE = SLICE_TOKENS  # tokens the kernel streams per ring slot, whatever the page size
_RESULTS = os.environ.get("FLINTGEN_DA_RESULTS")


def record(line: str) -> None:
    print(line)
    if _RESULTS:
        with open(_RESULTS, "a") as f:
            f.write(line + "\n")


class Case:
    """Random inputs for one launch (on ``device``) of a spec's shape: q
    [B, Hq, D], HND cache [blocks, Hkv, page, 2D], block tables, seq_lens.

    Block tables are random permutations of the cache's blocks. Everything
    the kernel must not read is NaN: block 0 (the padding id of unused table
    columns), positions past seq_len in the last page, positions before the
    window in its first page and whole pages before it. A stale or
    out-of-range read therefore shows up as NaN in the output.

    ``softcap``: the logit cap passed to a soft-capping spec's op (``kwargs``)
    and to the references; ``q_scale`` sets the logits' spread (q . k * scale
    has a standard deviation of about ``q_scale``).
    """

    def __init__(self, spec, lens, window, *, seed=0, extra_cols=3, q_scale=1.5, device="cuda", softcap=None):
        g = torch.Generator(device=device).manual_seed(seed)
        rnd = random.Random(seed)
        self.spec, self.window = spec, window
        hq, hkv = spec.q_heads_per_rank, spec.kv_heads_per_rank
        d, page = spec.head_dim, spec.page_size
        b = len(lens)
        pages = [-(-n // page) for n in lens]
        width = max(pages + [1]) + extra_cols
        nblocks = sum(pages) + 2
        ids = list(range(1, nblocks))
        rnd.shuffle(ids)
        kv = torch.randn(nblocks, hkv, page, 2 * d, generator=g, device=device).bfloat16()
        bt = torch.zeros(b, width, dtype=torch.int32)
        dead = [0]
        for i, n in enumerate(lens):
            row = [ids.pop() for _ in range(pages[i])]
            bt[i, :pages[i]] = torch.tensor(row, dtype=torch.int32)
            if n == 0:
                continue
            start = max(n - window, 0) if window is not None else 0
            dead += row[:start // page]
            if start % page:
                kv[row[start // page], :, :start % page] = float("nan")
            if n % page:
                kv[row[-1], :, n % page:] = float("nan")
        kv[torch.tensor(dead, device=device)] = float("nan")
        self.kv = kv
        self.bt = bt.to(device)
        self.lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.q = (torch.randn(b, hq, d, generator=g, device=device) * q_scale).bfloat16()
        self.sinks = (torch.randn(hq, generator=g, device=device) * 2).float() if spec.sinks else None
        self.scale = spec.scale
        self.softcap = softcap

    def args(self, out):
        return (self.q, self.kv, self.bt, self.lens, self.sinks, self.window, self.scale, out)

    def kwargs(self):
        """The op's keyword arguments: ``softcap`` where the case has one."""
        return {} if self.softcap is None else {"softcap": self.softcap}

    def poisoned_out(self):
        return torch.full_like(self.q, float("nan"))

    def check(self, out, label, *, kv=None, tol=1e-2, head_tol=None):
        """Finite, exact zeros for seq_len 0, and the error vs the fp64
        reference <= tol and <= 2x the seed-rounding torch error (and, with
        ``head_tol``, the max over (request, head) of the relative error <=
        head_tol). Returns (err_kernel, err_torch)."""
        out = out.to(self.q.device)
        assert torch.isfinite(out).all(), f"{label}: non-finite output"
        zero = self.lens == 0
        assert (out[zero] == 0).all(), f"{label}: seq_len 0 rows are not exact zeros"
        live = ~zero
        if not live.any():
            return 0.0, 0.0
        kv = self.kv if kv is None else kv
        a = (self.q, kv, self.bt, self.lens, self.sinks, self.window, self.scale)
        ref = decode_attention_ref(*a, softcap=self.softcap)
        tor = decode_attention_seed_rounding(*a, softcap=self.softcap)
        ek = rel_error(out[live], ref[live])
        et = rel_error(tor[live], ref[live])
        eh = 0.0
        if head_tol is not None:    # floored at the flush of outputs below 2^-126 max|V| (head_errors)
            v_max = float(kv[..., self.q.shape[-1]:].float().abs().nan_to_num(0.0).amax())
            eh = float(head_errors(out[live], ref[live], v_max).max())
        record(f"{label}: err {ek:.3e} torch-seed-rounding {et:.3e} ratio {ek / max(et, 1e-30):.2f}"
               + (f" max head err {eh:.3e}" if head_tol is not None else ""))
        assert ek <= tol, f"{label}: relative error {ek:.3e} > {tol}"
        assert ek <= 2 * et + 1e-6, f"{label}: error {ek:.3e} above 2x the torch one ({et:.3e})"
        if head_tol is not None:
            assert eh <= head_tol, f"{label}: max (request, head) relative error {eh:.3e} > {head_tol}"
        return ek, et


class Fp8Case(Case):
    """A ``Case`` with an e4m3 cache (an fp8 spec): the bf16 cache's values
    times ``amp`` (dequantized K and V ~ N(0, amp^2)), quantized as vLLM
    writes them (``quantize_kv``: divided by the scale, saturated to +-448)
    with ``k_scale`` / ``v_scale``; ``as_uint8``: the cache passed as
    torch.uint8. The NaN poison of unread positions stays (e4m3 NaN).
    ``check`` compares with the references on the dequantized cache
    (``kv_deq``) and bounds the max (request, head) error by 3e-2."""

    def __init__(self, spec, lens, window, *, k_scale=0.02, v_scale=0.01, amp=1.0, as_uint8=False, **kw):
        super().__init__(spec, lens, window, **kw)
        device = self.q.device
        self.k_scale = torch.tensor([k_scale], dtype=torch.float32, device=device)
        self.v_scale = torch.tensor([v_scale], dtype=torch.float32, device=device)
        self.kv = quantize_kv(self.kv.float() * amp, k_scale, v_scale, as_uint8=as_uint8)
        self.kv_deq = dequantize_kv(self.kv, k_scale, v_scale)

    def set_scales(self, k_scale, v_scale):
        """New scale values written in place (CUDA-graph replays), the cache
        bytes unchanged: the dequantized cache follows."""
        self.k_scale.fill_(k_scale)
        self.v_scale.fill_(v_scale)
        self.kv_deq = dequantize_kv(self.kv, float(self.k_scale), float(self.v_scale))

    def kwargs(self):
        return {**super().kwargs(), "k_scale": self.k_scale, "v_scale": self.v_scale}

    def check(self, out, label, *, kv=None, tol=1e-2, head_tol=3e-2):
        return super().check(out, label, kv=self.kv_deq if kv is None else kv, tol=tol, head_tol=head_tol)


def lens_for(cfg, b, sliding, window, rnd, page=16, cap=None):
    """Mixed seq_lens for one batch: edge lengths (of 16-token slices and of
    ``page``-token pages) plus lengths that activate every split of ``cfg``
    (one long request at least). Lengths are capped at ``cap`` (default
    4M / b tokens: bounds the cache size)."""
    pages = [page - 1, page, page + 1] if page != SLICE else []
    if sliding:
        pool = [0, 1, 15, 16, 17, window - 1, window, window + 1, window + 17, 300, 1000, 2049] + pages
        full = window + 40
    else:
        full = cfg.num_splits * cfg.num_warps * cfg.min_pages * SLICE   # all splits active from here
        pool = [0, 1, 15, 16, 17, 33, 100, full - 1, full, full + 17, rnd.randint(1, full)] + pages
    cap = cap or max(4_000_000 // b, 1)
    lens = [min(rnd.choice(pool), cap) for _ in range(b)]
    lens[0] = min(full + rnd.randint(0, 40), cap)
    return lens


def refill(case, rnd, lens, page=16):
    """New seq_lens and a new permuted block table for ``case``, written in
    place (graph-replay tests change them between replays)."""
    b, width = case.bt.shape
    ids = list(range(1, case.kv.shape[0]))
    rnd.shuffle(ids)
    bt = torch.zeros(b, width, dtype=torch.int32)
    for i, n in enumerate(lens):
        p = -(-n // page)
        bt[i, :p] = torch.tensor(ids[:p], dtype=torch.int32)
        ids = ids[p:]
    case.bt.copy_(bt)
    case.lens.copy_(torch.tensor(lens, dtype=torch.int32))


def precompile(plans, kdef, target, no_load):
    """Compile, in parallel (one process per CPU core but one), every variant
    that the (spec, [(window, batch), ...]) ``plans`` launch, into the default
    cache: GPU tests then spend the GPU's time running, not compiling.
    Returns the number of distinct variants."""
    from flintgen import cache
    from flintgen.cli import _build_one
    from flintgen.procutil import run_spawned

    todo = {}
    for spec, plan in plans:
        op = kdef.bind(spec, target, no_load)
        for window, b in plan:
            v = op._variants[window is not None][b]
            todo.setdefault(v.name, (spec, v))   # the binary depends on the variant alone
    root = cache.default_root()
    run_spawned(_build_one, [(spec, kdef.name, v, target, root) for spec, v in todo.values()],
                workers=max(1, (os.cpu_count() or 2) - 1))
    return len(todo)


def check_compiled(kdef, spec, variant, target, *, need=()):
    """The cached build of ``variant``: no spills, stack or local memory, at
    most 255 registers, sm_90a PTX with the kernel's required instructions
    (and ``need``). Returns (ptxas resources, PTX text)."""
    from flintgen import cache

    entry = cache.make_entry(variant, kdef.template_of(variant), dict(kdef.render_params(spec, variant)), target)
    res = cache.read_meta(entry)["resources"]
    assert res["registers"] is not None and res["registers"] <= 255, res
    assert res["spill_store_bytes"] == 0 and res["spill_load_bytes"] == 0, res
    assert res["stack_bytes"] == 0 and not res["local_memory"], res
    with open(entry.path("kernel.ptx")) as f:
        ptx = f.read()
    assert ".target sm_90a" in ptx
    required = kdef.variant_ptx(variant) if hasattr(kdef, "variant_ptx") else kdef.required_ptx
    for p in tuple(required) + tuple(need):
        assert p in ptx, p
    return res, ptx


def cpu_op_args(b=2, kv_dtype=None, **over):
    """CPU arguments of a flint-shaped (32 q / 4 kv heads of 128, 16-token
    pages) decode-attention call, by keyword: the host checks run on them
    and stop at the first device check. ``over`` replaces any of them."""
    d = 128
    a = dict(q=torch.zeros(b, 32, d, dtype=torch.bfloat16),
             kv_cache=torch.zeros(8, 4, 16, 2 * d, dtype=kv_dtype or torch.bfloat16),
             block_tables=torch.zeros(b, 4, dtype=torch.int32), seq_lens=torch.zeros(b, dtype=torch.int32),
             sinks=torch.zeros(32, dtype=torch.float32), window=128, scale=d ** -0.5,
             out=torch.zeros(b, 32, d, dtype=torch.bfloat16))
    a.update(over)
    return a


def call_op(op, a, **kw):
    """``op`` on the arguments of ``cpu_op_args``."""
    return op(a["q"], a["kv_cache"], a["block_tables"], a["seq_lens"], a["sinks"], a["window"], a["scale"],
              a["out"], **kw)
