"""The Kubernetes manifests under deploy/k8s, rendered with `kubectl kustomize`:
 - every kustomization renders;
 - every built-in object validates offline against the Kubernetes schemas (kubernetes-validate,
   strict: unknown fields are errors), and every custom resource (KEDA, Karpenter,
   prometheus-operator) against its CRD schema in ../shared/k8s-crds, strictly; a custom resource
   without a schema fails (those tests skip when ../shared is absent);
 - the pool sizes in each overlay's config are its Deployments' replicas (and the autoscalers'
   least replicas), as `cleave config show` reads the rendered ConfigMap;
 - the EKS overlays give the workers GPUs, EFA devices, hugepages and IPC_LOCK on P5-class
   nodes, with transfer.provider efa and one rail per EFA device;
 - every instance type Karpenter or eksctl may bring has a profile, and the fallback order is
   a strict order of NodePool weights;
 - the pods' grace period covers preStop plus worker.drain_seconds; the probes are the ones the
   drain relies on.

Usage: python3 manifests_test.py --cleave BUILD/bin/cleave [--shared ../shared]
"""

import json
import os
import re
import sys
import unittest

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_lib as d  # noqa: E402

EKS = ["overlays/eks-efa", "overlays/eks-efa-hpa"]
WORKERS = ["cleave-prefill", "cleave-decode"]


def quantity(q):
    """An integer count from a Kubernetes quantity ("2", 2, "16Gi" -> bytes)."""
    if isinstance(q, int):
        return q
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(q))
    if not m:
        raise AssertionError(f"unexpected quantity {q!r}")
    return int(m.group(1)) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30,
                              "Ti": 1 << 40}[m.group(2)]


def pre_stop_seconds(c):
    cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return int(cmd[1]) if len(cmd) == 2 and cmd[0] == "sleep" else 0


class RenderAndValidate(unittest.TestCase):
    def test_every_kustomization_renders(self):
        names = d.kustomizations()
        for want in ["base", "overlays/cpu-demo", "overlays/eks-efa", "overlays/eks-efa-hpa",
                     "karpenter"]:
            self.assertIn(want, names)
        for k in names:
            with self.subTest(kustomization=k):
                self.assertGreater(len(d.render(k)), 0)

    def test_builtin_objects_validate_strictly(self):
        import kubernetes_validate
        for k in d.kustomizations():
            for obj in d.render(k):
                where = f"{k}: {obj['kind']} {obj['metadata']['name']}"
                with self.subTest(object=where):
                    try:
                        kubernetes_validate.validate(obj, d.K8S_VERSION, strict=True)
                    except kubernetes_validate.utils.SchemaNotFoundError:
                        continue  # a custom resource: test_custom_resources_...
                    except kubernetes_validate.ValidationError as e:
                        path = ".".join(str(p) for p in e.path)
                        self.fail(f"{where}: {path}: {e.message}")

    def test_custom_resources_validate_against_their_crds(self):
        if not os.path.isdir(d.crd_dir()):
            self.skipTest(f"{d.crd_dir()} is absent (../shared not checked out)")
        crds = d.load_crds()
        seen = set()
        for k in d.kustomizations():
            for obj in d.render(k):
                if d.is_builtin(obj):
                    continue
                seen.add(obj["kind"])
                with self.subTest(object=f"{k}: {obj['kind']} {obj['metadata']['name']}"):
                    problems = d.validate_custom_resource(obj, crds)
                    self.assertEqual(problems, [], "\n".join(problems))
        self.assertTrue({"ScaledObject", "ServiceMonitor", "PodMonitor", "NodePool",
                         "EC2NodeClass"} <= seen, seen)

    def test_the_crd_validator_is_strict(self):
        """What the validator must refuse: a kind with no CRD, a field the schema lacks, a wrong
        type, a namespace on a cluster-scoped kind, an unknown version."""
        if not os.path.isdir(d.crd_dir()):
            self.skipTest(f"{d.crd_dir()} is absent (../shared not checked out)")
        crds = d.load_crds()
        objs = d.render("overlays/eks-efa")
        so = d.one(objs, "ScaledObject", "cleave-decode")
        self.assertEqual(d.validate_custom_resource(so, crds), [])
        bad = []
        x = dict(so, kind="ScaledJob")
        bad.append(("no schema", x))
        x = yaml.safe_load(yaml.safe_dump(so))
        x["spec"]["minReplicas"] = 1
        bad.append(("unknown field", x))
        x = yaml.safe_load(yaml.safe_dump(so))
        x["spec"]["triggers"][0]["metadata"]["threshold"] = 128
        bad.append(("wrong type", x))
        x = yaml.safe_load(yaml.safe_dump(so))
        x["apiVersion"] = "keda.sh/v1"
        bad.append(("unknown version", x))
        pool = d.one(d.render("karpenter"), "NodePool", "cleave-gpu-p5")
        self.assertEqual(d.validate_custom_resource(pool, crds), [])
        x = yaml.safe_load(yaml.safe_dump(pool))
        x["metadata"]["namespace"] = "cleave"
        bad.append(("namespace on a cluster-scoped kind", x))
        x = yaml.safe_load(yaml.safe_dump(pool))
        x["spec"]["template"]["spec"]["requirements"][0]["operator"] = "Within"
        bad.append(("enum", x))
        for why, obj in bad:
            with self.subTest(why=why):
                self.assertNotEqual(d.validate_custom_resource(obj, crds), [], why)


