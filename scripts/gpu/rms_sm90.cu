// Two sm_90 features for the RMSNorm kernels, each in a CUDA C stand-in for the bf16 llama
// kernels (backward in place with the 32 × 32 dW reduction as a programmatic dependent launch;
// forward), timed like `cargo bench`: PERFORMANCE.md, thirteenth session. CUDA C on purpose: it
// runs on the device machine, which has nvcc and no Rust.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/sm90 scripts/gpu/rms_sm90.cu && /tmp/sm90 bulk|cluster [rounds]
//
// bulk: would the kernels keep more bytes in flight if a row's operands came into shared memory
// through the bulk copy engine (`cp.async.bulk`, completing on an `mbarrier`), several rows
// ahead, instead of through each thread's registers?
// cluster: would the backward's dW reduction get shorter if the blocks of a thread-block
// cluster merged their partial rows through distributed shared memory first (one partial row
// per cluster instead of one per block)?
//
// Variants (16-byte vectors of 8 bf16; thread t of n owns vectors t, t + n, … of every row):
//   direct K n   the shipped shapes: backward `_vs{K}` (one row per block at a time, loads
//                straight into registers, dW partial row in shared memory, one barrier per
//                row), forward `_vr{K}` (one row per block, a grid of every row)
//   bulk K n S   a resident grid; thread 0 keeps the block's next S rows in flight as bulk
//                copies into S shared-memory stages (dy and x; x alone in the forward), each
//                stage refilled right after the barrier that ends its row's reads; dW in
//                registers; `b/SM` caps the resident blocks per SM
//   cluster K n C  `direct` in clusters of C blocks: after its rows each block waits at the
//                cluster barrier, block r of the cluster sums column slice r of the C blocks'
//                dW rows (in rank order) into the cluster's partial row, and a second cluster
//                barrier keeps every block's shared memory alive until it has been read
// Every variant is checked against the first of its width (dx / y to 2 bf16 ulps, which a
// row's sum added in another order may move; dW to 1 %).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cooperative_groups.h>
#include <cstring>
#include <cuda_runtime.h>
#include <string>
#include <vector>

#include "rms_standin.cuh"

__device__ __forceinline__ unsigned smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(bar)) : "memory");
}
// Thread 0's arrival for one use of a stage: the phase completes once `bytes` have landed.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, "
        "p; }"
        : "=r"(done)
        : "r"(smem(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem(dst)),
      "l"(src), "r"(bytes), "r"(smem(bar))
      : "memory");
}

// Shared memory of the bulk kernels: S barriers (64 B), two slot sets of 32 warp sums (256 B),
// then S stages of `ops` rows of `vecs` vectors.
constexpr int BULK_HEAD = 64 + 256;
static size_t bulk_smem(int stages, int ops, int vecs) {
  return BULK_HEAD + (size_t)stages * ops * vecs * 16;
}

// Thread 0: the S mbarriers, then the first S rows of this block into their stages.
template <int S, int OPS>
__device__ __forceinline__ void bulk_start(uint64_t* bar, uint4* stage, const uint4* a,
                                           const uint4* b, int rows, int vecs) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; s++) mbar_init(&bar[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; s++) {
      const int row = blockIdx.x + s * gridDim.x;
      if (row < rows) {
        uint4* st = stage + (size_t)s * OPS * vecs;
        mbar_expect(&bar[s], OPS * vecs * 16);
        bulk_load(st, a + (size_t)row * vecs, vecs * 16, &bar[s]);
        if (OPS == 2) bulk_load(st + vecs, b + (size_t)row * vecs, vecs * 16, &bar[s]);
      }
    }
  }
}

// Thread 0, after the barrier that ends the reads of stage `s`: row `row` into it.
template <int OPS>
__device__ __forceinline__ void bulk_refill(uint64_t* bar, uint4* st, const uint4* a,
                                            const uint4* b, int row, int rows, int vecs) {
  if (threadIdx.x == 0 && row < rows) {
    mbar_expect(bar, OPS * vecs * 16);
    bulk_load(st, a + (size_t)row * vecs, vecs * 16, bar);
    if (OPS == 2) bulk_load(st + vecs, b + (size_t)row * vecs, vecs * 16, bar);
  }
}

// The row's sum over the block through one of two slot sets (one barrier per row).
__device__ __forceinline__ float block_sum_then(float v, float* red, int parity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) red[parity * 32 + warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int i = 0; i < nw; i++) s += red[parity * 32 + i];
  return s;
}

