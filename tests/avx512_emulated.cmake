# The AVX-512 kernel sets on hosts without AVX-512: the kernel tests (cpu_kernels_test.cpp and
# qdot_test.cpp, unchanged) against the engine with dot_avx512.cpp, qdot_avx512.cpp and
# dispatch.cpp compiled anew with CLEAVE_AVX512_EMULATED, which runs their intrinsics through
# SIMDe (src/engine/cpu/avx512_emulated.h) and lets dispatch offer the "avx512" set wherever the
# AVX2 set runs. Those three objects come first on the link line, so the archive's own copies
# of them are never pulled in (a symbol defined in both would fail the link, not pass silently).
# Without SIMDe (libsimde-dev, scripts/install-deps.sh) or off x86-64 the test is not built.
find_path(CLEAVE_SIMDE_INCLUDE simde/x86/avx512.h)
if(CLEAVE_SIMDE_INCLUDE AND CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  set(cpu ${PROJECT_SOURCE_DIR}/src/engine/cpu)
  add_executable(unit_engine_avx512_emulated_test
    ${CMAKE_CURRENT_SOURCE_DIR}/unit/engine/cpu_kernels_test.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/unit/engine/qdot_test.cpp
    ${cpu}/dot_avx512.cpp ${cpu}/qdot_avx512.cpp ${cpu}/dispatch.cpp)
  set_source_files_properties(${cpu}/dot_avx512.cpp ${cpu}/qdot_avx512.cpp ${cpu}/dispatch.cpp
    TARGET_DIRECTORY unit_engine_avx512_emulated_test
    PROPERTIES COMPILE_OPTIONS "-O3;-ffp-contract=off;-mavx2;-mfma;-mf16c;-Wno-psabi")
  target_compile_definitions(unit_engine_avx512_emulated_test PRIVATE CLEAVE_AVX512_EMULATED=1)
  target_include_directories(unit_engine_avx512_emulated_test PRIVATE
    ${PROJECT_SOURCE_DIR}/src ${CLEAVE_SIMDE_INCLUDE})
  target_link_libraries(unit_engine_avx512_emulated_test PRIVATE cleave::engine
                        GTest::gtest GTest::gtest_main GTest::gmock)
  add_test(NAME unit_engine_avx512_emulated_test COMMAND unit_engine_avx512_emulated_test)
  set_tests_properties(unit_engine_avx512_emulated_test PROPERTIES LABELS unit TIMEOUT 600)
endif()
