# Multi-host fault tests (tests/integration/multihost/): router, two prefill and two decode
# workers each in a network namespace of its own, KV over tcp;ofi_rxm across a bridge; packet
# loss, latency (where the kernel has netem), a partition and SIGKILLs under load. Needs root
# and nftables (scripts/install-deps.sh); skips (77) with the reason where namespaces cannot be
# made, or ../shared is absent. RUN_SERIAL: its load must not share the two CI cores with
# another test's.
add_test(NAME integration_multihost_faults
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/integration/multihost/multihost_faults_test.py
                 $<TARGET_FILE:cleave> ${PROJECT_SOURCE_DIR}/../shared/models)
set_tests_properties(integration_multihost_faults PROPERTIES LABELS integration TIMEOUT 600
                     SKIP_RETURN_CODE 77 RUN_SERIAL TRUE
                     ENVIRONMENT "PYTHONUNBUFFERED=1;PYTHONDONTWRITEBYTECODE=1")
