"""Shared helpers of the deployment tests (tests/deploy/*_test.py): rendering the kustomizations
under deploy/k8s with `kubectl kustomize`, validating objects (kubernetes-validate for the
built-in kinds, the CRD schemas in ../shared/k8s-crds for custom resources), reading the cleave
config a rendered ConfigMap holds (`cleave config show`), the PromQL of the autoscalers and the
dashboard, and a Prometheus text parser.

A test script is run as `python3 TEST.py [--cleave BIN] [--shared DIR]`; main() parses those and
runs unittest. Exit 77 (ctest's skip) when kubectl is missing, with a message; tests that need
../shared skip themselves when it is absent.
"""

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import yaml

SKIP = 77
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(REPO, "deploy", "k8s")
# The Kubernetes version the built-in objects are validated against (EKS's, and kubectl's here).
K8S_VERSION = "1.32.0"
CLEAVE = None
SHARED = os.path.join(os.path.dirname(REPO), "shared")


def kustomizations():
    """Every directory under deploy/k8s with a kustomization.yaml that is a Kustomization (the
    base, the overlays, karpenter), relative to deploy/k8s; Components are rendered through the
    overlays that use them."""
    out = []
    for root, _dirs, files in os.walk(K8S):
        if "kustomization.yaml" not in files:
            continue
        with open(os.path.join(root, "kustomization.yaml")) as f:
            kind = (yaml.safe_load(f) or {}).get("kind", "Kustomization")
        if kind == "Kustomization":
            out.append(os.path.relpath(root, K8S))
    return sorted(out)


def overlays():
    return [k for k in kustomizations() if k.startswith("overlays" + os.sep)]


_render_cache = {}


def render(kdir):
    """The objects `kubectl kustomize deploy/k8s/KDIR` renders, as dicts."""
    if kdir not in _render_cache:
        if shutil.which("kubectl") is None:
            raise unittest.SkipTest("kubectl is not installed")
        r = subprocess.run(["kubectl", "kustomize", os.path.join(K8S, kdir)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise AssertionError(f"kubectl kustomize {kdir} failed:\n{r.stderr}")
        _render_cache[kdir] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return copy.deepcopy(_render_cache[kdir])


def find(objs, kind, name=None):
    out = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return out


def one(objs, kind, name):
    found = find(objs, kind, name)
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} {name}, found {len(found)}")
    return found[0]


def config_map(objs, prefix="cleave-config"):
    """The rendered cleave ConfigMap (its name carries kustomize's hash suffix)."""
    found = [o for o in objs if o["kind"] == "ConfigMap"
             and re.fullmatch(re.escape(prefix) + r"(-[a-z0-9]{10})?", o["metadata"]["name"])]
    if len(found) != 1:
        raise AssertionError(f"expected one ConfigMap {prefix}, found {len(found)}")
    return found[0]


def write_config_dir(cm, directory):
    """Writes the ConfigMap's keys as files, as the kubelet mounts them."""
    os.makedirs(directory, exist_ok=True)
    for key, value in (cm.get("data") or {}).items():
        with open(os.path.join(directory, key), "w") as f:
            f.write(value)
    return directory


def cleave_config(cm, *sets):
    """{setting: (value, source)} of `cleave config show --config DIR --set ...` on the
    ConfigMap written as a directory: the config system's own reading of it."""
    if CLEAVE is None:
        raise unittest.SkipTest("no cleave binary given (--cleave)")
    with tempfile.TemporaryDirectory(prefix="cleave-cm-") as d:
        write_config_dir(cm, d)
        args = [CLEAVE, "config", "show", "--config", d]
        for s in sets:
            args += ["--set", s]
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode != 0:
            raise AssertionError(f"cleave config show failed: {r.stderr}")
        out = {}
        section = None
        for line in r.stdout.splitlines():
            m = re.match(r"^(\w+):\s*$", line)
            if m:
                section = m.group(1)
                continue
            m = re.match(r"^  ([\w.]+):\s*(.*?)\s*#\s*(.*)$", line)
            if m and section:
                value = m.group(2)
                if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                    value = value[1:-1]
                out[f"{section}.{m.group(1)}"] = (value, m.group(3))
        return out


def containers(deployment, init=False):
    spec = deployment["spec"]["template"]["spec"]
    return spec.get("initContainers", []) if init else spec["containers"]


def container(deployment, name):
    for c in containers(deployment):
        if c["name"] == name:
            return c
    raise AssertionError(f"{deployment['metadata']['name']} has no container {name}")


def arg_value(args, flag):
    """The value of --flag=VALUE (or --flag VALUE) in a container's args."""
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


# ---- custom resources against ../shared/k8s-crds ----

def crd_dir():
    return os.path.join(SHARED, "k8s-crds")


def load_crds(directory=None):
    """{(group, kind): {"scope", "versions": {name: (served, openAPIV3Schema)}, "file"}}."""
    directory = directory or crd_dir()
    out = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".yaml"):
            continue
        with open(os.path.join(directory, name)) as f:
            for doc in yaml.safe_load_all(f):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                versions = {v["name"]: (v.get("served", False),
                                        (v.get("schema") or {}).get("openAPIV3Schema"))
                            for v in spec["versions"]}
                out[(spec["group"], spec["names"]["kind"])] = {
                    "scope": spec["scope"], "versions": versions, "file": name}
    return out


