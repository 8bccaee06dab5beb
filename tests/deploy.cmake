# Deployment (deploy/, tests/deploy/*_test.py, unittest; labels deploy plus unit or integration):
# the kustomizations rendered with `kubectl kustomize` and validated (kubernetes-validate; the
# CRD schemas in ../shared/k8s-crds), the Dockerfile against the README, the metrics the
# autoscalers and dashboard query against a real scrape, the cpu-demo manifests run as local
# processes, and the workers' graceful drain. Skip (77) without kubectl where it is needed; the
# CRD checks skip themselves when ../shared is absent.
function(cleave_deploy_test name label timeout)
  add_test(NAME deploy_${name}
           COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/deploy/${name}_test.py
                   --cleave $<TARGET_FILE:cleave> --shared ${PROJECT_SOURCE_DIR}/../shared)
  set_tests_properties(deploy_${name} PROPERTIES LABELS "deploy;${label}" TIMEOUT ${timeout}
    SKIP_RETURN_CODE 77
    ENVIRONMENT "PYTHONUNBUFFERED=1;PYTHONDONTWRITEBYTECODE=1;CLEAVE_TEST_CACHE_DIR=${PROJECT_BINARY_DIR}/test-cache")
endfunction()
cleave_deploy_test(manifests unit 300)
cleave_deploy_test(dockerfile unit 120)
cleave_deploy_test(metric_names integration 300)
cleave_deploy_test(manifest_smoke integration 420)
cleave_deploy_test(worker_drain integration 420)
# Its draining prefill's KV goes to a decode worker over tcp;ofi_rxm, whose writes complete only
# when the decode worker's rail runs: beside e2e_serve_worker_failure (another router with its
# workers) on the two CI cores, the decode worker went unscheduled for seconds and the write
# missed its 5 s bound (a full run on 2026-12-03). The two take turns (RESOURCE_LOCK).
set_tests_properties(deploy_worker_drain PROPERTIES RESOURCE_LOCK worker_processes)
