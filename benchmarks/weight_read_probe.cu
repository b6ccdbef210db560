// weight_read_probe: how fast can one kernel stream a QKV weight matrix (issue 18)?
//
// The streaming QKV GEMV reads W [N, K] bf16 (row-major, so the whole matrix is one
// contiguous buffer) once per step. This probe times, in CUDA-graph replay with PDL
// between consecutive launches (as the real step), the read alone with several copy
// paths and unit shapes, and a trivial dot per 16 bytes so nothing is optimised away:
//
//   cpasync R C S   persistent grid, units of R rows x C values, S-stage ring filled
//                   by cp.async.cg 16 B pieces from every thread (today's stream design)
//   bulk    R C S   same units, one producer warp: R cp.async.bulk copies of 2C bytes per
//                   unit onto an mbarrier ring, 4 consumer warps
//   tma     R C S   same units, one thread: C/64 TMA 2D boxes [R][64] (128B swizzle)
//   ldg     U G     no shared memory: warps read contiguous 512 B pieces, U in flight per thread
//
// Modes (argv[1]): none, all, wait (wait-first), packed, few (the TMA ring on 40..132 CTAs), units (16 / 32 KB
// units at equal ring bytes), issuers (those rings by cp.async from every thread), xn (the TMA ring's stages
// also taking 16 / 32 / 64 rows of an L2-resident xn per unit, as the wgmma GEMV's), contig (each unit a
// contiguous 16 KB image, one 1-D bulk copy: a unit-major weight layout).
//
// Weights rotate over copies beyond L2. Output: one line per case, us per launch and % of
// a 4 GiB read measured in the same process.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -o weight_read_probe weight_read_probe.cu
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1); } } while (0)

