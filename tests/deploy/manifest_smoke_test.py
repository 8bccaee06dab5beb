"""The manifests start a working system, not just valid YAML: the rendered cpu-demo overlay,
run as local processes the way a kubelet would run its pods.

For each Deployment (one replica) every init container runs to completion, then every container
starts, each as a local process with the manifest's command and args: `cleave` is the binary
under test; each declared containerPort gets a free 127.0.0.1 port, and the args that bind one
(`--flag=PORT`, `0.0.0.0:PORT`) are rewritten to it; the Services' names in the ConfigMap
(`cleave-prefill:7000`, ...) become the 127.0.0.1 ports of the pods they select; the
ConfigMap is written to a directory where its volume would mount it, the emptyDir and projected
volumes are fresh directories, and paths under the mount points are rewritten; env comes from
the manifest (fieldRef: pod name, namespace, node name "localhost", pod IP 127.0.0.1).

Then the probes the manifests declare (startup, then readiness and liveness: gRPC health, HTTP
GET, TCP) must pass, and one chat completion goes through the router's Service port; the KV
moved from the prefill to the decode pod (tcp;ofi_rxm) and the workers exported the profile
they applied. Last, SIGTERM to every process: each exits 0 within its
terminationGracePeriodSeconds.

Usage: python3 manifest_smoke_test.py --cleave BUILD/bin/cleave
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_lib as d  # noqa: E402

OVERLAY = "overlays/cpu-demo"
# Startup probes allow minutes for weight loading; here the default model is small.
STARTUP_LIMIT_S = 240


class Pod:
    """One replica of a Deployment as local processes."""

    def __init__(self, dep, root, namespace):
        self.dep = dep
        self.name = dep["metadata"]["name"]
        self.pod_name = f"{self.name}-0"
        self.namespace = namespace
        self.spec = dep["spec"]["template"]["spec"]
        self.labels = dep["spec"]["template"]["metadata"]["labels"]
        self.dir = os.path.join(root, self.name)
        os.makedirs(self.dir)
        # containerPort -> local port; port name -> containerPort.
        self.ports, self.port_names = {}, {}
        for c in self.spec.get("initContainers", []) + self.spec["containers"]:
            for p in c.get("ports", []):
                self.ports[p["containerPort"]] = d.free_port()
                if "name" in p:
                    self.port_names[p["name"]] = p["containerPort"]
        self.procs = {}  # container name -> (Popen, log path)
        self.volumes = {}

    def local_port(self, port):
        """The local port of a probe's or Service's port (a number or a port name)."""
        if isinstance(port, str) and not port.isdigit():
            port = self.port_names[port]
        return self.ports[int(port)]

    def map_volumes(self, config_dirs):
        for v in self.spec.get("volumes", []):
            if "configMap" in v:
                name = v["configMap"]["name"]
                if name not in config_dirs:
                    # kube-root-ca.crt and the like: not in the rendered manifests.
                    path = os.path.join(self.dir, "vol-" + v["name"])
                    os.makedirs(path)
                    self.volumes[v["name"]] = path
                    continue
                self.volumes[v["name"]] = config_dirs[name]
            elif "emptyDir" in v and v["emptyDir"].get("medium") == "Memory":
                self.volumes[v["name"]] = None  # /dev/shm: the host's
            elif "emptyDir" in v or "projected" in v:
                path = os.path.join(self.dir, "vol-" + v["name"])
                os.makedirs(path)
                self.volumes[v["name"]] = path
            else:
                raise AssertionError(f"{self.name}: volume {v['name']} of an unknown kind")
        # The cache volume: shared by the test's pods, so that the default model is made once.
        if "cache" in self.volumes:
            self.volumes["cache"] = d.cache_dir()

    def mounts(self, c):
        """[(mountPath, local dir)] of a container, longest first."""
        out = []
        for m in c.get("volumeMounts", []):
            local = self.volumes[m["name"]]
            if local is not None:
                out.append((m["mountPath"], local))
        return sorted(out, key=lambda x: -len(x[0]))

    def rewrite(self, text, c):
        """Paths under the container's mount points -> the local directories (one pass, so a
        local path is never rewritten again)."""
        mounts = dict(self.mounts(c))
        if not mounts:
            return text
        pattern = "(" + "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True)) + r")(?=/|$|[^\w.-])"
        return re.sub(pattern, lambda m: mounts[m.group(1)], text)

    def rewrite_arg(self, arg, c):
        arg = self.rewrite(arg, c)
        m = re.fullmatch(r"(--[\w-]+=)(\d+)", arg)
        if m and int(m.group(2)) in self.ports:
            return m.group(1) + str(self.ports[int(m.group(2))])
        m = re.fullmatch(r"(.*?)(0\.0\.0\.0|\[::\]|127\.0\.0\.1):(\d+)", arg)
        if m and int(m.group(3)) in self.ports:
            return f"{m.group(1)}127.0.0.1:{self.ports[int(m.group(3))]}"
        if arg.endswith("=0.0.0.0"):
            return arg[: -len("0.0.0.0")] + "127.0.0.1"
        return arg

    def env(self, c, config_maps):
        out = d.clean_env()
        for e in c.get("env", []):
            if "value" in e:
                out[e["name"]] = self.rewrite(e["value"], c)
                continue
            src = e["valueFrom"]
            if "fieldRef" in src:
                out[e["name"]] = {
                    "metadata.name": self.pod_name,
                    "metadata.namespace": self.namespace,
                    "spec.nodeName": "localhost",
                    "status.podIP": "127.0.0.1",
                }[src["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                out[e["name"]] = config_maps[ref["name"]]["data"][ref["key"]]
            else:
                raise AssertionError(f"{self.name}: env {e['name']}: unsupported {src}")
        return out

    def argv(self, c):
        cmd = [self.rewrite_arg(a, c) for a in c.get("command", []) + c.get("args", [])]
        if cmd and cmd[0] in ("cleave", "/usr/local/bin/cleave"):
            cmd[0] = d.CLEAVE
        return cmd

    def start(self, c, config_maps):
        log = os.path.join(self.dir, c["name"] + ".log")
        f = open(log, "w")
        p = subprocess.Popen(self.argv(c), env=self.env(c, config_maps), stdout=f,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.dir,
                             start_new_session=True)
        f.close()
        self.procs[c["name"]] = (p, log)
        return p

    def log_tail(self, name, n=40):
        try:
            with open(self.procs[name][1], errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except (OSError, KeyError):
            return "(no log)"

    def probe(self, c, probe):
        """True when the probe passes now."""
        timeout = probe.get("timeoutSeconds", 1) + 1
        if "grpc" in probe:
            target = f"127.0.0.1:{self.local_port(probe['grpc']['port'])}"
            return d.grpc_health(target, probe["grpc"].get("service", ""), timeout) == d.SERVING
        if "httpGet" in probe:
            g = probe["httpGet"]
            status, _ = d.http_get(f"http://127.0.0.1:{self.local_port(g['port'])}{g.get('path', '/')}",
                                   timeout)
            return status is not None and 200 <= status < 400
        if "tcpSocket" in probe:
            try:
                with socket.create_connection(("127.0.0.1", self.local_port(probe["tcpSocket"]["port"])),
                                              timeout):
                    return True
            except OSError:
                return False
        if "exec" in probe:
            return subprocess.run(self.argv({"command": probe["exec"]["command"]}),
                                  timeout=timeout).returncode == 0
        raise AssertionError(f"{self.name}/{c['name']}: unsupported probe {probe}")


class ManifestSmokeTest(unittest.TestCase):
    def setUp(self):
        if d.CLEAVE is None:
            self.skipTest("no cleave binary given (--cleave)")
        self.objs = d.render(OVERLAY)
        self.root = tempfile.mkdtemp(prefix="cleave-smoke-")
        self.pods = []

    def tearDown(self):
        for pod in self.pods:
            for name, (p, _) in pod.procs.items():
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except OSError:
                        pass
                    p.wait(timeout=10)
        if not os.environ.get("CLEAVE_KEEP_TEST_DIRS"):
            shutil.rmtree(self.root, ignore_errors=True)

    def fail_with_logs(self, message):
        tails = []
        for pod in self.pods:
            for name in pod.procs:
                tails.append(f"--- {pod.name}/{name}:\n{pod.log_tail(name)}")
        self.fail(message + "\n" + "\n".join(tails))

    def test_the_cpu_demo_manifests_serve_a_chat_completion(self):
        objs = self.objs
        namespace = d.find(objs, "Namespace")[0]["metadata"]["name"]
        config_maps = {cm["metadata"]["name"]: cm for cm in d.find(objs, "ConfigMap")}
        deployments = d.find(objs, "Deployment")
        self.assertEqual({x["metadata"]["name"] for x in deployments},
                         {"cleave-router", "cleave-prefill", "cleave-decode"})
        self.pods = [Pod(dep, self.root, namespace) for dep in deployments]

        # Services -> 127.0.0.1 ports of the pods they select.
        service_ports = {}
        for svc in d.find(objs, "Service"):
            sel = svc["spec"]["selector"]
            pods = [p for p in self.pods if all(p.labels.get(k) == v for k, v in sel.items())]
            self.assertEqual(len(pods), 1, f"Service {svc['metadata']['name']} selects {len(pods)} pods")
            for sp in svc["spec"]["ports"]:
                service_ports[(svc["metadata"]["name"], sp["port"])] = pods[0].local_port(
                    sp.get("targetPort", sp["port"]))

        # The ConfigMaps as directories, with Service names mapped to the local ports.
        config_dirs = {}
        for name, cm in config_maps.items():
            data = {}
            for key, value in (cm.get("data") or {}).items():
                for (svc, port), local in service_ports.items():
                    pattern = re.escape(svc) + r"(\." + re.escape(namespace) + r"(\.svc(\.cluster\.local)?)?)?:" + str(port) + r"\b"
                    value = re.sub(pattern, f"127.0.0.1:{local}", value)
                data[key] = value
            config_dirs[name] = d.write_config_dir(dict(cm, data=data),
                                                   os.path.join(self.root, "configmap-" + name))
        with open(os.path.join(config_dirs[d.config_map(objs)["metadata"]["name"]],
                               "cleave.yaml")) as f:
            mapped = f.read()
        self.assertNotIn("cleave-prefill:", mapped)
        self.assertNotIn("cleave-decode:", mapped)

        for pod in self.pods:
            pod.map_volumes(config_dirs)
            # Init containers, in order, to completion.
            for c in pod.spec.get("initContainers", []):
                p = pod.start(c, config_maps)
                try:
                    code = p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.fail_with_logs(f"{pod.name}: init container {c['name']} did not finish")
                if code != 0:
                    self.fail_with_logs(f"{pod.name}: init container {c['name']} exited {code}")
            for c in pod.spec["containers"]:
                pod.start(c, config_maps)

        # Startup probes, then readiness and liveness, as declared.
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            deadline = time.monotonic() + STARTUP_LIMIT_S
            for pod in self.pods:
                for c in pod.spec["containers"]:
                    probe = c.get(kind)
                    if probe is None:
                        continue
                    while not pod.probe(c, probe):
                        p = pod.procs[c["name"]][0]
                        if p.poll() is not None:
                            self.fail_with_logs(f"{pod.name}/{c['name']} exited {p.returncode} "
                                                f"before its {kind} passed")
                        if time.monotonic() > deadline:
                            self.fail_with_logs(f"{pod.name}/{c['name']}: {kind} {probe} did not "
                                                f"pass within {STARTUP_LIMIT_S} s")
                        time.sleep(min(1.0, probe.get("periodSeconds", 10)))

        # One chat completion through the router's Service.
        router = f"http://127.0.0.1:{service_ports[('cleave-router', 8000)]}"
        status, body = d.http_get(router + "/v1/models")
        self.assertEqual(status, 200, body)
        model = json.loads(body)["data"][0]["id"]
        status, body = d.http_post_json(router + "/v1/chat/completions", {
            "model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello from the manifests"}]})
        if status != 200:
            self.fail_with_logs(f"chat completion: HTTP {status}: {body}")
        reply = json.loads(body)
        self.assertEqual(reply["object"], "chat.completion")
        self.assertGreater(reply["usage"]["completion_tokens"], 0)

        # Disaggregated: the KV went from the prefill pod to the decode pod.
        _, text = d.http_get(router + "/metrics")
        self.assertGreater(d.metric_value(text, "cleave:kv_transfer_bytes_total") or 0, 0, text)
        self.assertEqual(d.metric_value(text, "cleave:pool_workers_ready", pool="decode"), 1)
        # Each worker exported the profile it applied (cpu-demo: no instance type, `default`).
        for pod in self.pods:
            if pod.name == "cleave-router":
                continue
            _, wtext = d.http_get(f"http://127.0.0.1:{pod.local_port('metrics')}/metrics")
            self.assertEqual(d.metric_value(wtext, "cleave:worker_info", worker_id=pod.pod_name,
                                            instance_type="", profile="default"), 1, wtext)

        # SIGTERM: every process exits 0 within its grace period (the workers drain first).
        for pod in self.pods:
            for name, (p, _) in pod.procs.items():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        for pod in self.pods:
            grace = pod.spec.get("terminationGracePeriodSeconds", 30)
            for c in pod.spec["containers"]:
                p = pod.procs[c["name"]][0]
                try:
                    code = p.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self.fail_with_logs(f"{pod.name}/{c['name']} still runs {grace} s after SIGTERM")
                if code != 0:
                    self.fail_with_logs(f"{pod.name}/{c['name']} exited {code} after SIGTERM")


if __name__ == "__main__":
    d.main()