def strict_json_schema(s):
    """An apiextensions OpenAPI v3 schema as a JSON Schema that rejects what the API server
    would prune: every object with properties gets additionalProperties: false unless it says
    x-kubernetes-preserve-unknown-fields. int-or-string and nullable are honoured. CEL rules
    (x-kubernetes-validations) and formats are not checked."""
    if not isinstance(s, dict):
        return s
    out = {}
    for k, v in s.items():
        if k in ("properties", "patternProperties", "definitions"):
            out[k] = {pk: strict_json_schema(pv) for pk, pv in v.items()}
        elif k in ("items", "additionalProperties", "not"):
            out[k] = strict_json_schema(v) if isinstance(v, dict) else v
        elif k in ("allOf", "anyOf", "oneOf"):
            out[k] = [strict_json_schema(x) for x in v]
        elif k.startswith("x-kubernetes-") or k in ("format", "nullable", "description",
                                                      "example", "externalDocs"):
            continue
        else:
            out[k] = v
    if s.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}] + out.get("anyOf", [])
    if s.get("nullable") and "type" in out:
        t = out["type"]
        out["type"] = (t if isinstance(t, list) else [t]) + ["null"]
    preserve = s.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


# ObjectMeta as a custom resource may carry it in a rendered manifest.
_META = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def validate_custom_resource(obj, crds):
    """A list of problems (empty when the object is valid against its CRD)."""
    import jsonschema
    api = obj.get("apiVersion", "")
    group, _, version = api.rpartition("/")
    kind = obj.get("kind")
    where = f"{kind} {obj.get('metadata', {}).get('name')}"
    crd = crds.get((group, kind))
    if crd is None:
        return [f"{where}: no CRD schema for {kind} in group '{group}' (../shared/k8s-crds)"]
    if version not in crd["versions"]:
        return [f"{where}: {api} is not a version of the CRD ({sorted(crd['versions'])})"]
    served, schema = crd["versions"][version]
    problems = []
    if not served:
        problems.append(f"{where}: version {version} is not served")
    if schema is None:
        return problems + [f"{where}: the CRD has no schema for {version}"]
    meta = obj.get("metadata") or {}
    if crd["scope"] == "Cluster" and "namespace" in meta:
        problems.append(f"{where}: {kind} is cluster-scoped but has namespace {meta['namespace']}")
    full = strict_json_schema(schema)
    full.setdefault("properties", {})
    full["properties"]["apiVersion"] = {"type": "string"}
    full["properties"]["kind"] = {"type": "string"}
    full["properties"]["metadata"] = _META
    full["additionalProperties"] = False
    v = jsonschema.Draft7Validator(full)
    for e in sorted(v.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in e.absolute_path)
        problems.append(f"{where}: {path or '<root>'}: {e.message}")
    return problems


def is_builtin(obj):
    """True for the kinds kubernetes-validate has a schema for."""
    import kubernetes_validate
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return True
    except kubernetes_validate.utils.SchemaNotFoundError:
        return False
    except Exception:  # noqa: BLE001 (a validation error: it has a schema)
        return True


# ---- PromQL and Prometheus text ----

METRIC = re.compile(r"\bcleave:[a-zA-Z0-9_:]+")