// dy·D(x·r) into d[], the dot Σ m·x·r returned; m = D(dy·w).
__device__ __forceinline__ float bwd_pre(uint4 g, uint4 xv, uint4 wv, float r, uint4& m,
                                         float d[8]) {
  m = mul8(g, wv);
  float mf[8], gf[8], xf[8];
  unpack8(m, mf);
  unpack8(g, gf);
  unpack8(xv, xf);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const float h = xf[i] * r;
    acc = fmaf(mf[i], h, acc);
    d[i] = fmaf(gf[i], bround(h), d[i]);
  }
  return acc;
}
__device__ __forceinline__ uint4 bwd_post(uint4 xv, uint4 m, float r, float mean) {
  float mf[8], xf[8], o[8];
  unpack8(m, mf);
  unpack8(xv, xf);
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = r * fmaf(-mean, xf[i] * r, mf[i]);
  return pack8(o);
}

template <int K, int C>
__global__ void bwd_direct(const uint4* dy, const uint4* x, const uint4* w, const float* rstd,
                           uint4* dx, float* part, int rows, int vecs) {
  extern __shared__ __align__(16) float sm[];
  float* red = sm;
  float* dws = sm + 64;
  const int t = threadIdx.x, n = blockDim.x, cols = vecs * 8;
  for (int j = t; j < vecs; j += n) {
    float4* s = reinterpret_cast<float4*>(dws + j * 8);
    s[0] = s[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  int parity = 0;
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    uint4 g[K], xv[K], wv[K], m[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int j = t + k * n;
      g[k] = xv[k] = wv[k] = make_uint4(0, 0, 0, 0);
      if (j < vecs) {
        g[k] = dy[(size_t)row * vecs + j];
        xv[k] = x[(size_t)row * vecs + j];
        wv[k] = __ldg(w + j);
      }
    }
    const float r = rstd[row];
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int j = t + k * n;
      if (j < vecs) {
        float4* s = reinterpret_cast<float4*>(dws + j * 8);
        float4 lo = s[0], hi = s[1];
        float d[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        acc += bwd_pre(g[k], xv[k], wv[k], r, m[k], d);
        s[0] = make_float4(d[0], d[1], d[2], d[3]);
        s[1] = make_float4(d[4], d[5], d[6], d[7]);
      }
    }
    const float mean = block_sum_then(acc, red, parity) / cols;
    parity ^= 1;
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int j = t + k * n;
      if (j < vecs) dx[(size_t)row * vecs + j] = bwd_post(xv[k], m[k], r, mean);
    }
  }
  if (C == 1) {
    __syncthreads();
    float* p = part + (size_t)blockIdx.x * cols;
    for (int c = t; c < cols; c += n) p[c] = dws[c];
    return;
  }
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int slice = cols / C, rank = (int)cluster.block_rank();
  float* p = part + (size_t)(blockIdx.x / C) * cols;
  for (int c = rank * slice + 4 * t; c < (rank + 1) * slice; c += 4 * n) {
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int q = 0; q < C; q++) {
      const float4 v = *reinterpret_cast<const float4*>(cluster.map_shared_rank(dws, q) + c);
      s.x += v.x;
      s.y += v.y;
      s.z += v.z;
      s.w += v.w;
    }
    *reinterpret_cast<float4*>(p + c) = s;
  }
  cluster.sync();
}

template <int K, int S>
__global__ void bwd_bulk(const uint4* dy, const uint4* x, const uint4* w, const float* rstd,
                         uint4* dx, float* part, int rows, int vecs) {
  extern __shared__ __align__(128) unsigned char raw[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(raw);
  float* red = reinterpret_cast<float*>(raw + 64);
  uint4* stage = reinterpret_cast<uint4*>(raw + BULK_HEAD);
  const int t = threadIdx.x, n = blockDim.x, cols = vecs * 8;
  bulk_start<S, 2>(bar, stage, dy, x, rows, vecs);
  float d[K][8] = {};
  int parity = 0, i = 0;
  for (int row = blockIdx.x; row < rows; row += gridDim.x, i++) {
    const int s = i % S;
    uint4* st = stage + (size_t)s * 2 * vecs;
    const float r = rstd[row];
    uint4 xv[K], m[K];
    mbar_wait(&bar[s], (i / S) & 1);
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int j = t + k * n;
      if (j < vecs) {
        xv[k] = st[vecs + j];
        acc += bwd_pre(st[j], xv[k], __ldg(w + j), r, m[k], d[k]);
      }
    }
    const float mean = block_sum_then(acc, red, parity) / cols;
    parity ^= 1;
    bulk_refill<2>(&bar[s], st, dy, x, row + S * gridDim.x, rows, vecs);
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int j = t + k * n;
      if (j < vecs) dx[(size_t)row * vecs + j] = bwd_post(xv[k], m[k], r, mean);
    }
  }
  float4* p = reinterpret_cast<float4*>(part + (size_t)blockIdx.x * cols);
