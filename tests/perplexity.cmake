# `cleave perplexity` on stories260K: output shape, --batch invariance and its errors. Skips (77)
# when ../shared is absent.
add_test(NAME e2e_perplexity_cli
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/e2e/perplexity_cli.sh
                 $<TARGET_FILE:cleave> ${PROJECT_SOURCE_DIR}/../shared/models)
set_tests_properties(e2e_perplexity_cli PROPERTIES LABELS e2e SKIP_RETURN_CODE 77 TIMEOUT 300)
