# Multi-process worker tests: real `cleave worker` processes (prefill, decode, unified) on
# 127.0.0.1 over tcp;ofi_rxm and shm, driven through the router's dispatcher (and `cleave client`).
set(tgt integration_worker_disaggregation)
add_executable(${tgt} ${CMAKE_CURRENT_SOURCE_DIR}/integration/worker/disaggregation_cases.cpp
                      ${CMAKE_CURRENT_SOURCE_DIR}/integration/worker/worker_failure_cases.cpp)
target_link_libraries(${tgt} PRIVATE cleave::worker cleave::router cleave::worker_process
                      GTest::gtest GTest::gtest_main)
target_compile_definitions(${tgt} PRIVATE CLEAVE_BINARY="$<TARGET_FILE:cleave>"
  CLEAVE_SOURCE_DIR="${PROJECT_SOURCE_DIR}" CLEAVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
add_dependencies(${tgt} cleave)
add_test(NAME ${tgt} COMMAND ${tgt})
set_tests_properties(${tgt} PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77)

# Late KV writes into ended reservations are refused (per-reservation memory keys).
set(tgt integration_worker_late_write_fence)
add_executable(${tgt} ${CMAKE_CURRENT_SOURCE_DIR}/integration/worker/late_write_fence_cases.cpp)
target_link_libraries(${tgt} PRIVATE cleave::worker GTest::gtest GTest::gtest_main)
target_compile_definitions(${tgt} PRIVATE CLEAVE_BINARY="$<TARGET_FILE:cleave>"
  CLEAVE_SOURCE_DIR="${PROJECT_SOURCE_DIR}" CLEAVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
add_dependencies(${tgt} cleave)
add_test(NAME ${tgt} COMMAND ${tgt})
set_tests_properties(${tgt} PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77)
