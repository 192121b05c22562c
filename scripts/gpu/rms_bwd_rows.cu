// How many warps should share a row in the RMSNorm backward? A CUDA C stand-in for the bf16
// llama backward (in place, dW partial rows in shared memory, then the 32 × 32 dW reduction as
// a programmatic dependent launch), timed like `cargo bench`: PERFORMANCE.md, tenth session.
// CUDA C on purpose: it runs on the device machine, which has nvcc and no Rust.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/rows scripts/gpu/rms_bwd_rows.cu && /tmp/rows
//
// Variants (16-byte vectors of 8 bf16, K per thread and row):
//   block K   one row per 256-thread block at a time, the row's sum through two block barriers
//             (the `_vs{K}` kernels' shape before the tenth session, which left them one)
//   group K G a block of 8 warps runs 8/G rows at once, G warps per row: the row's sum by warp
//             shuffles, and for G > 1 one named barrier (`bar.sync 1 + group, 32·G`) over a
//             double-buffered slot, so rows of the same block do not wait for each other; each
//             group keeps its own dW row in shared memory, summed in group order at the end.
// Every variant is checked against `block` before it is timed (dx to 2 bf16 ulps, which a row's
// sum added in another order may move; dW to 1 %).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
#include <vector>

#include "rms_standin.cuh"

// Thread `t` of `n` owns vectors t, t + n, … of the row. Loads dy, x, w; forms m = D(dy·w), the
// dot Σ m·x·r (returned) and adds dy·D(x·r) into its dW slots.
template <int K>
__device__ __forceinline__ float row_pre(const uint4* dyr, const uint4* xr, const uint4* w, int t,
                                         int n, int vecs, float r, uint4 xv[K], uint4 m[K],
                                         float* dws) {
  uint4 g[K], wv[K];
#pragma unroll
  for (int k = 0; k < K; k++) {
    int j = t + k * n;
    g[k] = xv[k] = wv[k] = make_uint4(0, 0, 0, 0);
    if (j < vecs) {
      g[k] = dyr[j];
      xv[k] = xr[j];
      wv[k] = __ldg(w + j);
    }
  }
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < K; k++) {
    int j = t + k * n;
    m[k] = mul8(g[k], wv[k]);
    if (j < vecs) {
      float mf[8], gf[8], xf[8];
      unpack8(m[k], mf);
      unpack8(g[k], gf);
      unpack8(xv[k], xf);
      float4* s = reinterpret_cast<float4*>(dws + j * 8);
      float4 lo = s[0], hi = s[1];
      float d[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int i = 0; i < 8; i++) {
        float h = xf[i] * r;
        acc = fmaf(mf[i], h, acc);
        d[i] = fmaf(gf[i], bround(h), d[i]);
      }
      s[0] = make_float4(d[0], d[1], d[2], d[3]);
      s[1] = make_float4(d[4], d[5], d[6], d[7]);
    }
  }
  return acc;
}

template <int K>
__device__ __forceinline__ void row_post(uint4* dxr, int t, int n, int vecs, float r, float mean,
                                         const uint4 xv[K], const uint4 m[K]) {
#pragma unroll
  for (int k = 0; k < K; k++) {
    int j = t + k * n;
    if (j < vecs) {
      float mf[8], xf[8], o[8];
      unpack8(m[k], mf);
      unpack8(xv[k], xf);
#pragma unroll
      for (int i = 0; i < 8; i++) o[i] = r * fmaf(-mean, xf[i] * r, mf[i]);
      dxr[j] = pack8(o);
    }
  }
}