__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ float dot8(uint4 v, float x) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); a = fmaf(f.x, x, fmaf(f.y, x, a)); }
    return a;
}
__device__ __forceinline__ uint4 lds128(unsigned a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(unsigned b, int n) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" :: "r"(b), "r"(n));
}
__device__ __forceinline__ void mbar_expect_arrive(unsigned b, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(b), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned b) {
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];" :: "r"(b) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned b, int phase) {
    asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }"
                 :: "r"(b), "r"(phase) : "memory");
}
__device__ __forceinline__ void bulk_g2s(unsigned dst, const void* src, int bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_2d(unsigned dst, const CUtensorMap* map, int x, int y, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(map), "r"(x), "r"(y), "r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}

struct Shape { int n, k; };   // rows, values per row

// Units: block b of R rows, step s of C values; CTA c takes [c U / G, (c+1) U / G), block-major.
__device__ __forceinline__ void unit_range(int units, int& lo, int& hi) {
    lo = (long long)blockIdx.x * units / gridDim.x;
    hi = (long long)(blockIdx.x + 1) * units / gridDim.x;
}

// ---------------------------------------------------------------- cp.async ring (all threads)
template <int R, int C, int S>
__global__ void __launch_bounds__(128, 1) k_cpasync(const __nv_bfloat16* __restrict__ w, Shape sh, float* out) {
    constexpr int RS = C * 2 + 16, STAGE = R * RS, PIECES = R * C / 8;
    extern __shared__ __align__(1024) unsigned char smem[];
    pdl_launch();
    const int steps = sh.k / C, units = sh.n / R * steps;
    int lo, hi; unit_range(units, lo, hi);
    const int n = hi - lo, tid = threadIdx.x;
    const unsigned base = smem_u32(smem);
    auto issue = [&](int j) {
        if (j < n) {
            int u = lo + j, b = u / steps, s = u % steps;
            const char* src = reinterpret_cast<const char*>(w) + ((size_t)b * R * sh.k + (size_t)s * C) * 2;
            unsigned dst = base + (j % S) * STAGE;
            for (int q = tid; q < PIECES; q += 128) {
                int r = q / (C / 8), c = q % (C / 8);
                cp_async16(dst + r * RS + c * 16, src + (size_t)r * sh.k * 2 + c * 16);
            }
        }
        asm volatile("cp.async.commit_group;");
    };
    for (int j = 0; j < S - 1; ++j) issue(j);
    pdl_wait();
    float acc = 0.f, x = 1.0f + tid * 1e-3f;
    for (int j = 0; j < n; ++j) {
        asm volatile("cp.async.wait_group %0;" :: "n"(S - 2));
        __syncthreads();
        issue(j + S - 1);
        unsigned st = base + (j % S) * STAGE;
        for (int q = tid; q < PIECES; q += 128) acc += dot8(lds128(st + (q / (C / 8)) * RS + (q % (C / 8)) * 16), x);
    }
    out[blockIdx.x * 128 + tid] = acc;
}

// ---------------------------------------------------------------- bulk copies / TMA (producer warp)
template <int R, int C, int S, bool TMA, int MX = 0>
__global__ void __launch_bounds__(160, 1) k_bulk(const __nv_bfloat16* __restrict__ w, Shape sh, float* out,
                                                 const __grid_constant__ CUtensorMap map,
                                                 const __grid_constant__ CUtensorMap xmap) {
    // bulk: rows padded to RS bytes; tma: boxes [R][64] dense (128B swizzle), C/64 per stage;
    // MX > 0 (tma): each stage also takes the unit's C values of MX rows of an L2-resident xn [64, K]
    // (boxes [MX][64] after the weights: the streaming GEMV's xn traffic, not read by the consumers)
    static_assert(MX == 0 || TMA, "xn rows with the TMA ring only");
    constexpr int RS = TMA ? C * 2 : C * 2 + 16, STAGE = R * RS + MX * C * 2, BYTES = R * C * 2 + MX * C * 2;
    extern __shared__ __align__(1024) unsigned char smem[];
    __shared__ __align__(8) unsigned long long full[S], empty[S];
    pdl_launch();
    const int steps = sh.k / C, units = sh.n / R * steps;
    int lo, hi; unit_range(units, lo, hi);
    const int n = hi - lo, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const unsigned base = (smem_u32(smem) + 1023) & ~1023u;
    if (tid == 0) {
        for (int s = 0; s < S; ++s) { mbar_init(smem_u32(&full[s]), 1); mbar_init(smem_u32(&empty[s]), 4); }
        asm volatile("fence.mbarrier_init.release.cluster;");
    }
    __syncthreads();
    if (warp == 4) {   // producer
        for (int j = 0; j < n; ++j) {
            int s = j % S;
            if (j >= S) mbar_wait(smem_u32(&empty[s]), ((j / S) - 1) & 1);
            int u = lo + j, b = u / steps, st = u % steps;
            unsigned dst = base + s * STAGE, bar = smem_u32(&full[s]);
            if (lane == 0) mbar_expect_arrive(bar, BYTES);
            __syncwarp();
            if constexpr (TMA) {
                if (lane < C / 64) tma_2d(dst + lane * R * 128, &map, st * C + lane * 64, b * R, bar);
                if (MX > 0 && lane < C / 64) tma_2d(dst + R * C * 2 + lane * MX * 128, &xmap, st * C + lane * 64, 0, bar);
            } else {
                const char* src = reinterpret_cast<const char*>(w) + ((size_t)b * R * sh.k + (size_t)st * C) * 2;
                for (int r = lane; r < R; r += 32) bulk_g2s(dst + r * RS, src + (size_t)r * sh.k * 2, C * 2, bar);
            }
        }
        return;
    }
    pdl_wait();
    float acc = 0.f, x = 1.0f + tid * 1e-3f;
    constexpr int PIECES = BYTES / 16;
    for (int j = 0; j < n; ++j) {
        int s = j % S;
        mbar_wait(smem_u32(&full[s]), (j / S) & 1);
        unsigned st = base + s * STAGE;
        if constexpr (TMA) {
            for (int q = tid; q < PIECES; q += 128) acc += dot8(lds128(st + q * 16), x);
        } else {
            for (int q = tid; q < PIECES; q += 128) acc += dot8(lds128(st + (q / (C / 8)) * RS + (q % (C / 8)) * 16), x);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(&empty[s]));
    }
    out[blockIdx.x * 128 + tid] = acc;
}

// ---------------------------------------------------------------- registers only
template <int U, bool WAIT_FIRST = false>
__global__ void __launch_bounds__(256) k_ldg(const uint4* __restrict__ w, size_t pieces, float* out) {
    pdl_launch();
    if (WAIT_FIRST) pdl_wait();   // nothing read before the previous grid completes
    // warp-contiguous chunks of 32 U pieces (512 U bytes), grid-strided
    const int lane = threadIdx.x % 32;
    const size_t warps = (size_t)gridDim.x * 8, gw = (size_t)blockIdx.x * 8 + threadIdx.x / 32;
    float acc = 0.f, x = 1.0f + threadIdx.x * 1e-3f;
    for (size_t c = gw * 32 * U; c < pieces; c += warps * 32 * U) {
        uint4 v[U];
#pragma unroll
        for (int i = 0; i < U; ++i) {
            size_t p = c + i * 32 + lane;
            if (p < pieces) asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                                         : "=r"(v[i].x), "=r"(v[i].y), "=r"(v[i].z), "=r"(v[i].w) : "l"(w + p));
            else v[i] = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < U; ++i) acc += dot8(v[i], x);
    }
    pdl_wait();
    out[blockIdx.x * 256 + threadIdx.x] = acc;
}


// ---------------------------------------------------------------- mma fragments straight from global
// CTA block of 16 W rows per warp; unit = block x KB values; warp w loads its 16-row tile's
// fragments (lane (g, t): rows g, g + 8, 16 B pieces at 16 t + 64 i) for P units ahead, xn
// (8 tokens, L1) the same pieces of token g; mma.sync m16n8k16 bf16.
__device__ __forceinline__ uint4 ldg_nc(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ldg_l1(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// PACKED: the same fragments from weights laid out so that a warp's unit (its 16-row tile x 64
// values) is 2 KB contiguous, piece pc = 2 h + i (rows g + 8h, bytes 64 i + 16 t) at pc * 512 + lane * 16:
// every load instruction reads 512 contiguous bytes, consecutive units of a tile are adjacent.
// NT: 8-token MMA n-tiles (M = 8 NT tokens).
template <int WARPS, int KB, int P, int MINB, int NT = 1, bool PACKED = false>
__global__ void __launch_bounds__(32 * WARPS, MINB) k_frag(const __nv_bfloat16* __restrict__ w,
                                                           const __nv_bfloat16* __restrict__ x, Shape sh, float* out) {
    constexpr int BR = 16 * WARPS, PC = KB / 32;   // 16-byte pieces per row per unit, 2 per 64 values
    static_assert(!PACKED || KB == 64, "packed units are 64 values");
    pdl_launch();
    const int steps = sh.k / KB, units = sh.n / BR * steps;
    int lo, hi; unit_range(units, lo, hi);
    const int n = hi - lo, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const char* W = reinterpret_cast<const char*>(w);
    const char* X = reinterpret_cast<const char*>(x) + (size_t)g * sh.k * 2;
    uint4 buf[P][2][PC];
    auto issue = [&](int p, int j) {   // unit j: piece (h, i) at src + h * hstride + i * istride
        bool live = j < n;
        int u = lo + j, b = u / steps, s = u % steps;
        const char* src = PACKED ? W + ((size_t)(b * WARPS + warp) * steps + s) * 4 * 512 + lane * 16
                                 : W + ((size_t)b * BR + warp * 16 + g) * sh.k * 2 + (size_t)s * KB * 2 + 16 * t;
        const size_t hstride = PACKED ? 2 * 512 : (size_t)8 * sh.k * 2, istride = PACKED ? 512 : 64;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < PC; ++i)
                buf[p][h][i] = live ? ldg_nc(src + h * hstride + i * istride) : make_uint4(0, 0, 0, 0);
    };
#pragma unroll
    for (int p = 0; p < P; ++p) issue(p, p);
    pdl_wait();
    float acc[NT][4] = {};
    for (int j0 = 0; j0 < n; j0 += P) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            int j = j0 + p;
            if (j < n) {
                int s = (lo + j) % steps;
#pragma unroll
                for (int i = 0; i < PC; ++i) {
                    uint4 r0 = buf[p][0][i], r1 = buf[p][1][i];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        uint4 b = ldg_l1(X + (size_t)nt * 8 * sh.k * 2 + (size_t)s * KB * 2 + 16 * t + 64 * i);
                        mma16816(acc[nt], r0.x, r1.x, r0.y, r1.y, b.x, b.y);
                        mma16816(acc[nt], r0.z, r1.z, r0.w, r1.w, b.z, b.w);
                    }
                }
            }
            issue(p, j + P);
        }
    }
    float a = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) a += acc[nt][0] + acc[nt][1] + acc[nt][2] + acc[nt][3];
    out[(size_t)blockIdx.x * 32 * WARPS + threadIdx.x] = a;
}