#pragma unroll
  for (int k = 0; k < K; k++) {
    const int j = t + k * n;
    if (j < vecs) {
      p[2 * j] = make_float4(d[k][0], d[k][1], d[k][2], d[k][3]);
      p[2 * j + 1] = make_float4(d[k][4], d[k][5], d[k][6], d[k][7]);
    }
  }
}

// y = D(D(x·r)·w), rstd written; the row's sum of squares in f32.
__device__ __forceinline__ float sumsq8(uint4 v) {
  float f[8], s = 0.f;
  unpack8(v, f);
#pragma unroll
  for (int i = 0; i < 8; i++) s = fmaf(f[i], f[i], s);
  return s;
}
__device__ __forceinline__ uint4 fwd_out(uint4 xv, uint4 wv, float r) {
  float f[8];
  unpack8(xv, f);
#pragma unroll
  for (int i = 0; i < 8; i++) f[i] *= r;
  return mul8(pack8(f), wv);
}

template <int K>
__global__ void fwd_direct(const uint4* x, const uint4* w, uint4* y, float* rstd, int rows,
                           int vecs) {
  __shared__ float red[64];
  const int t = threadIdx.x, n = blockDim.x, cols = vecs * 8, row = blockIdx.x;
  uint4 xv[K];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < K; k++) {
    const int j = t + k * n;
    xv[k] = make_uint4(0, 0, 0, 0);
    if (j < vecs) xv[k] = x[(size_t)row * vecs + j];
    ss += sumsq8(xv[k]);
  }
  const float r = rsqrtf(block_sum_then(ss, red, 0) / cols + 1e-6f);
  if (t == 0) rstd[row] = r;
#pragma unroll
  for (int k = 0; k < K; k++) {
    const int j = t + k * n;
    if (j < vecs) y[(size_t)row * vecs + j] = fwd_out(xv[k], __ldg(w + j), r);
  }
}

template <int K, int S>
__global__ void fwd_bulk(const uint4* x, const uint4* w, uint4* y, float* rstd, int rows,
                         int vecs) {
  extern __shared__ __align__(128) unsigned char raw[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(raw);
  float* red = reinterpret_cast<float*>(raw + 64);
  uint4* stage = reinterpret_cast<uint4*>(raw + BULK_HEAD);
  const int t = threadIdx.x, n = blockDim.x, cols = vecs * 8;
  bulk_start<S, 1>(bar, stage, x, nullptr, rows, vecs);
  int parity = 0, i = 0;
  for (int row = blockIdx.x; row < rows; row += gridDim.x, i++) {
    const int s = i % S;
    uint4* st = stage + (size_t)s * vecs;
    uint4 xv[K];
    mbar_wait(&bar[s], (i / S) & 1);
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int j = t + k * n;
      xv[k] = make_uint4(0, 0, 0, 0);
      if (j < vecs) xv[k] = st[j];
      ss += sumsq8(xv[k]);
    }
    const float r = rsqrtf(block_sum_then(ss, red, parity) / cols + 1e-6f);
    parity ^= 1;
    bulk_refill<1>(&bar[s], st, x, nullptr, row + S * gridDim.x, rows, vecs);
    if (t == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < K; k++) {
      const int j = t + k * n;
      if (j < vecs) y[(size_t)row * vecs + j] = fwd_out(xv[k], __ldg(w + j), r);
    }
  }
}

using Bwd = void (*)(const uint4*, const uint4*, const uint4*, const float*, uint4*, float*, int,
                     int);
using Fwd = void (*)(const uint4*, const uint4*, uint4*, float*, int, int);

struct Bufs {
  uint4 *dy, *dy0, *x, *w, *y;
  float *rstd, *part;
  __nv_bfloat16* dw;
};

