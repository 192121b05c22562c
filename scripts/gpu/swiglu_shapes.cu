// SwiGLU's memory patterns at different access widths, vectors per thread and block sizes:
// which of these decides whether a kernel reaches torch.compile's figure (PERFORMANCE.md,
// twelfth session). CUDA C on purpose: it runs on the device machine, which has nvcc and no
// Rust.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/shapes scripts/gpu/swiglu_shapes.cu && /tmp/shapes [index]
//
// Patterns: backward (read dc, a, b; write da, db) and forward (read a, b; write c). Every
// kernel runs one tile per block (a grid of every tile, as the `_vt` kernels): thread t of block
// b takes vectors b·K·THREADS + t + k·THREADS, k < K, of each operand, loads all of them, then
// computes and stores. Loads are plain `ld.global`, as ours and Triton's. MATH 1 is liger-rs's
// f32 math (ex2.approx of −|z|·log2 e, a fast 1/(1 + t), the limits at ±∞); MATH 0 stores
// plain products (the same bytes, almost no arithmetic), which also stands in for the 16-bit
// sizes (the bytes of a bf16 tensor, read as f32). Each variant's outputs are checked bit for
// bit against the first variant of its group, after poisoning. Timing as the bench
// (timing.cuh), three interleaved rounds. With `index`: the forward with liger-rs's math at
// two tile shapes, each with the three ways of finding a vector's offset below (flat, a
// division per thread, a multiply-high per thread), which prices the index arithmetic.
#include <cstdio>
#include <string>
#include <tuple>
#include <cuda_runtime.h>
#include <vector>

#include "timing.cuh"

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float recip_1_2(float x) {  // 1/x for x in [1, 2], as swiglu.rs
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  float e = __fmaf_rn(x, r, -1.0f);
  return __fmaf_rn(r, -e, r);
}

struct Sigmoid {
  float sig, one_minus;
  __device__ __forceinline__ explicit Sigmoid(float z) {
    float t = ex2(-fabsf(z) * 1.4426950408889634f);
    float r = recip_1_2(1.0f + t);
    float tr = t * r;
    sig = z >= 0.0f ? r : tr;
    one_minus = z >= 0.0f ? tr : r;
  }
  __device__ __forceinline__ float silu(float z) const { return sig == 0.0f ? -0.0f : z * sig; }
};

template <int MATH>
__device__ __forceinline__ void backward(float g, float a, float b, float& da, float& db) {
  if (MATH == 0) {
    da = g * b;
    db = g * a;
    return;
  }
  Sigmoid s(a);
  float zom = s.one_minus == 0.0f ? 0.0f : a * s.one_minus;
  float grad = s.sig == 0.0f ? 0.0f : s.sig * (1.0f + zom);
  db = g * s.silu(a);
  da = g * grad * b;
}

template <int MATH>
__device__ __forceinline__ float forward(float a, float b) {
  return MATH == 0 ? a * b : Sigmoid(a).silu(a) * b;
}

template <class V> struct Lanes;
template <> struct Lanes<float2> { static constexpr int n = 2; };
template <> struct Lanes<float4> { static constexpr int n = 4; };

// How a kernel finds its vectors: FLAT takes vector j of every operand at offset j (a
// contiguous layout only); ROWS finds j's (row, column) with a 32-bit division by the vectors
// per row and each operand's offset as row · stride + column, as kernels-gpu's `Walk` does;
// MAGIC does the same with the division as a multiply-high and shift by host-computed
// constants (exact for j < 2³¹).
enum { FLAT, ROWS, MAGIC };

struct Index {
  unsigned per_row, magic, shift, stride[5];
};

template <int IDX>
__device__ __forceinline__ size_t offset(size_t j, const Index& ix, int operand) {
  if (IDX == FLAT) return j;
  unsigned row = IDX == ROWS ? (unsigned)j / ix.per_row
                             : (unsigned)(((unsigned long long)j * ix.magic) >> ix.shift);
  unsigned col = (unsigned)j - row * ix.per_row;
  return (size_t)row * ix.stride[operand] + col;
}