// ---------------------------------------------------------------- host
static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;

static CUtensorMap make_map(const void* base, Shape sh, int box_rows) {
    CUtensorMap m;
    cuuint64_t dims[2] = {(cuuint64_t)sh.k, (cuuint64_t)sh.n};
    cuuint64_t strides[1] = {(cuuint64_t)sh.k * 2};
    cuuint32_t box[2] = {64, (cuuint32_t)box_rows}, es[2] = {1, 1};
    CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, es,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { fprintf(stderr, "tensor map: %d\n", (int)r); exit(1); }
    return m;
}

template <typename F>
static float time_graph(cudaStream_t st, int copies, F launch) {
    const int calls = 32, reps = 60;
    for (int i = 0; i < copies; ++i) launch(i);
    CK(cudaStreamSynchronize(st));
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < calls; ++i) launch(i % copies);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(a, st)); CK(cudaGraphLaunch(ge, st)); CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms * 1e3f / calls);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    return t[t.size() / 2];
}

template <typename K, typename... A>
static void launch_pdl(cudaStream_t st, K kern, int grid, int block, int smem, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid); cfg.blockDim = dim3(block); cfg.dynamicSmemBytes = smem; cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kern, args...));
}

struct Ctx {
    cudaStream_t st; int sms; float bw; Shape sh; int copies; std::vector<__nv_bfloat16*> w; float* out;
    double bytes() const { return (double)sh.n * sh.k * 2; }
    void report(const char* what, float us) const {
        double floor_us = bytes() / bw * 1e6;
        printf("%-6d %-6d %-28s %8.2f us  floor %6.2f  %5.1f %%\n", sh.n, sh.k, what, us, floor_us, 100 * floor_us / us);
        fflush(stdout);
    }
};

