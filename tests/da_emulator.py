"""CPU emulator of the generated decode-attention kernel (a test helper).

Runs the *rendered* template module and the device modules it imports
(paged_kv, decode_mma, attention_combine) in plain Python: the CuTe DSL and
the inline-PTX wrappers are replaced by mocks with the same semantics, one
Python thread per GPU thread. It checks the index arithmetic of every shape
(fragment layouts, head tiles, slices of larger pages, merges) on a machine
without a GPU; it says nothing about timing, races or the compiled code.
Checked against the H200-verified Flint kernel: its cluster, global-merge
and single-split variants reproduce the reference here, and mutating a head
tile's scratch offset or a page slice's byte offset fails the check.

Emulated semantics:

* Memory: one flat byte array for global memory (tensors at 256-byte
  aligned addresses), one per CTA for shared memory; ``mapa`` tags a shared
  address with the peer's cluster rank (bit 20 up).
* Warps: shuffles and ``mma.sync.m16n8k16`` exchange values through a
  32-thread barrier (PTX fragment layouts); fp32 math in numpy float32,
  bf16 rounding to nearest even. The fp8 path: ``cvt.rn.f16x2.e4m3x2``
  decodes e4m3fn bytes exactly (``e4m3_to_f16_bits``; NaN -> f16 NaN),
  q's ``cvt.rn.satfinite.f16x2.f32`` clamps to +-65504 then rounds to
  nearest even (numpy's float16), P's ``cvt.rn.f16x2.f32`` rounds to
  nearest even, the f16 ``mma`` multiplies the f16 values exactly and sums
  in fp64 before rounding to fp32 (as for bf16). ``ex2.approx.ftz`` is numpy's fp32 exp2 flushed to 0 below fp32's
  normal range (within 1 ulp; the hardware's is within 2), ``rcp.approx`` the rounded fp32 quotient (the hardware is within 1 ulp).
* mbarriers: arrival count + transaction bytes + phase; a bulk copy lands at
  once and completes its bytes. ``try_wait.parity P`` returns once the phase
  of parity P completed.
* Grid: CTAs of a cluster run concurrently (cluster barriers are
  arrive / wait generations); other CTAs run one after another, a valid
  schedule for the last-arriving-CTA merge. A CTA that polls its pair's
  arrival counter (several merging CTAs) runs the pair's next pending CTA
  in the meantime. PDL instructions are no-ops.
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import sys
import threading
import types
import warnings

import numpy as np

_CTX = threading.local()
_ATOMIC = threading.Lock()
_RANK_SHIFT = 20


# ----------------------------------------------------------------- numbers
class _Num:
    size = 4


class Float32(_Num):
    def __new__(cls, x=0.0):
        return np.float32(x)


class Int32(_Num):
    def __new__(cls, x=0):
        return int(x)


class Int64(_Num):
    size = 8

    def __new__(cls, x=0):
        return int(x)


class Uint32(_Num):
    def __new__(cls, x=0):
        return int(x) & 0xFFFFFFFF


class Uint8(_Num):
    size = 1


class BFloat16(_Num):
    size = 2


class Float8E4M3FN(_Num):
    size = 1


def e4m3_to_f16_bits(byte):
    """f16 bits of the e4m3fn byte (s eeee mmm, bias 7: subnormals m 2^-9,
    s 1111 111 NaN, no infinities): exact, every e4m3 value is an f16 one."""
    byte = int(byte) & 0xFF
    sign, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return 0x7FFF        # canonical NaN (cvt's)
    v = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return int(np.array([-v if sign else v], dtype=np.float16).view(np.uint16)[0])


_E4M3_F16 = [e4m3_to_f16_bits(b) for b in range(256)]


def _f32_to_f16(x, satfinite=False):
    """f16 bits of fp32 ``x`` rounded to nearest even (numpy); ``satfinite``
    clamps magnitudes past 65504 (infinities too) to +-65504 first."""
    x = np.float32(x)
    if satfinite and not np.isnan(x):
        x = np.float32(np.clip(x, -65504.0, 65504.0))
    with np.errstate(over="ignore"):
        return int(np.array([x], dtype=np.float32).astype(np.float16).view(np.uint16)[0])


def _f16(w):
    return (np.asarray(w) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)


def _f32_to_bf16(x):
    """Round to nearest even (cvt.rn.bf16.f32); NaN stays NaN."""
    u = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x7FFFFF):
        return 0x7FC0
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) & 0xFFFF


# ----------------------------------------------------------------- memory
class GlobalMemory:
    def __init__(self, nbytes):
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.top = 256

    def place(self, arr):
        """Copy a numpy array in; returns its base address."""
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        addr = self.top
        if addr + raw.size > self.buf.size:
            raise MemoryError("emulator global memory too small")
        self.buf[addr:addr + raw.size] = raw
        self.top = (addr + raw.size + 255) // 256 * 256
        return addr

    def read(self, addr, dtype, count):
        n = np.dtype(dtype).itemsize * count
        return self.buf[addr:addr + n].view(dtype).copy()

    def write(self, addr, dtype, values):
        raw = np.asarray(values, dtype=dtype).view(np.uint8).reshape(-1)
        self.buf[addr:addr + raw.size] = raw


class _Iter:
    def __init__(self, addr):
        self.addr = addr

    def toint(self):
        return self.addr


class Tensor:
    """A global tensor: numpy array placed in ``GlobalMemory``; strides in elements."""

    def __init__(self, mem, arr):
        self.mem = mem
        self.dtype = arr.dtype
        self.shape = tuple(arr.shape)
        self.stride = tuple(s // arr.dtype.itemsize for s in np.ascontiguousarray(arr).strides)
        self.addr = mem.place(arr)
        self.iterator = _Iter(self.addr)

    def __getitem__(self, i):
        v = self.mem.read(self.addr + int(i) * self.dtype.itemsize, self.dtype, 1)[0]
        return np.float32(v) if self.dtype == np.float32 else int(v)

    def numpy(self):
        n = int(np.prod(self.shape))
        return self.mem.read(self.addr, self.dtype, n).reshape(self.shape)


class SmemPtr:
    def __init__(self, addr, size):
        self.addr = addr
        self.size = size

    def __add__(self, n):
        return SmemPtr(self.addr + int(n) * self.size, self.size)


class SmemAllocator:
    def __init__(self):
        self.top = 0

    def allocate_array(self, dtype, n, byte_alignment=1):
        a = (self.top + byte_alignment - 1) // byte_alignment * byte_alignment
        self.top = a + dtype.size * n
        if self.top > 227 * 1024:
            raise MemoryError(f"shared memory {self.top} B exceeds 227 KB")
        return SmemPtr(a, dtype.size)


# ----------------------------------------------------------------- sync
class _Exchange:
    """A barrier with per-lane slots (warp shuffles, mma). The barrier's action
    (run once, by the last lane to arrive) evaluates an mma for the whole warp."""

    def __init__(self, n):
        self.slots = [None] * n
        self.result = None
        self.barrier = threading.Barrier(n, action=self._act)

    def _act(self):
        s0 = self.slots[0]
        if isinstance(s0, tuple) and s0 and s0[0] in ("mma", "mma_f16"):
            self.result = _mma_warp(self.slots)


_G = np.arange(32) // 4
_T = np.arange(32) % 4


def _lo(w):
    return ((w & 0xFFFF) << 16).astype(np.uint32).view(np.float32)


def _hi(w):
    return (w & 0xFFFF0000).astype(np.uint32).view(np.float32)


def s0_kind(slots):
    return slots[0][0]


def _mma_warp(slots):
    """D = A B + C of mma.m16n8k16 (bf16 or, for kind "mma_f16", f16 A
    row-major, B col-major, fp32 C) from the 32 lanes' fragments; returns
    each lane's 4 D values."""
    lo, hi = (_lo, _hi) if s0_kind(slots) == "mma" else (lambda w: _f16(w), lambda w: _f16(w >> 16))
    a = np.array([s[1] for s in slots], dtype=np.uint32)            # [32, 4]
    b = np.array([(s[2], s[3]) for s in slots], dtype=np.uint32)     # [32, 2]
    c = np.array([s[4] for s in slots], dtype=np.float32)            # [32, 4]
    g, t = _G, _T
    A = np.zeros((16, 16), np.float32)
    for r, (ro, co) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        A[g + ro, 2 * t + co] = lo(a[:, r])
        A[g + ro, 2 * t + co + 1] = hi(a[:, r])
    B = np.zeros((16, 8), np.float32)
    B[2 * t, g] = lo(b[:, 0])
    B[2 * t + 1, g] = hi(b[:, 0])
    B[2 * t + 8, g] = lo(b[:, 1])
    B[2 * t + 9, g] = hi(b[:, 1])
    D = A.astype(np.float64) @ B.astype(np.float64)
    out = np.stack([D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]], axis=1)
    return (out + c.astype(np.float64)).astype(np.float32)