class PoolSizes(unittest.TestCase):
    def test_pool_sizes_in_the_config_are_the_replicas(self):
        for k in d.overlays():
            objs = d.render(k)
            cfg = d.cleave_config(d.config_map(objs))
            for pool in ("prefill", "decode"):
                with self.subTest(overlay=k, pool=pool):
                    want = int(cfg[f"pools.{pool}.replicas"][0])
                    dep = d.one(objs, "Deployment", f"cleave-{pool}")
                    self.assertEqual(dep["spec"]["replicas"], want)
                    for so in d.find(objs, "ScaledObject", f"cleave-{pool}"):
                        self.assertEqual(so["spec"]["minReplicaCount"], want)
                    for hpa in d.find(objs, "HorizontalPodAutoscaler", f"cleave-{pool}"):
                        self.assertEqual(hpa["spec"]["minReplicas"], want)
                        self.assertEqual(hpa["spec"]["scaleTargetRef"]["name"], f"cleave-{pool}")

    def test_the_overlays_pool_sizes_differ_from_the_base(self):
        """The overlay's value wins (a base replacement would have copied the base's)."""
        cfg = d.cleave_config(d.config_map(d.render("overlays/eks-efa")))
        self.assertEqual(cfg["pools.prefill.replicas"][0], "2")
        self.assertEqual(cfg["pools.decode.replicas"][0], "4")

    def test_the_config_names_the_pools_headless_services(self):
        for k in d.overlays():
            objs = d.render(k)
            cfg = d.cleave_config(d.config_map(objs))
            for pool in ("prefill", "decode"):
                with self.subTest(overlay=k, pool=pool):
                    svc = d.one(objs, "Service", f"cleave-{pool}")
                    self.assertEqual(svc["spec"]["clusterIP"], "None")
                    name, port = cfg[f"pools.{pool}.dns"][0].rsplit(":", 1)
                    self.assertEqual(name, f"cleave-{pool}")
                    self.assertIn(int(port), [p["port"] for p in svc["spec"]["ports"]])
                    listen = d.arg_value(d.container(d.one(objs, "Deployment", f"cleave-{pool}"),
                                                     "worker")["args"], "--listen")
                    self.assertEqual(listen, f"0.0.0.0:{port}")