template <int R, int C, int S>
static void run_cpasync(Ctx& c, int grid) {
    constexpr int smem = S * R * (C * 2 + 16);
    auto k = k_cpasync<R, C, S>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    float us = time_graph(c.st, c.copies, [&](int i) { launch_pdl(c.st, k, grid, 128, smem, (const __nv_bfloat16*)c.w[i], c.sh, c.out); });
    char name[64]; snprintf(name, 64, "cpasync R%d C%d S%d G%d", R, C, S, grid); c.report(name, us);
}

template <int R, int C, int S, bool TMA, int MX = 0>
static void run_bulk(Ctx& c, int grid, std::vector<CUtensorMap>* maps, const CUtensorMap* xmap = nullptr) {
    constexpr int smem = S * (R * (TMA ? C * 2 : C * 2 + 16) + MX * C * 2) + 1024;
    if (smem > 227 * 1024) return;
    auto k = k_bulk<R, C, S, TMA, MX>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CUtensorMap dummy; memset(&dummy, 0, sizeof dummy);
    float us = time_graph(c.st, c.copies, [&](int i) {
        launch_pdl(c.st, k, grid, 160, smem, (const __nv_bfloat16*)c.w[i], c.sh, c.out, TMA ? (*maps)[i] : dummy,
                   MX ? *xmap : dummy);
    });
    char name[64]; snprintf(name, 64, "%s R%d C%d S%d G%d X%d", TMA ? "tma" : "bulk", R, C, S, grid, MX);
    c.report(name, us);
}

