# Block formats against llama.cpp's Python reference (gguf-py): cleave's decoding of every format
# and its encoding of the legacy ones must equal gguf-py's, bit for bit. Skips (77) when gguf-py
# is missing (scripts/install-deps.sh installs it).
add_test(NAME unit_quant_reference_gguf_py
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/scripts/quant_reference.py
                 $<TARGET_FILE:cleave>)
set_tests_properties(unit_quant_reference_gguf_py PROPERTIES LABELS unit TIMEOUT 300
                     SKIP_RETURN_CODE 77 ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