// FWD: c (o0) from a (x0) and b (x1). Else: da (o0), db (o1) from dc (x0), a (x1), b (x2).
template <class V, int K, int THREADS, int MATH, bool FWD, int IDX = FLAT>
__global__ void __launch_bounds__(THREADS) kernel(const V* x0, const V* x1, const V* x2, V* o0,
                                                  V* o1, Index ix) {
  constexpr int L = Lanes<V>::n;
  const size_t base = (size_t)blockIdx.x * K * THREADS + threadIdx.x;
  V v0[K], v1[K], v2[K];
#pragma unroll
  for (int k = 0; k < K; k++) {
    const size_t j = base + k * THREADS;
    v0[k] = x0[offset<IDX>(j, ix, 0)];
    v1[k] = x1[offset<IDX>(j, ix, 1)];
    if (!FWD) v2[k] = x2[offset<IDX>(j, ix, 2)];
  }
#pragma unroll
  for (int k = 0; k < K; k++) {
    V r0, r1;
    const float* p0 = reinterpret_cast<const float*>(&v0[k]);
    const float* p1 = reinterpret_cast<const float*>(&v1[k]);
    const float* p2 = reinterpret_cast<const float*>(&v2[k]);
    float* q0 = reinterpret_cast<float*>(&r0);
    float* q1 = reinterpret_cast<float*>(&r1);
#pragma unroll
    for (int i = 0; i < L; i++) {
      if (FWD) q0[i] = forward<MATH>(p0[i], p1[i]);
      else backward<MATH>(p0[i], p1[i], p2[i], q0[i], q1[i]);
    }
    const size_t j = base + k * THREADS;
    o0[offset<IDX>(j, ix, 3)] = r0;
    if (!FWD) o1[offset<IDX>(j, ix, 4)] = r1;
  }
}

__global__ void mismatches(const unsigned* x, const unsigned* y, size_t n, unsigned long long* bad) {
  unsigned long long local = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    local += x[i] != y[i];
  if (local) atomicAdd(bad, local);
}

__global__ void nans(const unsigned* x, size_t n, unsigned long long* bad) {
  unsigned long long local = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    local += (x[i] & 0x7fffffffu) > 0x7f800000u;
  if (local) atomicAdd(bad, local);
}

__global__ void fill_random(float* x, size_t n, unsigned seed) {  // in (-2, 2), bell-shaped
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    unsigned h2 = h * 747796405u + 2891336453u;
    x[i] = ((h & 0xffff) + (h >> 16) + (h2 & 0xffff) + (h2 >> 16)) / 65536.0f - 2.0f;
  }
}

// Launches over `n` floats in rows of `row_floats` (the ROWS and MAGIC indexing's rows).
using Launch = void (*)(float* const*, float* const*, size_t n, unsigned row_floats);

struct Variant {
  const char* name;
  Launch launch;
};

template <class V, int K, int THREADS, int MATH, bool FWD, int IDX = FLAT>
Variant variant(const char* name) {
  return {name, [](float* const* in, float* const* out, size_t n, unsigned row_floats) {
            constexpr size_t per_block = (size_t)Lanes<V>::n * K * THREADS;
            Index ix{row_floats / Lanes<V>::n, 0, 0, {}};
            unsigned l = 0;
            while ((1u << l) < ix.per_row) l++;
            // m = ceil(2^(31 + l) / d) < 2^32: j / d = (j · m) >> (31 + l) for every j < 2^31.
            ix.magic = (unsigned)(((1ull << (31 + l)) + ix.per_row - 1) / ix.per_row);
            ix.shift = 31 + l;
            for (unsigned& s : ix.stride) s = ix.per_row;
            kernel<V, K, THREADS, MATH, FWD, IDX><<<n / per_block, THREADS>>>(
                (const V*)in[0], (const V*)in[1], (const V*)in[2], (V*)out[0], (V*)out[1], ix);
          }};
}

template <class V, int K, int THREADS, int MATH>
std::vector<Variant> indexings(const char* flat, const char* rows, const char* magic) {
  return {variant<V, K, THREADS, MATH, true, FLAT>(flat),
          variant<V, K, THREADS, MATH, true, ROWS>(rows),
          variant<V, K, THREADS, MATH, true, MAGIC>(magic)};
}

template <int MATH, bool FWD>
std::vector<Variant> variants() {
  return {variant<float4, 2, 256, MATH, FWD>("float4 x2, 256 threads"),
          variant<float4, 2, 128, MATH, FWD>("float4 x2, 128 threads"),
          variant<float4, 4, 128, MATH, FWD>("float4 x4, 128 threads"),
          variant<float4, 1, 256, MATH, FWD>("float4 x1, 256 threads"),
          variant<float4, 1, 128, MATH, FWD>("float4 x1, 128 threads"),
          variant<float2, 2, 256, MATH, FWD>("float2 x2, 256 threads"),
          variant<float2, 1, 256, MATH, FWD>("float2 x1, 256 threads"),
          variant<float2, 1, 128, MATH, FWD>("float2 x1, 128 threads")};
}