class _MBar:
    def __init__(self, count):
        self.cond = threading.Condition()
        self.count = self.pending = count
        self.tx = 0
        self.phase = 0

    def _check(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count
            self.cond.notify_all()

    def arrive_expect(self, nbytes):
        with self.cond:
            self.tx += nbytes
            self.pending -= 1
            self._check()

    def complete(self, nbytes):
        with self.cond:
            self.tx -= nbytes
            self._check()

    def wait(self, parity):
        with self.cond:
            if not self.cond.wait_for(lambda: (self.phase & 1) != parity, timeout=60):
                raise RuntimeError("mbarrier wait timed out (pipeline bug)")


class _ClusterBarrier:
    def __init__(self, n):
        self.n = n
        self.cond = threading.Condition()
        self.arrivals = {}

    def arrive(self):
        with self.cond:
            k = _CTX.cl_arrived
            _CTX.cl_arrived += 1
            self.arrivals[k] = self.arrivals.get(k, 0) + 1
            self.cond.notify_all()

    def wait(self):
        with self.cond:
            k = _CTX.cl_waited
            _CTX.cl_waited += 1
            if not self.cond.wait_for(lambda: self.arrivals.get(k, 0) == self.n, timeout=60):
                raise RuntimeError("cluster barrier timed out")


class _CTA:
    def __init__(self, block, threads, cluster, rank):
        self.block = block
        self.smem = np.zeros(228 * 1024, dtype=np.uint8)
        self.barrier = threading.Barrier(threads)
        self.warps = [_Exchange(32) for _ in range(threads // 32)]
        self.mbars = {}
        self.mbar_lock = threading.Lock()
        self.cluster = cluster     # (list of CTAs, _ClusterBarrier) or None
        self.rank = rank


def _smem_of(addr):
    cta = _CTX.cta
    rank = addr >> _RANK_SHIFT
    if rank:
        cta = cta.cluster[0][rank - 1]
    return cta.smem, addr & ((1 << _RANK_SHIFT) - 1)


def _smem_read(addr, dtype, count):
    mem, a = _smem_of(addr)
    n = np.dtype(dtype).itemsize * count
    return mem[a:a + n].view(dtype).copy()


def _smem_write(addr, dtype, values):
    mem, a = _smem_of(addr)
    raw = np.asarray(values, dtype=dtype).view(np.uint8).reshape(-1)
    mem[a:a + raw.size] = raw


def _mbar(addr):
    cta = _CTX.cta
    with cta.mbar_lock:
        return cta.mbars[addr]


def _exchange(value, pick):
    w = _CTX.cta.warps[_CTX.tid // 32]
    lane = _CTX.tid % 32
    w.slots[lane] = value
    w.barrier.wait()
    r = pick(w.slots, lane)
    w.barrier.wait()
    return r


# ----------------------------------------------------------------- cute.arch
def _arch():
    a = types.SimpleNamespace()
    a.thread_idx = lambda: (_CTX.tid, 0, 0)
    a.block_idx = lambda: _CTX.cta.block
    a.warp_idx = lambda: _CTX.tid // 32
    a.lane_idx = lambda: _CTX.tid % 32
    a.make_warp_uniform = lambda x: x
    a.sync_threads = lambda: _CTX.cta.barrier.wait()
    a.sync_warp = lambda: _CTX.cta.warps[_CTX.tid // 32].barrier.wait()
    a.griddepcontrol_wait = lambda: None
    a.griddepcontrol_launch_dependents = lambda: None
    a.fmax = lambda x, y: np.fmax(np.float32(x), np.float32(y))

    def mbarrier_init(ptr, count):
        with _CTX.cta.mbar_lock:
            _CTX.cta.mbars[ptr.addr] = _MBar(count)

    a.mbarrier_init = mbarrier_init
    a.mbarrier_init_fence = lambda: None
    a.mbarrier_arrive_and_expect_tx = lambda ptr, n: _mbar(ptr.addr).arrive_expect(int(n))
    a.mbarrier_wait = lambda ptr, parity: _mbar(ptr.addr).wait(int(parity) & 1)
    a.shuffle_sync = lambda v, src: _exchange(v, lambda s, lane: s[int(src) & 31])
    a.shuffle_sync_bfly = lambda v, m: _exchange(v, lambda s, lane: s[lane ^ int(m)])
    a.cluster_arrive_relaxed = lambda: _CTX.cta.cluster[1].arrive()
    a.cluster_arrive = lambda: _CTX.cta.cluster[1].arrive()
    a.cluster_wait = lambda: _CTX.cta.cluster[1].wait()
    return a


# ----------------------------------------------------------------- ptx mocks
def _ptx(gmem):
    p = types.SimpleNamespace()
    p.ldg_u32x4 = lambda addr: tuple(int(x) for x in gmem.read(int(addr), np.uint32, 4))
    p.ldg_cg_f32x4 = lambda addr: tuple(gmem.read(int(addr), np.float32, 4))
    p.ldg_cg_f32x2 = lambda addr: tuple(gmem.read(int(addr), np.float32, 2))
    p.ldg_cg_f32 = lambda addr: gmem.read(int(addr), np.float32, 1)[0]
    p.ld_acquire_i32 = lambda addr: int(gmem.read(int(addr), np.int32, 1)[0])
    # A CTA polling an arrival counter: run the next CTA of its (request, kv
    # head) that has not run yet (CTAs otherwise run one after another).
    p.nanosleep = lambda ns: _CTX.launch.run_next_of_pair(_CTX.cta.block)
    p.ldg_u32_pred = lambda addr, pred: int(gmem.read(int(addr), np.uint32, 1)[0]) if pred else 0
    p.stg_u32x4 = lambda addr, a, b, c, d: gmem.write(int(addr), np.uint32, [a, b, c, d])
    p.stg_u32x2 = lambda addr, a, b: gmem.write(int(addr), np.uint32, [a, b])
    p.stg_u32 = lambda addr, a: gmem.write(int(addr), np.uint32, [a])
    p.stg_f32x4 = lambda addr, a, b, c, d: gmem.write(int(addr), np.float32, [a, b, c, d])
    p.stg_f32 = lambda addr, a: gmem.write(int(addr), np.float32, [a])
    p.stg_i32_relaxed = lambda addr, a: gmem.write(int(addr), np.int32, [a])

    def atomic_add(addr, v):
        with _ATOMIC:
            old = int(gmem.read(int(addr), np.int32, 1)[0])
            gmem.write(int(addr), np.int32, [old + int(v)])
        return old

    p.atomic_add_acq_rel = atomic_add
    p.lds_u32x4 = lambda addr: tuple(int(x) for x in _smem_read(int(addr), np.uint32, 4))
    p.lds_f32 = lambda addr: _smem_read(int(addr), np.float32, 1)[0]
    p.lds_i32 = lambda addr: int(_smem_read(int(addr), np.int32, 1)[0])
    p.sts_f32 = lambda addr, v: _smem_write(int(addr), np.float32, [v])
    p.sts_i32 = lambda addr, v: _smem_write(int(addr), np.int32, [v])
    p.smem_addr = lambda ptr: ptr.addr

    def bulk_copy(dst, src, mbar, n, policy=None):   # the L2 policy changes no value
        n = int(n)
        _smem_write(int(dst), np.uint8, gmem.read(int(src), np.uint8, n))
        _mbar(int(mbar)).complete(n)

    p.bulk_copy_g2s = bulk_copy
    p.evict_first_policy = lambda: 0
    p.mapa = lambda addr, rank: (int(addr) & ((1 << _RANK_SHIFT) - 1)) | ((int(rank) + 1) << _RANK_SHIFT)
    p.st_cluster_f32x4 = lambda addr, a, b, c, d: _smem_write(int(addr), np.float32, [a, b, c, d])
    p.st_cluster_f32 = lambda addr, a: _smem_write(int(addr), np.float32, [a])
    p.ex2 = lambda x: _ftz(np.float32(np.exp2(np.float32(x))))
    p.fma = lambda a, b, c: np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    p.neg_inf = lambda: np.float32(-np.inf)
    p.bf16x2 = lambda lo, hi: _f32_to_bf16(lo) | (_f32_to_bf16(hi) << 16)

    def prmt(a, b, sel):
        bs = int(a).to_bytes(4, "little") + int(b).to_bytes(4, "little")
        return int.from_bytes(bytes(bs[(int(sel) >> (4 * i)) & 7] for i in range(4)), "little")

    p.prmt = prmt

    def mma(c, a, b0, b1, kind="mma"):
        w = _CTX.cta.warps[_CTX.tid // 32]
        return tuple(_exchange((kind, tuple(int(x) for x in a), int(b0), int(b1), tuple(c)),
                               lambda s, lane: w.result[lane]))

    p.mma_bf16_16816 = mma
    p.mma_f16_16816 = lambda c, a, b0, b1: mma(c, a, b0, b1, "mma_f16")
    p.e4m3x4_to_f16x2x2 = lambda w: (_E4M3_F16[int(w) & 0xFF] | (_E4M3_F16[(int(w) >> 8) & 0xFF] << 16),
                                     _E4M3_F16[(int(w) >> 16) & 0xFF] | (_E4M3_F16[(int(w) >> 24) & 0xFF] << 16))
    p.e4m3x2_to_f16x2 = lambda w: _E4M3_F16[int(w) & 0xFF] | (_E4M3_F16[(int(w) >> 8) & 0xFF] << 16)
    p.bf16x2_to_f16x2_sat = lambda w: (_f32_to_f16(_lo(np.uint32(w)), True)
                                       | (_f32_to_f16(_hi(np.uint32(w)), True) << 16))
    p.f16x2 = lambda lo, hi: _f32_to_f16(lo) | (_f32_to_f16(hi) << 16)
    p.lds_u32 = lambda addr: int(_smem_read(int(addr), np.uint32, 1)[0])
    # attn_ptx
    p.stg_b16 = lambda addr, w: gmem.write(int(addr), np.uint16, [int(w) & 0xFFFF])
    p.selp_f32 = lambda a, b, pred: np.float32(a) if pred else np.float32(b)
    p.selp_u32 = lambda a, b, pred: int(a) if pred else int(b)
    p.lds_f32x4 = lambda addr: tuple(_smem_read(int(addr), np.float32, 4))
    p.sts_f32x2 = lambda addr, a, b: _smem_write(int(addr), np.float32, [a, b])
    p.lds_u32x2 = lambda addr: tuple(int(x) for x in _smem_read(int(addr), np.uint32, 2))
    p.lds_f32x2 = lambda addr: tuple(_smem_read(int(addr), np.float32, 2))
    p.stg_f32x2 = lambda addr, a, b: gmem.write(int(addr), np.float32, [a, b])
    p.st_cluster_f32x2 = lambda addr, a, b: _smem_write(int(addr), np.float32, [a, b])
    p.rcp_approx = _rcp_ftz
    return p


def _ftz(x):
    """Flush subnormal fp32 values to +-0 (the ``.ftz`` of PTX); scalars or arrays."""
    x = np.float32(x)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0.0), x), x).astype(np.float32)[()]


def _rcp_ftz(x):
    """rcp.approx.ftz.f32 (within 1 ulp) emulated as the rounded fp32 quotient."""
    with np.errstate(divide="ignore"):
        return _ftz(np.float32(1.0) / _ftz(x))


# ----------------------------------------------------------------- launch
class _Launch:
    def __init__(self, obj, fn, args):
        self.obj, self.fn, self.args = obj, fn, args

    def launch(self, grid, block, stream=None, cluster=None, use_pdl=False):
        gx, gy, gz = (int(v) for v in grid)
        self.threads = threads = int(block[0])
        cx = int(cluster[0]) if cluster else 1
        self.pending = [(x0, y, z) for z in range(gz) for y in range(gy) for x0 in range(0, gx, cx)]
        self.lock = threading.Lock()
        # Every thread of a cluster must run at once (barriers), and a CTA
        # polling a counter runs the next CTA of its pair from its own thread:
        # workers for the largest cluster (8 x 256) and its nesting, started as
        # needed and all ended with the launch (none left idle in the process).
        self.pool = cf.ThreadPoolExecutor(max_workers=8 * 256, thread_name_prefix="emulated-gpu-thread")
        try:
            while True:
                with self.lock:
                    if not self.pending:
                        break
                    x0, y, z = self.pending.pop(0)
                self._run_cluster([(x0 + r, y, z) for r in range(cx)], threads, cx > 1)
        finally:
            self.pool.shutdown(wait=True)

    def run_next_of_pair(self, block):
        """Run the next pending (unclustered) CTA with ``block``'s (y, z)."""
        with self.lock:
            nxt = next((b for b in self.pending if b[1:] == tuple(block[1:])), None)
            if nxt is None:
                raise AssertionError(f"CTA {block} waits on its pair's counter but no CTA of the pair is left")
            self.pending.remove(nxt)
        self._run_cluster([nxt], self.threads, False)

    def _run_cluster(self, blocks, threads, clustered):
        ctas = []
        cl = None
        if clustered:
            cl = (ctas, _ClusterBarrier(len(blocks) * threads))
        for r, blk in enumerate(blocks):
            ctas.append(_CTA(blk, threads, cl, r))
        errors = []

        def body(cta, tid):
            _CTX.cta, _CTX.tid, _CTX.launch = cta, tid, self
            _CTX.cl_arrived = _CTX.cl_waited = 0
            try:
                self.fn(self.obj, *self.args)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                cta.barrier.abort()
                for w in cta.warps:
                    w.barrier.abort()

        futs = [self.pool.submit(body, c, i) for c in ctas for i in range(threads)]
        for f in futs:
            f.result()
        if errors:
            raise errors[0]


def _kernel(fn):
    def bind(self, *args):
        return _Launch(self, fn, args)

    return bind


def _identity(fn=None, **_):
    return fn if fn is not None else (lambda f: f)


# ----------------------------------------------------------------- module loading
# The device modules the decode kernel imports, in dependency order.
_DEVICE_MODULES = ("arrivals", "paged_kv", "decode_mma", "attention_combine")


def _device_imports(source: str) -> set:
    """The flintgen.device modules ``source`` imports (``from flintgen.device
    import a, b`` and ``from flintgen.device.a import ...``)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "flintgen.device":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flintgen.device."):
            out.add(node.module.split(".")[2])
    return out


def load(source: str, gmem: GlobalMemory):
    """Exec the rendered kernel module and its device modules against mocks;
    returns the kernel module's namespace."""
    import os

    import flintgen.device as real_dev

    ptx = _ptx(gmem)
    cute = types.ModuleType("cutlass.cute")
    cute.arch = _arch()
    cute.jit = _identity
    cute.kernel = _kernel
    cute.Tensor = Tensor
    cute.make_rmem_tensor = lambda shape, dtype: [dtype(0)] * int(np.prod(shape))
    cute.sym_int = cute.sym_int64 = lambda **_: None
    runtime = types.ModuleType("cutlass.cute.runtime")
    runtime.make_fake_compact_tensor = runtime.make_fake_stream = runtime.make_fake_tensor = None
    cute.runtime = runtime
    cutlass = types.ModuleType("cutlass")
    for n, v in dict(Float32=Float32, Int32=Int32, Int64=Int64, Uint32=Uint32, Uint8=Uint8, BFloat16=BFloat16,
                     Float8E4M3FN=Float8E4M3FN,
                     cute=cute, Constexpr=object, const_expr=lambda x: x,
                     range_constexpr=range, range=lambda *a, **_: range(*(int(x) for x in a)),
                     min=min, max=max).items():
        setattr(cutlass, n, v)
    memory = types.ModuleType("cutlass.memory")
    memory.SmemAllocator = SmemAllocator
    cutlass.memory = memory
    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUstream = object
    ptx_mod = types.ModuleType("flintgen.device.ptx")
    ptx_mod.__dict__.update(vars(ptx))
    dev = types.ModuleType("flintgen.device")
    dev.__path__ = []
    dev.ptx = dev.attn_ptx = ptx_mod
    mods = {"cutlass": cutlass, "cutlass.cute": cute, "cutlass.cute.runtime": runtime, "cutlass.memory": memory,
            "cuda": types.ModuleType("cuda"), "cuda.bindings": types.ModuleType("cuda.bindings"),
            "cuda.bindings.driver": driver, "flintgen.device": dev, "flintgen.device.ptx": ptx_mod,
            "flintgen.device.attn_ptx": ptx_mod}
    # Every device module the kernel imports runs here against the mocks: one
    # missing from _DEVICE_MODULES would be the real (cute) module, or a real
    # one some compile left in sys.modules, called from emulator threads.
    paths = {n: os.path.join(os.path.dirname(real_dev.__file__), n + ".py") for n in _DEVICE_MODULES}
    texts = {}
    for n, path in paths.items():
        with open(path) as f:
            texts[n] = f.read()
    unknown = (set().union(*map(_device_imports, [source, *texts.values()]))
               - set(_DEVICE_MODULES) - {"ptx", "attn_ptx"})
    if unknown:
        raise AssertionError(f"the kernel imports flintgen.device modules the emulator does not load: "
                             f"{sorted(unknown)}; add them to da_emulator._DEVICE_MODULES")
    saved = {k: sys.modules.get(k) for k in list(mods) + [f"flintgen.device.{n}" for n in _DEVICE_MODULES]}
    sys.modules.update(mods)
    try:
        for name in _DEVICE_MODULES:
            m = types.ModuleType("flintgen.device." + name)
            sys.modules[m.__name__] = m
            setattr(dev, name, m)
            exec(compile(texts[name], paths[name], "exec"), m.__dict__)
        ns = {"__name__": "emulated_decode_attention"}
        exec(compile(source, "<decode_attention module>", "exec"), ns)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return ns


def run(kdef, spec, variant, q, kv, bt, seq_lens, sinks, window, scale, *, num_partials, softcap=None,
        k_scale=None, v_scale=None):
    """Run one launch of ``variant`` on CPU torch/numpy inputs; returns out
    [B, Hq, D] as float32 numpy (bf16 values). ``sinks`` None -> -inf.
    ``softcap``: the logit cap of a soft-capping variant (scalar arguments as
    the op computes them, ``launch_scalars``). An fp8 variant takes the
    e4m3 cache as float8_e4m3fn or uint8 and ``k_scale`` / ``v_scale``
    (one-element tensors or numbers)."""
    import torch

    from flintgen import codegen
    from flintgen.kernels.decode_attention import launch_scalars
    from flintgen.layout import AttentionLayout

    # -inf - -inf in discarded lanes (``_weight``'s selp) is expected.
    warnings.filterwarnings("ignore", message="invalid value encountered", category=RuntimeWarning)
    src = codegen.render(variant.kernel, kdef.template, dict(kdef.render_params(spec, variant)))

    def bf(t):  # bf16 tensor -> its raw uint16 bits
        return t.contiguous().view(dtype=torch.int16).numpy().view(np.uint16)

    def raw(t):  # the cache's raw element bits (bf16: uint16; e4m3: uint8)
        if t.dtype in (torch.float8_e4m3fn, torch.uint8):
            return t.contiguous().view(torch.uint8).numpy()
        return bf(t)

    b, hq, d = q.shape
    # q and out (bf16), the cache, the table, partials of up to 16 heads, slack.
    need = q.numel() * 4 + kv.numel() * 2 + bt.numel() * 4 + 4 * num_partials * 40 * d + (1 << 20)
    gmem = GlobalMemory(need + 64 * 256)
    ns = load(src, gmem)
    th = AttentionLayout(head_dim=d, gqa=hq // kv.shape[1]).q_rows   # partials: real heads only
    tq = Tensor(gmem, bf(q))
    tkv = Tensor(gmem, raw(kv))
    tbt = Tensor(gmem, bt.numpy().astype(np.int32))
    tlens = Tensor(gmem, seq_lens.numpy().astype(np.int32))
    s = np.full(hq, -np.inf, np.float32) if sinks is None else sinks.numpy().astype(np.float32)
    tsinks = Tensor(gmem, s)
    tout = Tensor(gmem, np.full((b, hq, d), 0x7FC0, np.uint16))          # poisoned: NaN
    n = max(num_partials, 1)
    part_o = Tensor(gmem, np.full(n * th * d, np.nan, np.float32))
    part_ml = Tensor(gmem, np.full(n * 2 * th, np.nan, np.float32))
    counters = Tensor(gmem, np.zeros(max(b * kv.shape[1], 1), np.int32))
    scale_log2, *cap = (np.float32(x) for x in launch_scalars(scale, softcap))
    scales = ()
    if dict(variant.params).get("kv_fp8"):
        scales = tuple(Tensor(gmem, np.array([float(x)], np.float32)) for x in (k_scale, v_scale))
    ns["DecodeAttention"]()(tq, tkv, tbt, tlens, tsinks, tout, part_o, part_ml, counters, *scales,
                            scale_log2, int(window or 0), *cap, None)
    if counters.numpy().any():
        raise AssertionError("arrival counters not reset")
    raw = tout.numpy().astype(np.uint32) << 16
    return raw.view(np.float32)