struct Run {
  const char* name;
  const void* k;
  int threads, grid, per_sm;
  size_t smem;
  int cluster = 1;
};

static int SMS = 0;

// A resident grid (whole device, at most `cap` blocks per SM) or, with `whole`, one block per row.
static Run plan(const char* name, const void* k, int threads, size_t smem, int rows, int cap,
                bool whole) {
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, threads, smem));
  per_sm = std::min(per_sm, cap);
  const int grid = whole ? rows : std::min(SMS * per_sm, rows);
  return Run{name, k, threads, grid, per_sm, smem};
}

// `direct` in clusters of `c`: as many whole clusters as can be resident at once.
static Run plan_cluster(const char* name, const void* k, int threads, size_t smem, int rows,
                        int c) {
  Run r = plan(name, k, threads, smem, rows, 16, false);
  if (c > 8) CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(r.grid / c * c);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = c;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  CHECK(cudaOccupancyMaxActiveClusters(&clusters, k, &cfg));
  r.grid = std::min(clusters * c, r.grid / c * c);
  r.cluster = c;
  return r;
}

static void bwd(const Bufs& b, const Run& r, int rows, int vecs, bool with_reduce) {
  if (r.cluster == 1) {
    reinterpret_cast<Bwd>(r.k)<<<r.grid, r.threads, r.smem>>>(b.dy, b.x, b.w, b.rstd, b.dy,
                                                               b.part, rows, vecs);
  } else {
    cudaLaunchConfig_t cc = {};
    cc.gridDim = dim3(r.grid);
    cc.blockDim = dim3(r.threads);
    cc.dynamicSmemBytes = r.smem;
    cudaLaunchAttribute ca[1];
    ca[0].id = cudaLaunchAttributeClusterDimension;
    ca[0].val.clusterDim.x = r.cluster;
    ca[0].val.clusterDim.y = 1;
    ca[0].val.clusterDim.z = 1;
    cc.attrs = ca;
    cc.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&cc, reinterpret_cast<Bwd>(r.k), (const uint4*)b.dy,
                             (const uint4*)b.x, (const uint4*)b.w, (const float*)b.rstd, b.dy,
                             b.part, rows, vecs));
  }
  if (!with_reduce) return;
  launch_dw_reduce(b.part, r.grid / r.cluster, vecs * 8, b.dw);
}

static void fwd(const Bufs& b, const Run& r, int rows, int vecs) {
  reinterpret_cast<Fwd>(r.k)<<<r.grid, r.threads, r.smem>>>(b.x, b.w, b.y, b.rstd, rows, vecs);
}

static double bf(unsigned short v) {
  __nv_bfloat16 h;
  std::memcpy(&h, &v, 2);
  return (double)__bfloat162float(h);
}