def promql_queries():
    """[(where, query)] of every PromQL in the autoscalers and the dashboard: the KEDA triggers,
    the prometheus-adapter rules behind the HPAs, and the Grafana panels' targets."""
    out = []
    for path in [os.path.join(K8S, "components", "autoscaling-keda", "scaledobjects.yaml")]:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc and doc.get("kind") == "ScaledObject":
                    for t in doc["spec"]["triggers"]:
                        out.append((f"ScaledObject {doc['metadata']['name']} {t.get('name')}",
                                    t["metadata"]["query"]))
    with open(os.path.join(K8S, "components", "autoscaling-hpa",
                           "prometheus-adapter-values.yaml")) as f:
        values = yaml.safe_load(f)
    for rule in values["rules"]["external"]:
        name = rule["name"]["as"]
        for key in ("seriesQuery", "metricsQuery"):
            out.append((f"adapter {name} {key}", rule[key].replace("<<.LabelMatchers>>", "")))
    out.extend(dashboard_queries())
    return out


def dashboard_path():
    return os.path.join(K8S, "components", "monitoring", "cleave-dashboard.json")


def dashboard_queries():
    with open(dashboard_path()) as f:
        dash = json.load(f)
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"dashboard panel '{p.get('title')}'", t["expr"]))
            walk(p.get("panels", []))
    walk(dash["panels"])
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if isinstance(q, str) and "cleave:" in q:
            out.append((f"dashboard variable {v['name']}", q))
    return out


def selectors(query):
    """[(metric, {label: value or None})] for each metric selector in a PromQL expression:
    the labels its {...} matchers name."""
    out = []
    for m in METRIC.finditer(query):
        labels = {}
        rest = query[m.end():]
        if rest.startswith("{"):
            body = rest[1:rest.index("}")]
            for lm in re.finditer(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', body):
                labels[lm.group(1)] = lm.group(3) if lm.group(2) == "=" else None
        out.append((m.group(0), labels))
    return out


def parse_prometheus_text(text):
    """({sample name: [label dicts]}, {family name: type}) of a /metrics body."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+\S+", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        samples.setdefault(m.group(1), []).append(labels)
    return samples, types


def main(need_kubectl=True):
    global CLEAVE, SHARED
    p = argparse.ArgumentParser()
    p.add_argument("--cleave")
    p.add_argument("--shared", default=SHARED)
    args, rest = p.parse_known_args()
    CLEAVE = os.path.abspath(args.cleave) if args.cleave else None
    SHARED = os.path.abspath(args.shared)
    if need_kubectl and shutil.which("kubectl") is None:
        print("SKIP: kubectl is not installed (the deployment tests render with "
              "`kubectl kustomize`)", file=sys.stderr)
        sys.exit(SKIP)
    sys.argv = [sys.argv[0]] + rest
    unittest.main(verbosity=2)


# ---- local processes, probes ----

def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5.0):
    """(status, body) of GET url; (None, error text) when nothing answered."""
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except OSError as e:
        return None, str(e)


def http_post_json(url, body, timeout=120.0):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


# grpc.health.v1.HealthCheckResponse.ServingStatus
SERVING, NOT_SERVING = 1, 2


def grpc_health(target, service="", timeout=2.0):
    """The grpc.health.v1 status of `target` (1 SERVING, 2 NOT_SERVING, ...), or None when the
    call failed. Raw protobuf: the request's field 1 is the service name, the response's field 1
    the status (a varint)."""
    import grpc
    req = b""
    if service:
        s = service.encode()
        req = b"\x0a" + bytes([len(s)]) + s
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_unary("/grpc.health.v1.Health/Check",
                              request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            resp = call(req, timeout=timeout)
        except grpc.RpcError:
            return None
    if len(resp) >= 2 and resp[0] == 0x08:
        return resp[1]
    return 0  # UNKNOWN (the default value is not on the wire)


def metric_value(text, name, **labels):
    """The value of the sample `name{labels...}` (labels a subset) in a /metrics body, or None."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    return None


def cache_dir():
    """A cache shared by the tests' processes (CLEAVE_CACHE_DIR): the embedded default model is
    generated once."""
    d = os.environ.get("CLEAVE_TEST_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                               "cleave-deploy-test-cache")
    os.makedirs(d, exist_ok=True)
    return d


def clean_env(**extra):
    """The environment of a child process: this one's, without CLEAVE_* settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLEAVE_")}
    env.update(extra)
    return env
