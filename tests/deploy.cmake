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
