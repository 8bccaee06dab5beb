// main() of the GPU test binaries: exits 77 (ctest: skipped) where no CUDA device can be used,
// so that CI and GPU-less machines report the tests skipped, not failed.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device (%s)\n", e == cudaSuccess ? "none found" : cudaGetErrorString(e));
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