__device__ __forceinline__ void zero_own(float* dws, int t, int n, int vecs) {
  for (int j = t; j < vecs; j += n) {
    float4* s = reinterpret_cast<float4*>(dws + j * 8);
    s[0] = s[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

template <int K>
__global__ void __launch_bounds__(256) bwd_block(const uint4* dy, const uint4* x, const uint4* w,
                                                 const float* rstd, uint4* dx, float* part,
                                                 int rows, int vecs) {
  extern __shared__ float sm[];
  float* red = sm;
  float* dws = sm + 64;
  const int t = threadIdx.x, n = blockDim.x, lane = t & 31, warp = t >> 5;
  const int cols = vecs * 8;
  zero_own(dws, t, n, vecs);
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    uint4 xv[K], m[K];
    const float r = rstd[row];
    float acc = row_pre<K>(dy + (size_t)row * vecs, x + (size_t)row * vecs, w, t, n, vecs, r, xv,
                           m, dws);
    acc = warp_sum(acc);
    __syncthreads();
    if (lane == 0) red[warp] = acc;
    __syncthreads();
    const float mean = warp_sum(lane < (n >> 5) ? red[lane] : 0.f) / cols;
    row_post<K>(dx + (size_t)row * vecs, t, n, vecs, r, mean, xv, m);
  }
  float* p = part + (size_t)blockIdx.x * cols;
  for (int c = t; c < cols; c += n) p[c] = dws[c];
}

template <int K, int G>
__global__ void __launch_bounds__(256) bwd_group(const uint4* dy, const uint4* x, const uint4* w,
                                                 const float* rstd, uint4* dx, float* part,
                                                 int rows, int vecs) {
  constexpr int NG = 8 / G;
  extern __shared__ float sm[];
  float* red = sm;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = warp / G, gw = warp % G;
  const int t = gw * 32 + lane, n = G * 32, cols = vecs * 8;
  float* dws = sm + 64 + grp * cols;
  zero_own(dws, t, n, vecs);
  int parity = 0;
  for (int row = blockIdx.x * NG + grp; row < rows; row += gridDim.x * NG) {
    uint4 xv[K], m[K];
    const float r = rstd[row];
    float acc = row_pre<K>(dy + (size_t)row * vecs, x + (size_t)row * vecs, w, t, n, vecs, r, xv,
                           m, dws);
    acc = warp_sum(acc);
    if (G > 1) {
      float* slot = red + parity * 8 + grp * G;
      if (lane == 0) slot[gw] = acc;
      asm volatile("bar.sync %0, %1;" ::"r"(1 + grp), "r"(G * 32) : "memory");
      acc = 0.f;
#pragma unroll
      for (int i = 0; i < G; i++) acc += slot[i];
      parity ^= 1;
    }
    row_post<K>(dx + (size_t)row * vecs, t, n, vecs, r, acc / cols, xv, m);
  }
  __syncthreads();
  float* p = part + (size_t)blockIdx.x * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int g = 0; g < NG; g++) s += sm[64 + g * cols + c];
    p[c] = s;
  }
}

using Kernel = void (*)(const uint4*, const uint4*, const uint4*, const float*, uint4*, float*,
                        int, int);

struct Bufs {
  uint4 *dy, *dy0, *x, *w;
  float *rstd, *part;
  __nv_bfloat16* dw;
};

struct Run {
  Kernel k;
  int grid;
  size_t smem;
  int parts;
};

static void launch(const Bufs& b, const Run& r, int rows, int vecs, bool with_reduce) {
  r.k<<<r.grid, 256, r.smem>>>(b.dy, b.x, b.w, b.rstd, b.dy, b.part, rows, vecs);
  if (!with_reduce) return;
  launch_dw_reduce(b.part, r.parts, vecs * 8, b.dw);
}

static Run plan(Kernel k, int rows_per_block, int rows, int cols, int groups, int sms) {
  const size_t smem = (64 + (size_t)groups * cols) * sizeof(float);
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 256, smem));
  int grid = std::min(sms * per_sm, (rows + rows_per_block - 1) / rows_per_block);
  return Run{k, grid, smem, grid};
}