// Largest relative difference beyond the last-bit noise of a reordered sum.
static double worst(const std::vector<unsigned short>& a, const std::vector<unsigned short>& b,
                    double floor) {
  double w = 0;
  for (size_t i = 0; i < a.size(); i++) {
    if (a[i] == b[i]) continue;
    w = std::max(w, std::fabs(bf(a[i]) - bf(b[i])) / std::max(floor, std::fabs(bf(a[i]))));
  }
  return w;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "bulk";
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 2;
  if (mode != "bulk" && mode != "cluster") {
    std::printf("usage: %s bulk|cluster [rounds]\n", argv[0]);
    return 2;
  }
  const bool bulk = mode == "bulk";
  int dev = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&SMS, cudaDevAttrMultiProcessorCount, dev));
  const int rows = 16384, max_cols = 4096;
  const size_t max_n = (size_t)rows * max_cols;
  Bufs b;
  CHECK(cudaMalloc(&b.dy, max_n * 2));
  CHECK(cudaMalloc(&b.dy0, max_n * 2));
  CHECK(cudaMalloc(&b.x, max_n * 2));
  CHECK(cudaMalloc(&b.y, max_n * 2));
  CHECK(cudaMalloc(&b.w, max_cols * 2));
  CHECK(cudaMalloc(&b.rstd, rows * 4));
  CHECK(cudaMalloc(&b.part, (size_t)SMS * 16 * max_cols * 4));
  CHECK(cudaMalloc(&b.dw, max_cols * 2));
  unsigned seed = 12345;
  std::printf("copy %.0f GB/s (1 GiB); rows %d; per variant: µs (bwd: with the dW reduction / "
              "alone), GB/s, grid, blocks per SM, shared memory per block\n",
              copy_gbps(), rows);
  for (int cols : {2048, 4096}) {
    const int vecs = cols / 8;
    const size_t n = (size_t)rows * cols;
    upload_inputs(seed, rows, cols, b.x, b.dy0, b.w, b.rstd);
    const size_t dsm = (64 + (size_t)cols) * 4;
    std::vector<Run> bw, fw;
    if (bulk) {
      if (cols == 2048) {
        bw.push_back(plan("direct K=2 n=128", (const void*)bwd_direct<2, 1>, 128, dsm, rows, 16, false));
        bw.push_back(plan("direct K=1 n=256", (const void*)bwd_direct<1, 1>, 256, dsm, rows, 16, false));
        for (int cap : {16, 6, 4}) {
          bw.push_back(plan("bulk K=2 n=128 S=2", (const void*)bwd_bulk<2, 2>, 128,
                            bulk_smem(2, 2, vecs), rows, cap, false));
          bw.push_back(plan("bulk K=2 n=128 S=3", (const void*)bwd_bulk<2, 3>, 128,
                            bulk_smem(3, 2, vecs), rows, cap, false));
          bw.push_back(plan("bulk K=2 n=128 S=4", (const void*)bwd_bulk<2, 4>, 128,
                            bulk_smem(4, 2, vecs), rows, cap, false));
        }
        bw.push_back(plan("bulk K=1 n=256 S=2", (const void*)bwd_bulk<1, 2>, 256,
                          bulk_smem(2, 2, vecs), rows, 16, false));
        bw.push_back(plan("bulk K=1 n=256 S=3", (const void*)bwd_bulk<1, 3>, 256,
                          bulk_smem(3, 2, vecs), rows, 16, false));
        bw.push_back(plan("bulk K=4 n=64 S=3", (const void*)bwd_bulk<4, 3>, 64,
                          bulk_smem(3, 2, vecs), rows, 16, false));
        fw.push_back(plan("direct K=2 n=128", (const void*)fwd_direct<2>, 128, 0, rows, 16, true));
        for (int cap : {16, 6}) {
          fw.push_back(plan("bulk K=2 n=128 S=2", (const void*)fwd_bulk<2, 2>, 128,
                            bulk_smem(2, 1, vecs), rows, cap, false));
          fw.push_back(plan("bulk K=2 n=128 S=3", (const void*)fwd_bulk<2, 3>, 128,
                            bulk_smem(3, 1, vecs), rows, cap, false));
          fw.push_back(plan("bulk K=2 n=128 S=4", (const void*)fwd_bulk<2, 4>, 128,
                            bulk_smem(4, 1, vecs), rows, cap, false));
        }
      } else {
        bw.push_back(plan("direct K=2 n=256", (const void*)bwd_direct<2, 1>, 256, dsm, rows, 16, false));
        for (int cap : {16, 4}) {
          bw.push_back(plan("bulk K=2 n=256 S=2", (const void*)bwd_bulk<2, 2>, 256,
                            bulk_smem(2, 2, vecs), rows, cap, false));
          bw.push_back(plan("bulk K=2 n=256 S=3", (const void*)bwd_bulk<2, 3>, 256,
                            bulk_smem(3, 2, vecs), rows, cap, false));
        }
        bw.push_back(plan("bulk K=4 n=128 S=2", (const void*)bwd_bulk<4, 2>, 128,
                          bulk_smem(2, 2, vecs), rows, 16, false));
        bw.push_back(plan("bulk K=4 n=128 S=3", (const void*)bwd_bulk<4, 3>, 128,
                          bulk_smem(3, 2, vecs), rows, 16, false));
        fw.push_back(plan("direct K=4 n=128", (const void*)fwd_direct<4>, 128, 0, rows, 16, true));
        fw.push_back(plan("bulk K=4 n=128 S=2", (const void*)fwd_bulk<4, 2>, 128,
                          bulk_smem(2, 1, vecs), rows, 16, false));
        fw.push_back(plan("bulk K=4 n=128 S=3", (const void*)fwd_bulk<4, 3>, 128,
                          bulk_smem(3, 1, vecs), rows, 16, false));
        fw.push_back(plan("bulk K=2 n=256 S=3", (const void*)fwd_bulk<2, 3>, 256,
                          bulk_smem(3, 1, vecs), rows, 16, false));
      }
    } else if (cols == 2048) {
      bw.push_back(plan("direct K=2 n=128", (const void*)bwd_direct<2, 1>, 128, dsm, rows, 16,
                        false));
      bw.push_back(plan("direct K=2 n=128", (const void*)bwd_direct<2, 1>, 128, dsm, rows, 8,
                        false));
      bw.push_back(plan_cluster("cluster K=2 n=128 C=2", (const void*)bwd_direct<2, 2>, 128, dsm,
                                rows, 2));
      bw.push_back(plan_cluster("cluster K=2 n=128 C=4", (const void*)bwd_direct<2, 4>, 128, dsm,
                                rows, 4));
      bw.push_back(plan_cluster("cluster K=2 n=128 C=8", (const void*)bwd_direct<2, 8>, 128, dsm,
                                rows, 8));
      bw.push_back(plan_cluster("cluster K=2 n=128 C=16", (const void*)bwd_direct<2, 16>, 128, dsm,
                                rows, 16));
    } else {
      bw.push_back(plan("direct K=2 n=256", (const void*)bwd_direct<2, 1>, 256, dsm, rows, 16,
                        false));
      bw.push_back(plan_cluster("cluster K=2 n=256 C=2", (const void*)bwd_direct<2, 2>, 256, dsm,
                                rows, 2));
      bw.push_back(plan_cluster("cluster K=2 n=256 C=4", (const void*)bwd_direct<2, 4>, 256, dsm,
                                rows, 4));
      bw.push_back(plan_cluster("cluster K=2 n=256 C=8", (const void*)bwd_direct<2, 8>, 256, dsm,
                                rows, 8));
    }
    // Checks: every variant against the first of its direction.
    std::vector<unsigned short> ref(n), got(n), ref_dw(cols), got_dw(cols);
    std::vector<const char*> bw_ok(bw.size(), "ok"), fw_ok(fw.size(), "ok");
    for (size_t v = 0; v < bw.size(); v++) {
      CHECK(cudaMemcpy(b.dy, b.dy0, n * 2, cudaMemcpyDeviceToDevice));
      CHECK(cudaMemset(b.dw, 0xff, cols * 2));
      bwd(b, bw[v], rows, vecs, true);
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy((v ? got : ref).data(), b.dy, n * 2, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy((v ? got_dw : ref_dw).data(), b.dw, cols * 2, cudaMemcpyDeviceToHost));
      if (v && (worst(ref, got, 1e-3) > 1.0 / 64 || worst(ref_dw, got_dw, 1.0) > 1e-2))
        bw_ok[v] = "MISMATCH";
    }
    for (size_t v = 0; v < fw.size(); v++) {
      CHECK(cudaMemset(b.y, 0xff, n * 2));
      fwd(b, fw[v], rows, vecs);
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy((v ? got : ref).data(), b.y, n * 2, cudaMemcpyDeviceToHost));
      if (v && worst(ref, got, 1e-3) > 1.0 / 64) fw_ok[v] = "MISMATCH";
    }
    // Timing: rounds of every variant in turn (the bench's buffers: dx over dy, no rotation).
    for (int round = 0; round < rounds; round++) {
      for (size_t v = 0; v < bw.size(); v++) {
        const double both = median_us([&] { bwd(b, bw[v], rows, vecs, true); });
        const double alone = median_us([&] { bwd(b, bw[v], rows, vecs, false); });
        std::printf("bwd %4d %-20s %6.1f / %6.1f µs %5.0f GB/s grid %4d (%2d/SM) %6zu B %s\n",
                    cols, bw[v].name, both, alone, 3.0 * n * 2 / both / 1e3, bw[v].grid,
                    bw[v].per_sm, bw[v].smem, bw_ok[v]);
      }
      for (size_t v = 0; v < fw.size(); v++) {
        const double us = median_us([&] { fwd(b, fw[v], rows, vecs); });
        std::printf("fwd %4d %-20s %6.1f µs %5.0f GB/s grid %5d (%2d/SM) %6zu B %s\n", cols,
                    fw[v].name, us, 2.0 * n * 2 / us / 1e3, fw[v].grid, fw[v].per_sm,
                    fw[v].smem, fw_ok[v]);
      }
    }
  }
  return 0;
}
