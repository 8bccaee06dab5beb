# Transfer engine tests (libfabric). Unit tests run in one process; integration tests spawn
# transfer_test_peer as the target process on 127.0.0.1.
cleave_tests(${CMAKE_CURRENT_SOURCE_DIR}/unit/transfer unit LIBS cleave::transfer)

add_executable(transfer_test_peer ${CMAKE_CURRENT_SOURCE_DIR}/integration/transfer/transfer_test_peer.cpp)
target_link_libraries(transfer_test_peer PRIVATE cleave::transfer)

set(tgt integration_transfer_two_process)
add_executable(${tgt} ${CMAKE_CURRENT_SOURCE_DIR}/integration/transfer/two_process_cases.cpp)
target_link_libraries(${tgt} PRIVATE cleave::transfer GTest::gtest GTest::gtest_main)
target_compile_definitions(${tgt} PRIVATE TRANSFER_TEST_PEER="$<TARGET_FILE:transfer_test_peer>")
add_dependencies(${tgt} transfer_test_peer)
add_test(NAME ${tgt} COMMAND ${tgt})
# Alone (RUN_SERIAL): its killed-peer and deadline cases hold the transfer engine to bounds of
# tens of ms to seconds; beside the e2e tests on the two CI cores, the shm killed-peer case
# missed its bound and its peer crashed inside libfabric's shm provider (2026-12-04, 1 of 4
# full runs; alone it has passed every time). The shm re-insert case itself is open (issue 18).
set_tests_properties(${tgt} PROPERTIES LABELS integration TIMEOUT 180 RUN_SERIAL TRUE)

# The standalone bench binary (bench/transfer/CMakeLists.txt), as `cleave bench transfer` runs.
add_test(NAME integration_transfer_bench_smoke
         COMMAND transfer_bench bench transfer --provider tcp\;ofi_rxm --sizes 4KiB,1MiB --iters 20
                 --json ${PROJECT_BINARY_DIR}/transfer_bench_smoke.json)
set_tests_properties(integration_transfer_bench_smoke PROPERTIES LABELS integration TIMEOUT 60)

# A write with a revoked key (the fence for late KV writes into reused blocks).
set(tgt integration_transfer_revoked_key)
add_executable(${tgt} ${CMAKE_CURRENT_SOURCE_DIR}/integration/transfer/revoked_key_cases.cpp)
target_link_libraries(${tgt} PRIVATE cleave::transfer GTest::gtest GTest::gtest_main)
add_test(NAME ${tgt} COMMAND ${tgt})
set_tests_properties(${tgt} PROPERTIES LABELS integration TIMEOUT 120)

# A fault to one peer (its key revoked mid-stream) fails only that peer's transfers, and the
# rail rebuilds it causes leak no endpoint.
set(tgt integration_transfer_peer_fault)
add_executable(${tgt} ${CMAKE_CURRENT_SOURCE_DIR}/integration/transfer/peer_fault_cases.cpp)
target_link_libraries(${tgt} PRIVATE cleave::transfer GTest::gtest GTest::gtest_main)
target_compile_definitions(${tgt} PRIVATE TRANSFER_TEST_PEER="$<TARGET_FILE:transfer_test_peer>")
add_dependencies(${tgt} transfer_test_peer)
add_test(NAME ${tgt} COMMAND ${tgt})
set_tests_properties(${tgt} PROPERTIES LABELS integration TIMEOUT 180)