class EksEfa(unittest.TestCase):
    def test_gpu_efa_hugepages_and_ipc_lock_on_the_workers(self):
        for k in EKS:
            objs = d.render(k)
            cfg = d.cleave_config(d.config_map(objs))
            self.assertEqual(cfg["transfer.provider"][0], "efa")
            for name in WORKERS:
                with self.subTest(overlay=k, deployment=name):
                    dep = d.one(objs, "Deployment", name)
                    c = d.container(dep, "worker")
                    req, lim = c["resources"]["requests"], c["resources"]["limits"]
                    self.assertEqual(quantity(lim["nvidia.com/gpu"]), 1)
                    efa = quantity(lim["vpc.amazonaws.com/efa"])
                    self.assertGreaterEqual(efa, 1)
                    self.assertEqual(quantity(req["vpc.amazonaws.com/efa"]), efa)
                    # One rail per EFA device of the pod.
                    self.assertEqual(int(cfg["transfer.rails"][0]), efa)
                    self.assertGreater(quantity(lim["hugepages-2Mi"]), 0)
                    self.assertEqual(req["hugepages-2Mi"], lim["hugepages-2Mi"])
                    self.assertIn("IPC_LOCK", c["securityContext"]["capabilities"]["add"])
                    spec = dep["spec"]["template"]["spec"]
                    media = {v["name"]: v.get("emptyDir", {}).get("medium") for v in spec["volumes"]}
                    self.assertIn("HugePages-2Mi", media.values())
                    self.assertEqual(media["dshm"], "Memory")
                    types = worker_instance_types(dep)
                    for t in ("p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge"):
                        self.assertIn(t, types)
                    self.assertIn("nvidia.com/gpu", [t["key"] for t in spec["tolerations"]])
            router = d.container(d.one(objs, "Deployment", "cleave-router"), "router")
            self.assertNotIn("nvidia.com/gpu", router["resources"].get("limits", {}))

    def test_the_cpu_demo_has_no_gpu_or_efa(self):
        objs = d.render("overlays/cpu-demo")
        cfg = d.cleave_config(d.config_map(objs))
        self.assertEqual(cfg["transfer.provider"][0], "tcp;ofi_rxm")
        self.assertEqual(cfg["model.path"][0], "")  # the embedded default
        for dep in d.find(objs, "Deployment"):
            for c in d.containers(dep) + d.containers(dep, init=True):
                text = yaml.safe_dump(c.get("resources", {}))
                self.assertNotIn("nvidia.com", text)
                self.assertNotIn("vpc.amazonaws.com", text)
                self.assertNotIn("hugepages", text)
        self.assertEqual([o for o in objs if o["apiVersion"].split("/")[0] not in
                          ("v1", "apps", "policy", "rbac.authorization.k8s.io")], [])


