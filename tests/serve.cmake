# End-to-end tests of `cleave serve` with the official `openai` Python package and grpcio
# (tests/e2e/serve_*_test.py, unittest): the API on stories260K in disaggregated mode, 200
# concurrent streams, a decode worker killed under load, the gRPC API, prompt log-probabilities
# (unified and disaggregated), f16/bf16 KV pools (disaggregated equals unified), and the embedded
# default model (SmolLM2; skipped when it is not in the model cache or cannot load). Skip (77)
# when ../shared is absent; fail when `openai` or `grpcio-tools` is missing
# (scripts/install-deps.sh installs them).
foreach(name openai concurrency worker_failure grpc logprobs default_model kv_dtype)
  set(tgt e2e_serve_${name})
  add_test(NAME ${tgt}
           COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/e2e/serve_${name}_test.py
                   $<TARGET_FILE:cleave> ${PROJECT_SOURCE_DIR}/../shared/models)
  set_tests_properties(${tgt} PROPERTIES LABELS e2e TIMEOUT 240 SKIP_RETURN_CODE 77
                       ENVIRONMENT "PYTHONUNBUFFERED=1;PYTHONDONTWRITEBYTECODE=1")
endforeach()
# A router with its workers under load: not beside deploy_worker_drain (see tests/deploy.cmake).
set_tests_properties(e2e_serve_worker_failure PROPERTIES RESOURCE_LOCK worker_processes)
