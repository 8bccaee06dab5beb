# Multi-process worker tests: real `cleave worker` processes (prefill, decode, unified) on
# 127.0.0.1 over tcp;ofi_rxm and shm, driven through the router's dispatcher (and `cleave client`).
#   integration_worker_disaggregation   disaggregated equals unified equals alone; worker deaths
#   integration_worker_late_write_fence late KV writes into ended reservations are refused
#                                       (a memory key per reservation), or land in blocks
#                                       held past the lease (worker.kv_fence hold)
set(worker_dir ${CMAKE_CURRENT_SOURCE_DIR}/integration/worker)
set(integration_worker_disaggregation_srcs ${worker_dir}/disaggregation_cases.cpp
                                           ${worker_dir}/worker_failure_cases.cpp)
set(integration_worker_late_write_fence_srcs ${worker_dir}/late_write_fence_cases.cpp)
foreach(tgt integration_worker_disaggregation integration_worker_late_write_fence)
  add_executable(${tgt} ${${tgt}_srcs})
  target_link_libraries(${tgt} PRIVATE cleave::worker cleave::router cleave::worker_process
                        GTest::gtest GTest::gtest_main)
  target_compile_definitions(${tgt} PRIVATE CLEAVE_BINARY="$<TARGET_FILE:cleave>"
    CLEAVE_SOURCE_DIR="${PROJECT_SOURCE_DIR}" CLEAVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
  add_dependencies(${tgt} cleave)
  add_test(NAME ${tgt} COMMAND ${tgt})
  set_tests_properties(${tgt} PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77)
endforeach()
# Its worker-death cases hold the transfer engine to bounds of 1-3 s: beside another
# multi-process test on the two CI cores (e2e_serve_worker_failure), a prefill's tcp rail
# missed them in 2 of 4 full runs on 2026-12-03 (not understood yet; alone it passes).
set_tests_properties(integration_worker_disaggregation PROPERTIES RUN_SERIAL TRUE)