def worker_instance_types(dep):
    terms = (dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
             ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"])
    out = set()
    for t in terms:
        for e in t["matchExpressions"]:
            if e["key"] == "node.kubernetes.io/instance-type" and e["operator"] == "In":
                out.update(e["values"])
    return out


class CapacityFallback(unittest.TestCase):
    def nodepool_types(self):
        pools = d.find(d.render("karpenter"), "NodePool")
        out = []
        for p in pools:
            reqs = p["spec"]["template"]["spec"]["requirements"]
            types = [v for r in reqs if r["key"] == "node.kubernetes.io/instance-type"
                     for v in r["values"]]
            out.append((p["spec"].get("weight", 0), p["metadata"]["name"], types))
        return sorted(out, reverse=True)

    def test_nodepools_are_a_strict_order_of_weights(self):
        pools = self.nodepool_types()
        self.assertGreaterEqual(len(pools), 3)
        weights = [w for w, _, _ in pools]
        self.assertEqual(len(set(weights)), len(weights), pools)
        self.assertEqual(pools[0][2], ["p5en.48xlarge"], pools)
        for w, name, types in pools:
            self.assertEqual(len(types), 1, name)
        classes = {n["spec"]["template"]["spec"]["nodeClassRef"]["name"]
                   for n in d.find(d.render("karpenter"), "NodePool")}
        self.assertEqual(classes, {o["metadata"]["name"]
                                   for o in d.find(d.render("karpenter"), "EC2NodeClass")})

    def test_every_instance_type_has_a_profile_and_the_workers_may_land_on_it(self):
        types = [t for _, _, ts in self.nodepool_types() for t in ts]
        with open(os.path.join(d.REPO, "deploy", "eksctl", "cluster.yaml")) as f:
            eksctl = yaml.safe_load(f)
        gpu_groups = [g for g in eksctl["managedNodeGroups"] if g.get("efaEnabled")]
        self.assertGreater(len(gpu_groups), 0)
        for g in gpu_groups:
            self.assertTrue(g["placement"]["groupName"], g["name"])
            self.assertEqual(len(g["availabilityZones"]), 1, "EFA nodes in one AZ")
            types.append(g["instanceType"])
        for k in EKS:
            objs = d.render(k)
            cm = d.config_map(objs)
            for name in WORKERS:
                allowed = worker_instance_types(d.one(objs, "Deployment", name))
                role = name.split("-")[1]
                for t in set(types):
                    with self.subTest(overlay=k, worker=name, instance_type=t):
                        self.assertIn(t, allowed)
                        cfg = d.cleave_config(cm, f"worker.instance_type={t}", f"worker.role={role}")
                        src = cfg["engine.kv_cache_bytes"][1]
                        self.assertTrue(src.startswith(f"profile {t} "), src)
                        self.assertTrue(cfg["engine.max_num_seqs"][1].startswith(f"profile {t} "))
                # Any other type gets the default profile.
                cfg = d.cleave_config(cm, "worker.instance_type=m7i.large", f"worker.role={role}")
                self.assertTrue(cfg["engine.kv_cache_bytes"][1].startswith("profile default "))

    def test_the_profiles_size_an_l40s_below_an_h200(self):
        cm = d.config_map(d.render("overlays/eks-efa"))
        h200 = d.cleave_config(cm, "worker.instance_type=p5e.48xlarge", "worker.role=decode")
        l40s = d.cleave_config(cm, "worker.instance_type=g6e.48xlarge", "worker.role=decode")
        for key in ("engine.kv_cache_bytes", "engine.max_num_seqs"):
            self.assertLess(int(l40s[key][0]), int(h200[key][0]), key)


class DrainAndProbes(unittest.TestCase):
    def test_grace_period_covers_pre_stop_and_the_drain(self):
        for k in d.overlays():
            objs = d.render(k)
            cfg = d.cleave_config(d.config_map(objs))
            drain = int(cfg["worker.drain_seconds"][0])
            self.assertGreater(drain, 0)
            for name in WORKERS:
                with self.subTest(overlay=k, deployment=name):
                    dep = d.one(objs, "Deployment", name)
                    c = d.container(dep, "worker")
                    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                    self.assertGreaterEqual(grace, pre_stop_seconds(c) + drain + 5)
                    self.assertGreater(pre_stop_seconds(c), 0)
            router = d.one(objs, "Deployment", "cleave-router")
            self.assertGreater(router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"],
                               pre_stop_seconds(d.container(router, "router")))

    def test_probes(self):
        for k in d.overlays():
            objs = d.render(k)
            for name in WORKERS:
                with self.subTest(overlay=k, deployment=name):
                    c = d.container(d.one(objs, "Deployment", name), "worker")
                    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                    # Readiness is the gRPC health the drain turns NOT_SERVING.
                    self.assertEqual(c["readinessProbe"]["grpc"]["port"], ports["grpc"])
                    self.assertEqual(c["startupProbe"]["grpc"]["port"], ports["grpc"])
                    # Startup allows for weight loading (at least 5 minutes).
                    sp = c["startupProbe"]
                    self.assertGreaterEqual(sp["periodSeconds"] * sp["failureThreshold"], 300)
                    # Liveness must not be the health that drains, or a draining pod is killed.
                    self.assertNotIn("grpc", c["livenessProbe"])
                    self.assertEqual(c["livenessProbe"]["httpGet"]["port"], ports["metrics"])
                    self.assertEqual(d.arg_value(c["args"], "--metrics-port"), str(ports["metrics"]))
            c = d.container(d.one(objs, "Deployment", "cleave-router"), "router")
            self.assertEqual(c["readinessProbe"]["httpGet"]["path"], "/health")

    def test_disruption_budgets_and_spread(self):
        for k in d.overlays():
            objs = d.render(k)
            for name in WORKERS + ["cleave-router"]:
                with self.subTest(overlay=k, deployment=name):
                    pdb = d.one(objs, "PodDisruptionBudget", name)
                    dep = d.one(objs, "Deployment", name)
                    sel = dep["spec"]["selector"]["matchLabels"]
                    self.assertEqual(pdb["spec"]["selector"]["matchLabels"], sel)
                    spec = dep["spec"]["template"]["spec"]
                    self.assertTrue(spec.get("topologySpreadConstraints"))
            self.assertIn("podAntiAffinity",
                          d.one(objs, "Deployment", "cleave-router")["spec"]["template"]["spec"]["affinity"])


class MonitoringAndAutoscaling(unittest.TestCase):
    """The monitors scrape what the queries name (job labels, ports), and the autoscalers
    target the pools."""

    def test_monitors_scrape_the_router_and_the_workers(self):
        for k in EKS:
            objs = d.render(k)
            sm = d.one(objs, "ServiceMonitor", "cleave-router")
            svc = d.one(objs, "Service", "cleave-router")
            sel = sm["spec"]["selector"]["matchLabels"]
            self.assertTrue(all(svc["metadata"]["labels"].get(a) == b for a, b in sel.items()))
            self.assertNotIn("jobLabel", sm["spec"])  # so job is the Service's name
            self.assertEqual(svc["metadata"]["name"], "cleave-router")
            self.assertIn(sm["spec"]["endpoints"][0]["port"], [p["name"] for p in svc["spec"]["ports"]])
            self.assertEqual(sm["spec"]["endpoints"][0]["path"], "/metrics")
            pm = d.one(objs, "PodMonitor", "cleave-workers")
            relabel = {r["targetLabel"]: r for r in pm["spec"]["podMetricsEndpoints"][0]["relabelings"]}
            self.assertEqual(relabel["job"]["replacement"], "cleave-worker")
            self.assertEqual(relabel["pool"]["sourceLabels"],
                             ["__meta_kubernetes_pod_label_app_kubernetes_io_component"])
            exprs = {e["key"]: e["values"] for e in pm["spec"]["selector"]["matchExpressions"]}
            for name in WORKERS:
                dep = d.one(objs, "Deployment", name)
                labels = dep["spec"]["template"]["metadata"]["labels"]
                self.assertTrue(all(labels.get(key) in vals for key, vals in exprs.items()), name)
                ports = [p["name"] for p in d.container(dep, "worker")["ports"]]
                self.assertIn(pm["spec"]["podMetricsEndpoints"][0]["port"], ports)
            # The dashboard ConfigMap is the dashboard file, for Grafana's sidecar.
            cm = d.one(objs, "ConfigMap", "cleave-grafana-dashboard")
            self.assertEqual(cm["metadata"]["labels"]["grafana_dashboard"], "1")
            with open(d.dashboard_path()) as f:
                self.assertEqual(json.loads(cm["data"]["cleave-dashboard.json"]), json.load(f))

    def test_the_autoscalers_target_the_pools(self):
        objs = d.render("overlays/eks-efa")
        for so in d.find(objs, "ScaledObject"):
            ref = so["spec"]["scaleTargetRef"]
            self.assertEqual(ref["name"], so["metadata"]["name"])
            d.one(objs, "Deployment", ref["name"])
            self.assertGreater(so["spec"]["maxReplicaCount"], so["spec"]["minReplicaCount"])
            for t in so["spec"]["triggers"]:
                self.assertEqual(t["type"], "prometheus")
        self.assertEqual({so["metadata"]["name"] for so in d.find(objs, "ScaledObject")},
                         set(WORKERS))
        hpa_objs = d.render("overlays/eks-efa-hpa")
        with open(os.path.join(d.K8S, "components", "autoscaling-hpa",
                               "prometheus-adapter-values.yaml")) as f:
            served = {r["name"]["as"] for r in yaml.safe_load(f)["rules"]["external"]}
        hpas = d.find(hpa_objs, "HorizontalPodAutoscaler")
        self.assertEqual({h["metadata"]["name"] for h in hpas}, set(WORKERS))
        self.assertEqual(d.find(hpa_objs, "ScaledObject"), [])
        for h in hpas:
            for m in h["spec"]["metrics"]:
                self.assertEqual(m["type"], "External")
                self.assertIn(m["external"]["metric"]["name"], served)


if __name__ == "__main__":
    d.main()
