# Module boundaries (issue 19): the router and the control-plane client link no worker, engine
# or transfer code, and no libfabric. Their link closures are taken at configure time
# (cmake/CleaveLinkClosure.cmake) and checked by a test, which names each offender and the
# target that brought it in.
include(CleaveLinkClosure)
foreach(module router control)
  cleave_link_closure(cleave_${module} links)
  list(JOIN links "\n" text)
  set(file ${CMAKE_CURRENT_BINARY_DIR}/link_closure_${module}.txt)
  file(CONFIGURE OUTPUT ${file} CONTENT "${text}\n" @ONLY)
  add_test(NAME unit_module_boundaries_${module}
           COMMAND ${CMAKE_COMMAND} -DLINKS=${file}
                   "-DFORBIDDEN=^cleave_transfer$,^cleave_engine$,^cleave_worker$,fabric"
                   -P ${PROJECT_SOURCE_DIR}/cmake/check_link_closure.cmake)
  set_tests_properties(unit_module_boundaries_${module} PROPERTIES LABELS unit TIMEOUT 30)
endforeach()
