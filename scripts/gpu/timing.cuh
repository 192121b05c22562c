// Shared by the CUDA C programs in scripts/gpu/ (they run on the device machine, which has
// nvcc and no Rust): error checking, and timing as `cargo bench` times (benches/ops.rs):
// 10 warm-up calls, then 100 calls each between its own pair of CUDA events, median.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <vector>

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));         \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

// Median µs of `f()` over 100 calls, each between its own pair of events, after 10 warm-ups.
template <class F>
static double median_us(F f) {
  for (int i = 0; i < 10; i++) f();
  std::vector<cudaEvent_t> ev(200);
  for (auto& e : ev) CHECK(cudaEventCreate(&e));
  for (int i = 0; i < 100; i++) {
    CHECK(cudaEventRecord(ev[2 * i]));
    f();
    CHECK(cudaEventRecord(ev[2 * i + 1]));
  }
  CHECK(cudaDeviceSynchronize());
  std::vector<double> us(100);
  for (int i = 0; i < 100; i++) {
    float ms;
    CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = ms * 1e3;
  }
  for (auto& e : ev) CHECK(cudaEventDestroy(e));
  std::sort(us.begin(), us.end());
  return us[50];
}

// GB/s of a 1 GiB device-to-device copy (read + write), timed as above.
static double copy_gbps() {
  const size_t big = size_t(1) << 30;
  void *p, *q;
  CHECK(cudaMalloc(&p, big));
  CHECK(cudaMalloc(&q, big));
  CHECK(cudaMemset(p, 1, big));
  const double us = median_us([&] { CHECK(cudaMemcpyAsync(q, p, big, cudaMemcpyDeviceToDevice)); });
  CHECK(cudaFree(p));
  CHECK(cudaFree(q));
  return 2.0 * big / us / 1e3;
}
