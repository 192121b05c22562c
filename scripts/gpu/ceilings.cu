// What plain streaming kernels reach on the access pattern and byte count of the `cargo bench`
// rows nearest to or below 90 % of the 1 GiB copy: the ceiling those rows are measured against
// (PERFORMANCE.md, "Bytes moved and ceilings"; BENCHMARKS.md, "Ceilings"). CUDA C on purpose:
// it needs nvcc and no Rust, so it runs on a GPU machine without a Rust toolchain.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/ceilings scripts/gpu/ceilings.cu && /tmp/ceilings
//
// Patterns (the minimum bytes of each op as in the bench):
//   copy  cudaMemcpyAsync device to device (the bench's copy)
//   1r1w  y = f(x)                  (RMSNorm forward: read x, write y)
//   2r1w  a = f(a, b), in place     (RMSNorm backward in place: read dy and x, write dx over dy)
//   rmw   a = f(a), in place        (RoPE: q and k rotated in place)
// Each kernel runs with 1, 2 or 4 16-byte vectors or 1 or 2 8-byte vectors per thread, as a
// whole grid (one pass) or as a resident grid-stride loop; the best of the ten is the
// pattern's ceiling, printed with the best of each width. Timing as the bench:
// 10 warm-up calls, then 100 calls each between its own pair of events, median; the same
// buffers every call (no rotation), like the bench.
#include <algorithm>
#include <cstdio>
#include <cuda_runtime.h>
#include <string>
#include <vector>

#include "timing.cuh"

__device__ __forceinline__ int4 flip(int4 v) {  // sign flip of every 16-bit lane: a real write
  const int m = 0x80008000;
  return make_int4(v.x ^ m, v.y ^ m, v.z ^ m, v.w ^ m);
}
__device__ __forceinline__ int4 mix(int4 a, int4 b) {
  return make_int4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
}
__device__ __forceinline__ int2 flip(int2 v) {
  const int m = 0x80008000;
  return make_int2(v.x ^ m, v.y ^ m);
}
__device__ __forceinline__ int2 mix(int2 a, int2 b) { return make_int2(a.x ^ b.x, a.y ^ b.y); }

// PAT 0: o = flip(a) (1r1w), 1: a = mix(a, b) (2r1w), 2: a = flip(a) (rmw); U vectors of type
// V (int4: 16 bytes, int2: 8 bytes) per thread per step.
template <int PAT, int U, class V>
__global__ void __launch_bounds__(256) stream(V* __restrict__ a, const V* __restrict__ b,
                                               V* __restrict__ o, size_t n) {
  const size_t step = (size_t)gridDim.x * blockDim.x * U;
  for (size_t base = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x; base < n; base += step) {
    V va[U], vb[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      size_t j = base + (size_t)u * blockDim.x;
      if (j < n) {
        va[u] = a[j];
        if (PAT == 1) vb[u] = b[j];
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      size_t j = base + (size_t)u * blockDim.x;
      if (j < n) {
        if (PAT == 0) o[j] = flip(va[u]);
        if (PAT == 1) a[j] = mix(va[u], vb[u]);
        if (PAT == 2) a[j] = flip(va[u]);
      }
    }
  }
}

static int4 *A, *B, *O;

// `n16`: the tensor's size in 16-byte vectors.
template <int PAT, int U, class V>
static void best_of(size_t n16, bool whole, int sms, double& best, std::string& how) {
  const size_t n = n16 * 16 / sizeof(V);
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream<PAT, U, V>, 256, 0));
  size_t grid = whole ? (n + 256 * U - 1) / (256 * U) : (size_t)sms * per_sm;
  double us = median_us(
      [&] { stream<PAT, U, V><<<(unsigned)grid, 256>>>((V*)A, (const V*)B, (V*)O, n); });
  CHECK(cudaGetLastError());
  if (best == 0 || us < best) {
    best = us;
    how = std::string(whole ? "whole grid" : "grid-stride") + " U=" + std::to_string(U) + " x " +
          std::to_string(sizeof(V)) + " B";
  }
}

