# GPU tests (label gpu): built when the CUDA backend is (CLEAVE_HAVE_CUDA); each exits 77 (ctest:
# skipped) where no CUDA device can be used. bench/gpu-check.sh packs them for a GPU machine.
if(CLEAVE_HAVE_CUDA)
  add_executable(gpu_cuda_kernels_test ${CMAKE_CURRENT_SOURCE_DIR}/gpu/cuda_kernels_test.cpp
                                       ${CMAKE_CURRENT_SOURCE_DIR}/gpu/gpu_test_main.cpp)
  target_link_libraries(gpu_cuda_kernels_test PRIVATE cleave::cuda_kernels cleave::engine GTest::gtest)
  add_test(NAME gpu_cuda_kernels COMMAND gpu_cuda_kernels_test)
  set_tests_properties(gpu_cuda_kernels PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 300)

  add_executable(gpu_cuda_backend_test ${CMAKE_CURRENT_SOURCE_DIR}/gpu/cuda_backend_test.cpp
                                       ${CMAKE_CURRENT_SOURCE_DIR}/gpu/gpu_test_main.cpp)
  target_link_libraries(gpu_cuda_backend_test PRIVATE cleave::cuda_kernels cleave::engine
                                                      cleave::model GTest::gtest)
  target_compile_definitions(gpu_cuda_backend_test PRIVATE CLEAVE_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  add_test(NAME gpu_cuda_backend COMMAND gpu_cuda_backend_test)
  set_tests_properties(gpu_cuda_backend PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