// One group: every variant on `n` floats, checked, then timed in three interleaved rounds.
static void group(const char* title, std::vector<Variant> vs, bool fwd, size_t n,
                  unsigned row_floats, float* const* in, float* const* out, float* const* ref,
                  unsigned long long* bad) {
  const int outs = fwd ? 1 : 2;
  std::printf("%s\n", title);
  for (size_t i = 0; i < vs.size(); i++) {
    float* const* o = i == 0 ? ref : out;
    for (int j = 0; j < outs; j++) CHECK(cudaMemset(o[j], 0xff, n * 4));
    vs[i].launch(in, o, n, row_floats);
    CHECK(cudaGetLastError());
    *bad = 0;
    for (int j = 0; j < outs; j++) {
      if (i == 0)  // finite inputs, finite results: a NaN is a poisoned word left
        nans<<<1024, 256>>>((const unsigned*)ref[j], n, bad);
      else
        mismatches<<<1024, 256>>>((const unsigned*)out[j], (const unsigned*)ref[j], n, bad);
    }
    CHECK(cudaDeviceSynchronize());
    if (*bad) std::printf("  %s: %llu bad words\n", vs[i].name, *bad);
  }
  const double bytes = (fwd ? 3.0 : 5.0) * n * 4;
  std::vector<std::vector<double>> gbps(vs.size());
  for (int round = 0; round < 3; round++)
    for (size_t i = 0; i < vs.size(); i++)
      gbps[i].push_back(
          bytes / median_us([&] { vs[i].launch(in, out, n, row_floats); }) / 1e3);
  for (size_t i = 0; i < vs.size(); i++)
    std::printf("  %-32s %.0f / %.0f / %.0f GB/s\n", vs[i].name, gbps[i][0], gbps[i][1],
                gbps[i][2]);
}

int main(int argc, char** argv) {
  const size_t f32 = 16384ull * 8192, bf16 = 16384ull * 14336 / 2, small = 2048ull * 14336 / 2;
  float *in[3], *out[2], *ref[2];
  for (float** p : {&in[0], &in[1], &in[2], &out[0], &out[1], &ref[0], &ref[1]})
    CHECK(cudaMalloc(p, f32 * 4));
  for (int i = 0; i < 3; i++) fill_random<<<1024, 256>>>(in[i], f32, i + 1);
  unsigned long long* bad;
  CHECK(cudaMallocManaged(&bad, 8));
  const unsigned f32_row = 8192, bf16_row = 14336 / 2;
  const bool fwd = true, bwd = false;
  if (argc > 1 && std::string(argv[1]) == "index") {
    for (auto [title, n, row] : {std::tuple{"forward f32 16384x8192, liger-rs math", f32, f32_row},
                                 {"forward bf16 16384x14336 (bytes), liger-rs math", bf16, bf16_row},
                                 {"forward bf16 2048x14336 (bytes), liger-rs math", small, bf16_row}}) {
      auto vs = indexings<float2, 1, 128, 1>("1 x 8 B, 128, flat", "1 x 8 B, 128, rows",
                                             "1 x 8 B, 128, magic");
      for (auto v : indexings<float4, 2, 128, 1>("2 x 16 B, 128, flat", "2 x 16 B, 128, rows",
                                                 "2 x 16 B, 128, magic"))
        vs.push_back(v);
      group(title, vs, fwd, n, row, in, out, ref, bad);
    }
    return 0;
  }
  group("backward f32 16384x8192, liger-rs math", variants<1, bwd>(), bwd, f32, f32_row, in, out, ref, bad);
  group("backward f32 16384x8192, plain products", variants<0, bwd>(), bwd, f32, f32_row, in, out, ref, bad);
  group("backward bf16 16384x14336 (bytes)", variants<0, bwd>(), bwd, bf16, bf16_row, in, out, ref, bad);
  group("backward bf16 2048x14336 (bytes)", variants<0, bwd>(), bwd, small, bf16_row, in, out, ref, bad);
  group("forward f32 16384x8192, liger-rs math", variants<1, fwd>(), fwd, f32, f32_row, in, out, ref, bad);
  group("forward f32 16384x8192, plain products", variants<0, fwd>(), fwd, f32, f32_row, in, out, ref, bad);
  group("forward bf16 16384x14336 (bytes)", variants<0, fwd>(), fwd, bf16, bf16_row, in, out, ref, bad);
  group("forward bf16 2048x14336 (bytes)", variants<0, fwd>(), fwd, small, bf16_row, in, out, ref, bad);
  return 0;
}