// The best of the pattern's kernels with 16-byte (`wide`) or 8-byte vectors.
template <int PAT>
static double ceiling_us(size_t n16, int sms, bool wide, std::string& how) {
  double best = 0;
  for (bool whole : {false, true}) {
    if (wide) {
      best_of<PAT, 1, int4>(n16, whole, sms, best, how);
      best_of<PAT, 2, int4>(n16, whole, sms, best, how);
      best_of<PAT, 4, int4>(n16, whole, sms, best, how);
    } else {
      best_of<PAT, 1, int2>(n16, whole, sms, best, how);
      best_of<PAT, 2, int2>(n16, whole, sms, best, how);
    }
  }
  return best;
}

struct Case {
  const char* op;
  const char* shape;
  const char* dtype;
  int pat;          // 0 1r1w, 1 2r1w, 2 rmw
  size_t elems;     // elements per tensor
  size_t size;      // bytes per element
};

int main() {
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const size_t big = size_t(1) << 30;
  CHECK(cudaMalloc(&A, big));
  CHECK(cudaMalloc(&B, big));
  CHECK(cudaMalloc(&O, big));
  CHECK(cudaMemset(A, 1, big));
  CHECK(cudaMemset(B, 2, big));
  CHECK(cudaMemset(O, 3, big));
  const double copy_1g = 2.0 * big / median_us([&] {
    CHECK(cudaMemcpyAsync(O, A, big, cudaMemcpyDeviceToDevice));
  }) / 1e3;
  std::printf("device-to-device copy, 1 GiB: %.0f GB/s\n", copy_1g);
  const size_t rope = size_t(4) * 4096 * (32 + 8) * 128;
  const Case cases[] = {
      {"rms_norm_fwd", "16384x2048", "bf16", 0, 16384u * 2048u, 2},
      {"rms_norm_fwd", "16384x4096", "bf16", 0, 16384u * 4096u, 2},
      {"rms_norm_fwd", "16384x2048", "f32", 0, 16384u * 2048u, 4},
      {"rms_norm_bwd", "16384x2048", "bf16", 1, 16384u * 2048u, 2},
      {"rms_norm_bwd", "16384x4096", "bf16", 1, 16384u * 4096u, 2},
      {"rms_norm_bwd", "16384x2048", "f32", 1, 16384u * 2048u, 4},
      {"rope_fwd", "4x4096x32/8x128", "bf16", 2, rope, 2},
      {"rope_fwd", "4x4096x32/8x128", "f32", 2, rope, 4},
  };
  std::printf("%-13s %-16s %-5s %-5s %9s %9s %9s %7s %7s %7s  %s / %s\n", "op", "shape",
              "dtype", "pat", "MB moved", "copy GB/s", "best GB/s", "%copy1G", "%copy1G",
              "%copy1G", "best 16 B kernel", "best 8 B kernel");
  std::printf("%-13s %-16s %-5s %-5s %9s %9s %9s %7s %7s %7s\n", "", "", "", "", "", "(same)",
              "(pattern)", "(same)", "(16 B)", "(8 B)");
  for (const Case& c : cases) {
    const size_t tensor = c.elems * c.size;   // bytes of one tensor
    const size_t n = tensor / 16;             // 16-byte vectors per tensor
    const double moved = c.pat == 1 ? 3.0 * tensor : 2.0 * tensor;
    const double copy_us = median_us([&] {
      CHECK(cudaMemcpyAsync(O, A, (size_t)(moved / 2), cudaMemcpyDeviceToDevice));
    });
    std::string how[2];
    double us[2];
    for (int w = 0; w < 2; w++)
      us[w] = c.pat == 0   ? ceiling_us<0>(n, sms, w == 0, how[w])
              : c.pat == 1 ? ceiling_us<1>(n, sms, w == 0, how[w])
                           : ceiling_us<2>(n, sms, w == 0, how[w]);
    const double copy_gbps = moved / copy_us / 1e3;
    const double best_gbps = moved / std::min(us[0], us[1]) / 1e3;
    static const char* pats[] = {"1r1w", "2r1w", "rmw"};
    std::printf("%-13s %-16s %-5s %-5s %9.1f %9.0f %9.0f %6.1f%% %6.1f%% %6.1f%%  %s / %s\n",
                c.op, c.shape, c.dtype, pats[c.pat], moved / 1e6, copy_gbps, best_gbps,
                100.0 * copy_gbps / copy_1g, 100.0 * moved / us[0] / 1e3 / copy_1g,
                100.0 * moved / us[1] / 1e3 / copy_1g, how[0].c_str(), how[1].c_str());
  }
  return 0;
}
