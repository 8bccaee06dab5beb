# Golden end-to-end test: `cleave generate` on stories260K (greedy, prompt = BOS alone, 200
# tokens) must print exactly the llama2.c reference text in ../shared/models. Skips (77) when
# ../shared is absent.
add_test(NAME e2e_golden_stories260K
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/e2e/golden_stories260K.sh
                 $<TARGET_FILE:cleave> ${PROJECT_SOURCE_DIR}/../shared/models)
set_tests_properties(e2e_golden_stories260K PROPERTIES LABELS e2e SKIP_RETURN_CODE 77 TIMEOUT 300)
