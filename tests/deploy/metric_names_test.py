"""Every metric the autoscalers and the dashboard query is one cleave really exports: a real
`cleave serve` (embedded default model, prefill and decode workers with their /metrics on) gets
one chat completion, then its router's /metrics and each worker's /metrics are scraped. Each
PromQL selector in the KEDA ScaledObjects, the prometheus-adapter rules behind the HPAs and the
Grafana dashboard must name a sample of that scrape: of the router's for job="cleave-router",
of a worker's for job="cleave-worker"; its label matchers must name labels those samples carry
(the target labels Prometheus adds are exempt), and an equality matcher a value they have.

Usage: python3 metric_names_test.py --cleave BUILD/bin/cleave
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_lib as d  # noqa: E402

# Labels Prometheus puts on every target's samples (ServiceMonitor / PodMonitor), and for the
# workers the pool label the PodMonitor adds.
TARGET_LABELS = {"job", "namespace", "pod", "instance", "container", "endpoint", "service"}
WORKER_TARGET_LABELS = TARGET_LABELS | {"pool"}
LISTENING = re.compile(r"^cleave serve listening on (http://\S+)")
WORKER_METRICS = re.compile(r"worker (\S+): metrics on (http://\S+)")


class MetricNamesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if d.CLEAVE is None:
            raise unittest.SkipTest("no cleave binary given (--cleave)")
        cls.log = tempfile.NamedTemporaryFile(prefix="cleave-metrics-serve-", suffix=".log",
                                              delete=False)
        cls.proc = subprocess.Popen(
            [d.CLEAVE, "serve", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "-1",
             "--set", "router.health_interval_ms=200", "--set", "worker.metrics_port=0",
             "--set", "engine.threads=1", "--set", "engine.kv_cache_bytes=67108864"],
            stdout=subprocess.PIPE, stderr=cls.log, stdin=subprocess.DEVNULL, text=True,
            env=d.clean_env(CLEAVE_CACHE_DIR=d.cache_dir()), start_new_session=True)
        cls.url = None
        deadline = time.monotonic() + 240
        while cls.url is None and time.monotonic() < deadline:
            line = cls.proc.stdout.readline()
            if not line:
                break
            m = LISTENING.match(line)
            if m:
                cls.url = m.group(1).rstrip("/")
        if cls.url is None:
            cls.tearDownClass()
            raise AssertionError(f"cleave serve did not start:\n{cls.log_tail()}")
        body = {"model": json.loads(d.http_get(cls.url + "/v1/models")[1])["data"][0]["id"],
                "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
        status, text = d.http_post_json(cls.url + "/v1/chat/completions", body)
        assert status == 200, text
        # Let a probe round refresh the pools' gauges.
        time.sleep(0.5)
        status, cls.router_text = d.http_get(cls.url + "/metrics")
        assert status == 200, cls.router_text
        with open(cls.log.name) as f:
            workers = dict(WORKER_METRICS.findall(f.read()))
        cls.worker_texts = {}
        for wid, url in workers.items():
            status, text = d.http_get(url)
            assert status == 200, (wid, text)
            cls.worker_texts[wid] = text

    @classmethod
    def log_tail(cls):
        with open(cls.log.name, errors="replace") as f:
            return "".join(f.readlines()[-40:])

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, "proc", None) is not None and cls.proc.poll() is None:
            cls.proc.send_signal(signal.SIGTERM)
            try:
                cls.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(cls.proc.pid, signal.SIGKILL)
                cls.proc.wait()
        if getattr(cls, "proc", None) is not None:
            cls.proc.stdout.close()
        os.unlink(cls.log.name)

    def exported(self, texts):
        samples, types = {}, {}
        for t in texts:
            s, ty = d.parse_prometheus_text(t)
            for k, v in s.items():
                samples.setdefault(k, []).extend(v)
            types.update(ty)
        return samples, types

    def test_both_pools_exported_their_metrics(self):
        self.assertEqual({w.split("-")[0] for w in self.worker_texts}, {"prefill", "decode"})
        router, _ = self.exported([self.router_text])
        self.assertIn("cleave:kv_transfer_bytes_total", router)

    def test_every_queried_metric_is_exported(self):
        router = self.exported([self.router_text])[0]
        workers = self.exported(self.worker_texts.values())[0]
        queries = d.promql_queries()
        self.assertGreater(len(queries), 20)
        names = set()
        for where, query in queries:
            sels = d.selectors(query)
            self.assertTrue(sels, f"{where}: no cleave metric in {query}")
            for name, labels in sels:
                names.add(name)
                with self.subTest(where=where, metric=name):
                    job = labels.get("job")
                    self.assertIn(job, ("cleave-router", "cleave-worker"),
                                  f"{where}: {name} must select job=\"cleave-router\" or "
                                  f"\"cleave-worker\" (the router and workers export names in "
                                  f"common)")
                    samples = router if job == "cleave-router" else workers
                    exempt = TARGET_LABELS if job == "cleave-router" else WORKER_TARGET_LABELS
                    self.assertIn(name, samples, f"{where}: {name} is not in a real scrape "
                                  f"of the {'router' if job == 'cleave-router' else 'workers'}")
                    have = samples[name]
                    for label, value in labels.items():
                        if label in exempt:
                            continue
                        self.assertTrue(any(label in s for s in have),
                                        f"{where}: {name} has no label {label}")
                        if value is not None:
                            self.assertTrue(any(s.get(label) == value for s in have),
                                            f"{where}: no {name}{{{label}=\"{value}\"}} sample")
        # The panels the issue asks for are there.
        for want in ("cleave:time_to_first_token_seconds_bucket",
                     "cleave:time_per_output_token_seconds_bucket",
                     "cleave:generation_tokens_total", "cleave:num_requests_waiting",
                     "cleave:kv_cache_usage_perc", "cleave:kv_transfer_bytes_total",
                     "cleave:kv_transfer_seconds_bucket", "cleave:http_requests_total",
                     "cleave:worker_info"):
            self.assertIn(want, names)

    def test_the_autoscalers_read_the_router(self):
        for where, query in d.promql_queries():
            if where.startswith("dashboard"):
                continue
            for name, labels in d.selectors(query):
                self.assertEqual(labels.get("job"), "cleave-router", f"{where}: {query}")

    def test_by_labels_exist(self):
        router = self.exported([self.router_text])[0]
        workers = self.exported(self.worker_texts.values())[0]
        for where, query in d.promql_queries():
            sels = d.selectors(query)
            pool = set()
            for name, labels in sels:
                samples = router if labels.get("job") == "cleave-router" else workers
                exempt = TARGET_LABELS if labels.get("job") == "cleave-router" else WORKER_TARGET_LABELS
                for s in samples.get(name, []):
                    pool.update(s)
                pool.update(exempt)
            for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", query):
                for label in [x.strip() for x in m.group(1).split(",") if x.strip()]:
                    with self.subTest(where=where, label=label):
                        self.assertIn(label, pool, f"{where}: `by ({label})` in {query}")

    def test_the_worker_info_labels(self):
        for wid, text in self.worker_texts.items():
            samples, _ = d.parse_prometheus_text(text)
            info = samples["cleave:worker_info"]
            self.assertEqual(len(info), 1)
            self.assertEqual(info[0]["worker_id"], wid)
            self.assertEqual(set(info[0]), {"worker_id", "role", "instance_type", "profile",
                                            "version"})


if __name__ == "__main__":
    d.main(need_kubectl=False)