template <int U, bool WAIT_FIRST = false>
static void run_ldg(Ctx& c, int grid) {
    size_t pieces = (size_t)c.sh.n * c.sh.k * 2 / 16;
    float us = time_graph(c.st, c.copies, [&](int i) { launch_pdl(c.st, k_ldg<U, WAIT_FIRST>, grid, 256, 0, (const uint4*)c.w[i], pieces, c.out); });
    char name[64]; snprintf(name, 64, "ldg U%d G%d%s", U, grid, WAIT_FIRST ? " wait-first" : ""); c.report(name, us);
}


template <int WARPS, int KB, int P, int MINB>
static void run_frag(Ctx& c, int grid, const __nv_bfloat16* x) {
    auto k = k_frag<WARPS, KB, P, MINB>;
    float us = time_graph(c.st, c.copies, [&](int i) { launch_pdl(c.st, k, grid, 32 * WARPS, 0, (const __nv_bfloat16*)c.w[i], x, c.sh, c.out); });
    char name[64]; snprintf(name, 64, "frag W%d KB%d P%d G%d", WARPS, KB, P, grid); c.report(name, us);
}


template <int WARPS, int P, int MINB, int NT = 1>
static void run_packed(Ctx& c, int grid, const __nv_bfloat16* x) {
    auto k = k_frag<WARPS, 64, P, MINB, NT, true>;
    float us = time_graph(c.st, c.copies, [&](int i) { launch_pdl(c.st, k, grid, 32 * WARPS, 0, (const __nv_bfloat16*)c.w[i], x, c.sh, c.out); });
    char name[64]; snprintf(name, 64, "packed W%d P%d G%d M%d", WARPS, P, grid, 8 * NT); c.report(name, us);
}