int main() {
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int rows = 16384, max_cols = 8192;
  const size_t max_n = (size_t)rows * max_cols;
  Bufs b;
  CHECK(cudaMalloc(&b.dy, max_n * 2));
  CHECK(cudaMalloc(&b.dy0, max_n * 2));
  CHECK(cudaMalloc(&b.x, max_n * 2));
  CHECK(cudaMalloc(&b.w, max_cols * 2));
  CHECK(cudaMalloc(&b.rstd, rows * 4));
  CHECK(cudaMalloc(&b.part, (size_t)sms * 8 * max_cols * 4));
  CHECK(cudaMalloc(&b.dw, max_cols * 2));
  unsigned seed = 12345;
  std::printf("copy GB/s (1 GiB) and per variant: bwd + dW reduction µs, backward alone µs, "
              "GB/s on 3·rows·cols·2 bytes, grid\n");
  std::printf("copy %.0f GB/s\n", copy_gbps());
  for (int cols : {2048, 4096, 8192}) {
    const int vecs = cols / 8;
    const size_t n = (size_t)rows * cols;
    upload_inputs(seed, rows, cols, b.x, b.dy0, b.w, b.rstd);
    struct V {
      const char* name;
      Run run;
    };
    std::vector<V> vs;
    if (cols == 2048) {
      vs.push_back({"block K=1", plan(bwd_block<1>, 1, rows, cols, 1, sms)});
      vs.push_back({"group K=8 G=1", plan(bwd_group<8, 1>, 8, rows, cols, 8, sms)});
      vs.push_back({"group K=4 G=2", plan(bwd_group<4, 2>, 4, rows, cols, 4, sms)});
      vs.push_back({"group K=2 G=4", plan(bwd_group<2, 4>, 2, rows, cols, 2, sms)});
      vs.push_back({"group K=1 G=8", plan(bwd_group<1, 8>, 1, rows, cols, 1, sms)});
    } else if (cols == 4096) {
      vs.push_back({"block K=2", plan(bwd_block<2>, 1, rows, cols, 1, sms)});
      vs.push_back({"group K=8 G=2", plan(bwd_group<8, 2>, 4, rows, cols, 4, sms)});
      vs.push_back({"group K=4 G=4", plan(bwd_group<4, 4>, 2, rows, cols, 2, sms)});
      vs.push_back({"group K=2 G=8", plan(bwd_group<2, 8>, 1, rows, cols, 1, sms)});
    } else {
      vs.push_back({"block K=4", plan(bwd_block<4>, 1, rows, cols, 1, sms)});
      vs.push_back({"group K=8 G=4", plan(bwd_group<8, 4>, 2, rows, cols, 2, sms)});
      vs.push_back({"group K=4 G=8", plan(bwd_group<4, 8>, 1, rows, cols, 1, sms)});
    }
    std::vector<unsigned short> ref_dx(n), got_dx(n);
    std::vector<unsigned short> ref_dw(cols), got_dw(cols);
    for (size_t v = 0; v < vs.size(); v++) {
      CHECK(cudaMemcpy(b.dy, b.dy0, n * 2, cudaMemcpyDeviceToDevice));
      launch(b, vs[v].run, rows, vecs, true);
      CHECK(cudaDeviceSynchronize());
      auto& dx = v == 0 ? ref_dx : got_dx;
      auto& dw = v == 0 ? ref_dw : got_dw;
      CHECK(cudaMemcpy(dx.data(), b.dy, n * 2, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(dw.data(), b.dw, cols * 2, cudaMemcpyDeviceToHost));
      // dx may differ in its last bit where a row's sum is added in another order; anything
      // beyond 2 bf16 ulps (relative 2⁻⁷) or a dW beyond 1 % is a real difference.
      const char* ok = "ok";
      if (v > 0) {
        auto f = [](unsigned short b) {
          __nv_bfloat16 h;
          std::memcpy(&h, &b, 2);
          return (double)__bfloat162float(h);
        };
        size_t differ = 0;
        double worst_dx = 0, worst_dw = 0;
        for (size_t i = 0; i < n; i++) {
          if (ref_dx[i] == got_dx[i]) continue;
          differ++;
          const double a = f(ref_dx[i]), g = f(got_dx[i]);
          worst_dx = std::max(worst_dx, std::fabs(a - g) / std::max(1e-3, std::fabs(a)));
        }
        for (int c = 0; c < cols; c++) {
          const double a = f(ref_dw[c]), g = f(got_dw[c]);
          worst_dw = std::max(worst_dw, std::fabs(a - g) / std::max(1.0, std::fabs(a)));
        }
        if (worst_dx > 1.0 / 64 || worst_dw > 1e-2) ok = "MISMATCH";
        std::printf("  %zu dx differ from `block` (worst %.3g relative), dW worst %.3g\n", differ,
                    worst_dx, worst_dw);
      }
      const double both = median_us([&] { launch(b, vs[v].run, rows, vecs, true); });
      const double alone = median_us([&] { launch(b, vs[v].run, rows, vecs, false); });
      std::printf("%5d %-14s %7.1f %7.1f %6.0f GB/s  grid %4d  %s\n", cols, vs[v].name, both,
                  alone, 3.0 * n * 2 / both / 1e3, vs[v].run.grid, ok);
    }
  }
  return 0;
}
