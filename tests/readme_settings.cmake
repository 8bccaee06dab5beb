# The README's settings table must be exactly what `cleave config table` prints, so that every
# setting is documented with its default, env name and flag.
add_test(NAME unit_readme_settings_table
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/scripts/readme_settings_table.sh
                 $<TARGET_FILE:cleave> ${PROJECT_SOURCE_DIR}/README.md)
set_tests_properties(unit_readme_settings_table PROPERTIES LABELS unit TIMEOUT 30)
