# Chat-template conformance: `cleave template --cases` on every template of
# ../shared/chat-templates must print each case's expected rendering or error exactly. Skips (77)
# when the suite is absent. CLEAVE_CHAT_TEMPLATES_DIR (cache variable) points at another copy.
set(CLEAVE_CHAT_TEMPLATES_DIR "${PROJECT_SOURCE_DIR}/../shared/chat-templates"
    CACHE PATH "Directory with the *.jinja / *.cases.json chat-template suite")
add_test(NAME chat_templates
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/scripts/chat_templates.py
                 $<TARGET_FILE:cleave> ${CLEAVE_CHAT_TEMPLATES_DIR})
set_tests_properties(chat_templates PROPERTIES LABELS unit TIMEOUT 120 SKIP_RETURN_CODE 77)
