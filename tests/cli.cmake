# The `cleave` command line (tests/scripts/cli_*.sh, one per src/cli/cmd_*.cpp checked there):
# `cleave worker` refuses unknown and router-only flags and serves with its own. Skips (77) the
# part that needs ../shared/models when it is absent.
add_test(NAME cli_cmd_worker
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/scripts/cli_cmd_worker.sh
                 $<TARGET_FILE:cleave> ${PROJECT_SOURCE_DIR}/../shared/models)
set_tests_properties(cli_cmd_worker PROPERTIES LABELS unit TIMEOUT 120 SKIP_RETURN_CODE 77)
