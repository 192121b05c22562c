// Shared by the CUDA C stand-ins of the RMSNorm bf16 llama backward in scripts/gpu/
// (rms_bwd_rows.cu, rms_sm90.cu): the shipped dW reduction's shape, launched as the sm_90 build
// launches it, and the inputs of one width.
#pragma once
#include <cmath>
#include <cuda_runtime.h>
#include <vector>

#include "bf16x8.cuh"
#include "timing.cuh"

// The shipped reduction's shape: 32 columns × 32 part-lanes, 8 loads in flight per thread.
__global__ void __launch_bounds__(1024) dw_reduce(const float* part, int parts, int cols,
                                                  __nv_bfloat16* dw) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  __shared__ float sm[1024];
  const int x = threadIdx.x, y = threadIdx.y, c = blockIdx.x * 32 + x;
  float acc = 0.f;
  for (int p = y; p < parts; p += 8 * 32) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
      v[i] = p + i * 32 < parts ? part[(size_t)(p + i * 32) * cols + c] : 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) acc += v[i];
  }
  sm[y * 32 + x] = acc;
  __syncthreads();
  if (y == 0) {
    float s = 0.f;
    for (int i = 0; i < 32; i++) s += sm[i * 32 + x];
    dw[c] = __float2bfloat16_rn(s);
  }
}

// dw = Σ of `parts` partial rows of `cols` f32, as a programmatic dependent launch after the
// backward (as the sm_90 build runs it).
static void launch_dw_reduce(const float* part, int parts, int cols, __nv_bfloat16* dw) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(cols / 32);
  cfg.blockDim = dim3(32, 32);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&cfg, dw_reduce, part, parts, cols, dw));
}

// Fresh inputs of one width, uploaded: x, dy ~ U(-2, 2), w ~ U(0.5, 1.5) from the generator
// state `seed` (carried from width to width), rstd from x in f64.
static void upload_inputs(unsigned& seed, int rows, int cols, void* x, void* dy, void* w,
                          float* rstd) {
  auto uni = [&] {
    seed = seed * 1664525u + 1013904223u;
    return (seed >> 8) * (1.0f / 16777216.0f);
  };
  const size_t n = (size_t)rows * cols;
  std::vector<__nv_bfloat16> hx(n), hdy(n), hw(cols);
  std::vector<float> hr(rows);
  for (size_t i = 0; i < n; i++) {
    hx[i] = __float2bfloat16(4.f * uni() - 2.f);
    hdy[i] = __float2bfloat16(4.f * uni() - 2.f);
  }
  for (int c = 0; c < cols; c++) hw[c] = __float2bfloat16(0.5f + uni());
  for (int r = 0; r < rows; r++) {
    double ss = 0;
    for (int c = 0; c < cols; c++) {
      const double v = __bfloat162float(hx[(size_t)r * cols + c]);
      ss += v * v;
    }
    hr[r] = (float)(1.0 / std::sqrt(ss / cols + 1e-6));
  }
  CHECK(cudaMemcpy(x, hx.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dy, hdy.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(w, hw.data(), cols * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(rstd, hr.data(), rows * 4, cudaMemcpyHostToDevice));
}