int main(int argc, char** argv) {
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", (void**)&encode, cudaEnableDefault, &q));
    Ctx c; CK(cudaStreamCreateWithFlags(&c.st, cudaStreamNonBlocking));
    cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, 0)); c.sms = p.multiProcessorCount;
    printf("device %s, %d SMs\n", p.name, c.sms);
    {   // read bandwidth: ldg over 4 GiB
        size_t bytes = 4ull << 30; void* big; CK(cudaMalloc(&big, bytes)); CK(cudaMemset(big, 1, bytes));
        CK(cudaMalloc(&c.out, 1 << 24));
        std::vector<__nv_bfloat16*> one{(__nv_bfloat16*)big};
        c.sh = {1, 1}; c.copies = 1;
        float us = time_graph(c.st, 1, [&](int) { launch_pdl(c.st, k_ldg<8>, c.sms * 8, 256, 0, (const uint4*)big, bytes / 16, c.out); });
        c.bw = bytes / (us * 1e-6);
        printf("read bandwidth (ldg U8, 4 GiB): %.3f TB/s\n", c.bw / 1e12);
        CK(cudaFree(big));
    }
    Shape shapes[2] = {{5120, 2048}, {6144, 4096}};
    for (Shape sh : shapes) {
        c.sh = sh;
        c.copies = std::max(2, (int)(400e6 / c.bytes()) + 1);
        c.w.clear();
        for (int i = 0; i < c.copies; ++i) {
            __nv_bfloat16* w; CK(cudaMalloc(&w, (size_t)c.bytes()));
            CK(cudaMemset(w, 0x3c, (size_t)c.bytes())); c.w.push_back(w);
        }
        std::vector<CUtensorMap> m128, m64, m32, m16;
        for (auto* w : c.w) { m128.push_back(make_map(w, sh, 128)); m64.push_back(make_map(w, sh, 64));
                              m32.push_back(make_map(w, sh, 32)); m16.push_back(make_map(w, sh, 16)); }
        const int G = c.sms;
        __nv_bfloat16* x; CK(cudaMalloc(&x, (size_t)64 * sh.k * 2)); CK(cudaMemset(x, 0x3c, (size_t)64 * sh.k * 2));
        bool all = argc > 1 && strcmp(argv[1], "all") == 0;
        run_ldg<8>(c, G * 4); run_ldg<16>(c, G * 2);
        if (all) {
            run_cpasync<128, 64, 6>(c, G); run_cpasync<128, 64, 6>(c, 2 * G);
            run_bulk<16, 1024, 6, false>(c, G, nullptr);
            run_bulk<64, 128, 4, true>(c, 2 * G, &m64); run_bulk<64, 256, 4, true>(c, G, &m64);
        }
        if (argc > 1 && strcmp(argv[1], "xn") == 0) {
            // the wgmma ring's stage also holds xn's values of every token (X rows, L2-resident, re-read by
            // every CTA): does that traffic slow the weight stream at 16 / 32 / 64 tokens? Grids: the
            // aligned grid of two CTAs per 128-row block (80 / 96) and the SM count
            Shape xs{64, sh.k};
            CUtensorMap x16 = make_map(x, xs, 16), x32 = make_map(x, xs, 32), x64 = make_map(x, xs, 64);
            for (int g : {2 * sh.n / 128, G}) {
                run_bulk<128, 64, 8, true>(c, g, &m128);
                run_bulk<128, 64, 8, true, 16>(c, g, &m128, &x16);
                run_bulk<128, 64, 8, true, 32>(c, g, &m128, &x32);
                run_bulk<128, 64, 6, true>(c, g, &m128);
                run_bulk<128, 64, 6, true, 64>(c, g, &m128, &x64);
            }
        } else if (argc > 1 && strcmp(argv[1], "units") == 0) {
            // 32 KB units (two 64-value K steps of a 128-row block per stage) against 16 KB ones at equal
            // ring bytes (~216 KB), with and without xn's 16 rows, on the aligned grids of 2 and 3 CTAs per
            // block (where they fit the SMs) and the SM count; twice, interleaved (the probe's run-to-run
            // spread is a few %: run 5's 88 % for 32 KB units on 80 CTAs against runs 6-7's 76-79 % for 16 KB)
            Shape xs{64, sh.k};
            CUtensorMap x16 = make_map(x, xs, 16);
            for (int rep = 0; rep < 2; ++rep)
                for (int g : {2 * sh.n / 128, 3 * sh.n / 128, G}) {
                    if (g > G) continue;
                    run_bulk<128, 64, 12, true, 16>(c, g, &m128, &x16);
                    run_bulk<128, 128, 6, true, 16>(c, g, &m128, &x16);
                    run_bulk<128, 64, 12, true>(c, g, &m128);
                    run_bulk<128, 128, 6, true>(c, g, &m128);
                }
        } else if (argc > 1 && strcmp(argv[1], "issuers") == 0) {
            // run 8's 32 KB units: is it the unit or the TMA producer warp? The same rings filled by cp.async
            // from every thread with a CTA barrier per unit (the streaming GEMV's way); twice, interleaved
            for (int rep = 0; rep < 2; ++rep)
                for (int g : {2 * sh.n / 128, G}) {
                    run_cpasync<128, 64, 12>(c, g);
                    run_cpasync<128, 128, 6>(c, g);
                    run_bulk<128, 64, 12, true>(c, g, &m128);
                    run_bulk<128, 128, 6, true>(c, g, &m128);
                }
        } else if (argc > 1 && strcmp(argv[1], "contig") == 0) {
            // a unit-major weight layout (each 128-row x 64-value unit one contiguous 16 KB image, as a
            // prepacked W would hold it): one 1-D bulk copy per unit against the 2-D box of today's layout
            Shape rows = c.sh;
            c.sh = {rows.n * rows.k / 8192, 8192};
            for (int g : {2 * rows.n / 128, G}) {
                run_bulk<1, 8192, 8, false>(c, g, nullptr);
                run_bulk<1, 8192, 12, false>(c, g, nullptr);
            }
            c.sh = rows;
            for (int g : {2 * rows.n / 128, G}) run_bulk<128, 64, 8, true>(c, g, &m128);
        } else if (argc > 1 && strcmp(argv[1], "few") == 0) {
            // fewer CTAs, each with a deep TMA ring (a cluster-per-head design's grid: 40 / 48 heads x 1-3
            // K splits): does the stream still reach the floor with a third of the SMs?
            for (int g : {40, 48, 66, 80, 96, 120, G}) run_bulk<64, 256, 6, true>(c, g, &m64);
            for (int g : {40, 48, 80, 96, G}) run_bulk<64, 256, 7, true>(c, g, &m64);
            for (int g : {40, 48, 80, 96, 120, G}) run_bulk<128, 128, 6, true>(c, g, &m128);
            for (int g : {40, 80}) run_bulk<128, 128, 4, true>(c, g, &m128);
                    } else if (argc > 1 && strcmp(argv[1], "wait") == 0) {
            run_ldg<8, true>(c, G * 4); run_ldg<16, true>(c, G * 2); run_ldg<8, true>(c, G * 8);
            run_frag<8, 64, 4, 2>(c, 2 * G, x); run_packed<8, 2, 4>(c, 4 * G, x);
        } else if (argc > 1 && strcmp(argv[1], "packed") == 0) {
            run_packed<8, 4, 2>(c, 2 * G, x); run_packed<8, 3, 2>(c, 2 * G, x); run_packed<8, 2, 4>(c, 4 * G, x);
            run_packed<8, 4, 1>(c, G, x); run_packed<8, 8, 1>(c, G, x); run_packed<16, 4, 1>(c, G, x);
            run_packed<8, 6, 2>(c, 2 * G, x); run_packed<4, 4, 4>(c, 4 * G, x);
            run_packed<8, 4, 2, 2>(c, 2 * G, x); run_packed<8, 2, 2, 4>(c, 2 * G, x); run_packed<8, 4, 1, 4>(c, G, x);
            run_packed<8, 2, 2, 8>(c, 2 * G, x); run_packed<8, 4, 1, 8>(c, G, x);
            run_frag<8, 64, 4, 2>(c, 2 * G, x);
        } else {
        run_frag<8, 64, 4, 2>(c, 2 * G, x);     // 128-row blocks, 4 units in flight, 2 CTAs / SM
        run_frag<8, 64, 4, 2>(c, G, x);
        run_frag<8, 64, 8, 1>(c, G, x);
        run_frag<16, 64, 4, 1>(c, G, x);        // 256-row blocks
        run_frag<8, 128, 2, 2>(c, 2 * G, x);    // 256 B per row per unit
        run_frag<8, 128, 4, 1>(c, G, x);
        run_frag<8, 128, 4, 2>(c, 2 * G, x);
        run_frag<4, 64, 4, 4>(c, 4 * G, x);     // 64-row blocks, 4 CTAs / SM
        run_frag<4, 128, 4, 4>(c, 4 * G, x);
        run_frag<8, 64, 6, 2>(c, 2 * G, x);
        run_frag<8, 64, 2, 4>(c, 4 * G, x);
        run_frag<16, 64, 2, 2>(c, 2 * G, x);
        }
        CK(cudaFree(x));
        for (auto* w : c.w) CK(cudaFree(w));
    }
    return 0;
}
