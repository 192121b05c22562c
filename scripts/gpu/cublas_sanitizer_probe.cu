// What compute-sanitizer reports about cuBLAS alone, with no liger-rs code: a bf16 GEMM by
// cublasGemmStridedBatchedEx (the call candle's matmul makes) writes C, then a plain kernel
// reads every 16-bit word of C. The same read of a C that a plain kernel wrote, and of a C
// that nothing wrote, are the controls. Under initcheck a finding in `read_all` after `gemm`
// means the sanitizer did not see the GEMM's stores; under racecheck a hazard names the GEMM
// kernel it is in. `scripts/gpu/verify.sh` builds and runs it beside the suites.
//   nvcc -O2 -arch=sm_90 -o probe cublas_sanitizer_probe.cu -lcublas
//   compute-sanitizer --tool initcheck ./probe gemm bf16 512 512 512
// Arguments: gemm | kernel | none, then bf16 | f32, then M N K (default 512 512 512).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define CHECK(x)                                                              \
  do {                                                                        \
    int e = (int)(x);                                                         \
    if (e != 0) {                                                             \
      fprintf(stderr, "%s failed with %d at line %d\n", #x, e, __LINE__);    \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

template <typename T>
__global__ void fill(T* p, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) p[i] = (T)(0.01f * (float)(i % 97));
}

// Counts odd 16-bit words so that every word of C is read and the result depends on them.
__global__ void read_all(const unsigned short* p, size_t n, unsigned int* odd) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n && (p[i] & 1)) atomicAdd(odd, 1u);
}

template <typename T>
void fill_on_device(void* p, size_t n) {
  fill<T><<<(unsigned)((n + 255) / 256), 256>>>((T*)p, n);
  CHECK(cudaGetLastError());
}

int main(int argc, char** argv) {
  const char* writer = argc > 1 ? argv[1] : "gemm";
  bool f32 = argc > 2 && !strcmp(argv[2], "f32");
  int m = argc > 3 ? atoi(argv[3]) : 512, n = argc > 4 ? atoi(argv[4]) : 512,
      k = argc > 5 ? atoi(argv[5]) : 512;
  size_t bytes = f32 ? 4 : 2;
  void *a, *b, *c;
  unsigned int* odd;
  CHECK(cudaMalloc(&a, (size_t)m * k * bytes));
  CHECK(cudaMalloc(&b, (size_t)k * n * bytes));
  CHECK(cudaMalloc(&c, (size_t)m * n * bytes));
  CHECK(cudaMalloc(&odd, sizeof(unsigned int)));
  CHECK(cudaMemset(odd, 0, sizeof(unsigned int)));
  auto fill_any = f32 ? fill_on_device<float> : fill_on_device<__nv_bfloat16>;
  fill_any(a, (size_t)m * k);
  fill_any(b, (size_t)k * n);
  if (!strcmp(writer, "gemm")) {
    cublasHandle_t handle;
    CHECK(cublasCreate(&handle));
    float one = 1, zero = 0;
    cudaDataType t = f32 ? CUDA_R_32F : CUDA_R_16BF;
    // Row-major C[m, n] = A[m, k] · B[k, n], as column-major Cᵀ = Bᵀ · Aᵀ.
    CHECK(cublasGemmStridedBatchedEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, b, t, n,
                                     (long long)k * n, a, t, k, (long long)m * k, &zero, c, t, n,
                                     (long long)m * n, 1, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
    CHECK(cudaDeviceSynchronize());
    CHECK(cublasDestroy(handle));
  } else if (!strcmp(writer, "kernel")) {
    fill_any(c, (size_t)m * n);
  } else if (strcmp(writer, "none")) {
    fprintf(stderr, "the writer is gemm, kernel or none, not %s\n", writer);
    return 2;
  }
  size_t words = (size_t)m * n * bytes / 2;
  read_all<<<(unsigned)((words + 255) / 256), 256>>>((const unsigned short*)c, words, odd);
  unsigned int host_odd;
  CHECK(cudaMemcpy(&host_odd, odd, sizeof host_odd, cudaMemcpyDeviceToHost));
  printf("C written by %s (%s, %d x %d x %d): %u of %zu words odd\n", writer,
         f32 ? "f32" : "bf16", m, n, k, host_odd, words);
  return 0;
}
