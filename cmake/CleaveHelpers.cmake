# cleave_module(NAME DEPS ...): a static library from src/NAME/**/*.cpp with alias cleave::NAME.
function(cleave_module name)
  cmake_parse_arguments(M "" "" "DEPS;PRIVATE_DEPS" ${ARGN})
  file(GLOB_RECURSE srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cpp)
  add_library(cleave_${name} STATIC ${srcs})
  add_library(cleave::${name} ALIAS cleave_${name})
  target_include_directories(cleave_${name} PUBLIC ${PROJECT_SOURCE_DIR}/include
                                            PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(cleave_${name} PUBLIC ${M_DEPS} PRIVATE ${M_PRIVATE_DEPS})
endfunction()

# cleave_tests(DIR LABEL LIBS ...): one gtest executable per *_test.cpp in DIR (not recursive).
function(cleave_tests dir label)
  cmake_parse_arguments(T "" "" "LIBS" ${ARGN})
  file(GLOB tests CONFIGURE_DEPENDS ${dir}/*_test.cpp)
  foreach(src ${tests})
    get_filename_component(stem ${src} NAME_WE)
    get_filename_component(parent ${src} DIRECTORY)
    get_filename_component(mod ${parent} NAME)
    set(tgt ${label}_${mod}_${stem})
    add_executable(${tgt} ${src})
    target_link_libraries(${tgt} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main GTest::gmock)
    target_compile_definitions(${tgt} PRIVATE
      CLEAVE_SOURCE_DIR="${PROJECT_SOURCE_DIR}" CLEAVE_BINARY_DIR="${PROJECT_BINARY_DIR}")
    add_test(NAME ${tgt} COMMAND ${tgt})
    set_tests_properties(${tgt} PROPERTIES LABELS ${label} TIMEOUT 600 SKIP_RETURN_CODE 77)
  endforeach()
endfunction()
