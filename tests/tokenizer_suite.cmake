# Tokenizer conformance: `cleave tokenize --suite` on every llama.cpp vocab suite in
# ../shared/tokenizer-suite (llama.cpp's files, checked against the sha256s of its README) must
# reproduce the .out files exactly. Skips (77) when the suite files are absent.
# CLEAVE_TOKENIZER_SUITE_DIR (cache variable) points at another copy.
set(CLEAVE_TOKENIZER_SUITE_DIR "${PROJECT_SOURCE_DIR}/../shared/tokenizer-suite"
    CACHE PATH "Directory with the ggml-vocab-*.gguf tokenizer suites")
foreach(suite llama-spm phi-3 gpt-2 starcoder deepseek-coder falcon)
  add_test(NAME tokenizer_suite_${suite}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/scripts/tokenizer_suite.sh
                   $<TARGET_FILE:cleave> ${CLEAVE_TOKENIZER_SUITE_DIR} ${suite})
  set_tests_properties(tokenizer_suite_${suite} PROPERTIES LABELS unit TIMEOUT 120
                       SKIP_RETURN_CODE 77)
endforeach()
