"""End-to-end: `cleave bench serve` against a real `cleave serve` (stories260K, disaggregated).

A short random run (completions) checks every key of the result JSON, that the counts agree with
the requests sent and with the server's own counters (cleave:prompt_tokens_total,
cleave:generation_tokens_total), the progress bar, and the concurrency cap; a chat run on the
agentic preset and a replay of a Mooncake trace slice (when ../shared has it) complete; bad flags
fail with a message naming the value; and HEAD /metrics leaves the keep-alive connection intact
(AIPerf's probe); a server that closes idle connections fast (router.idle_timeout_ms) fails no
request on them. Every load is a few dozen requests with small max_tokens, bounded by
--max-duration.

Usage: python3 serve_bench_test.py CLEAVE_BINARY MODELS_DIR
"""

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402

TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared",
                     "traces", "mooncake-conversation.jsonl")

KEYS = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "dataset",
        "num_prompts", "request_rate", "burstiness", "max_concurrency", "goodput", "duration",
        "completed", "failed", "total_input_tokens", "total_output_tokens",
        "total_cached_input_tokens", "prefix_cache_hit_rate",
        "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
        "max_output_tokens_per_s", "max_concurrent_requests", "dataset_prefix_reuse",
        "input_lens", "output_lens", "ttfts", "itls", "e2els", "start_times",
        "generated_texts", "errors"]
PER_REQUEST = ["input_lens", "output_lens", "ttfts", "itls", "e2els", "start_times",
               "generated_texts", "errors"]
METRICS = ["ttft", "tpot", "itl", "e2el"]


def counter_sum(serve, name):
    return sum(v for (n, _), v in serve.metrics().items() if n == name)


class ServeBenchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.serve = h.serve()
        cls.tmp = tempfile.TemporaryDirectory(prefix="cleave-bench-e2e-")

    @classmethod
    def tearDownClass(cls):
        cls.serve.stop()
        cls.tmp.cleanup()

    def bench(self, *args, timeout=150):
        return subprocess.run([h.CLEAVE, "bench", "serve", "--base-url", self.serve.url.rstrip("/"),
                               "--max-duration", "120", "--request-timeout", "60"] + list(args),
                              capture_output=True, text=True, timeout=timeout)

    def test_random_run_json_has_every_key_and_consistent_counts(self):
        out = os.path.join(self.tmp.name, "random.json")
        n, max_tokens, cap = 16, 8, 3
        prompt_before = counter_sum(self.serve, "cleave:prompt_tokens_total")
        cached_before = counter_sum(self.serve, "cleave:prompt_tokens_cached_total")
        gen_before = counter_sum(self.serve, "cleave:generation_tokens_total")
        r = self.bench("--dataset", "random", "--num-prompts", str(n), "--random-input-len", "24",
                       "--random-output-len", str(max_tokens), "--random-range-ratio", "0.5",
                       "--request-rate", "40", "--burstiness", "2", "--max-concurrency", str(cap),
                       "--ignore-eos", "--seed", "3", "--goodput", "ttft:60000", "tpot:60000",
                       "--percentiles", "50,90,99", "--save-result", out)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("Serving Benchmark Result", r.stdout)
        self.assertIn(f"{n}/{n} requests, 0 failed", r.stderr)  # the progress bar's last line
        with open(out) as f:
            j = json.load(f)
        for key in KEYS:
            self.assertIn(key, j)
        for m in METRICS:
            for stat in ["mean", "median", "std", "p50", "p90", "p99"]:
                self.assertIn(f"{stat}_{m}_ms", j)
                self.assertGreaterEqual(j[f"{stat}_{m}_ms"], 0.0)
        self.assertEqual(j["completed"], n, j["errors"])
        self.assertEqual(j["failed"], 0)
        self.assertEqual(j["num_prompts"], n)
        for key in PER_REQUEST:
            self.assertEqual(len(j[key]), n, key)
        self.assertEqual(j["errors"], [""] * n)
        # --ignore-eos: every request generated its max_tokens, drawn from [len/2, len*3/2].
        for x in j["output_lens"]:
            self.assertGreaterEqual(x, max_tokens // 2)
            self.assertLessEqual(x, max_tokens * 3 // 2)
        self.assertGreater(len(set(j["output_lens"])), 1)
        total_out = sum(j["output_lens"])
        self.assertEqual(j["total_output_tokens"], total_out)
        self.assertEqual(j["total_input_tokens"], sum(j["input_lens"]))
        # The server counted the same tokens.
        self.assertEqual(counter_sum(self.serve, "cleave:generation_tokens_total") - gen_before,
                         j["total_output_tokens"])
        self.assertEqual(counter_sum(self.serve, "cleave:prompt_tokens_total") - prompt_before,
                         j["total_input_tokens"])
        self.assertEqual(counter_sum(self.serve, "cleave:prompt_tokens_cached_total") - cached_before,
                         j["total_cached_input_tokens"])
        self.assertAlmostEqual(j["prefix_cache_hit_rate"],
                               j["total_cached_input_tokens"] / j["total_input_tokens"], places=9)
        d = j["duration"]
        self.assertGreater(d, 0)
        self.assertAlmostEqual(j["request_throughput"], n / d, places=6)
        self.assertAlmostEqual(j["output_throughput"], total_out / d, places=6)
        self.assertAlmostEqual(j["total_token_throughput"],
                               (j["total_input_tokens"] + total_out) / d, places=6)
        self.assertAlmostEqual(j["request_goodput"], n / d, places=6)  # loose SLOs: all good
        # vLLM's figure: requests active during the busiest one-second bucket (not at once).
        self.assertGreaterEqual(j["max_concurrent_requests"], 1)
        self.assertLessEqual(j["max_concurrent_requests"], n)
        # The cap: at no instant were more than `cap` requests open (send to last event).
        events = sorted([(t, 1) for t in j["start_times"]] +
                        [(t + e, -1) for t, e in zip(j["start_times"], j["e2els"])],
                        key=lambda x: (x[0], x[1]))
        open_now = peak = 0
        for _, step in events:
            open_now += step
            peak = max(peak, open_now)
        self.assertLessEqual(peak, cap)
        self.assertEqual(j["max_concurrency"], cap)
        self.assertEqual(j["request_rate"], 40)
        for i in range(n):
            self.assertGreater(j["ttfts"][i], 0)
            self.assertGreaterEqual(j["e2els"][i], j["ttfts"][i])
            self.assertLessEqual(len(j["itls"][i]), j["output_lens"][i] - 1)
            self.assertAlmostEqual(j["ttfts"][i] + sum(j["itls"][i]), j["e2els"][i], delta=0.05)
            self.assertGreaterEqual(j["start_times"][i], 0)
            self.assertLessEqual(j["start_times"][i] + j["e2els"][i], d + 1e-6)
        self.assertAlmostEqual(j["mean_ttft_ms"], 1000 * sum(j["ttfts"]) / n, places=6)
        self.assertLessEqual(j["median_ttft_ms"], j["p90_ttft_ms"])
        self.assertLessEqual(j["p90_ttft_ms"], j["p99_ttft_ms"])

    def test_tokenizer_sizes_prompts_in_the_models_tokens(self):
        # With the served model's tokenizer a prompt of N words is N tokens: the server's usage
        # counts N plus its BOS for every request, whatever words were drawn.
        out = os.path.join(self.tmp.name, "tokens.json")
        r = self.bench("--dataset", "random", "--num-prompts", "8", "--random-input-len", "40",
                       "--random-output-len", "2", "--tokenizer", h.model_path(),
                       "--save-result", out, "--no-progress")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(out) as f:
            j = json.load(f)
        self.assertEqual(j["completed"], 8, j["errors"])
        self.assertEqual(j["input_lens"], [41] * 8)
        r = self.bench("--dataset", "random", "--num-prompts", "1", "--tokenizer",
                       "/nonexistent/model.gguf", "--no-progress")
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("--tokenizer /nonexistent/model.gguf", r.stderr)

    def test_chat_agentic_preset(self):
        out = os.path.join(self.tmp.name, "agentic.json")
        r = self.bench("--endpoint", "chat", "--dataset", "preset:agentic", "--scale", "0.01",
                       "--num-prompts", "12", "--request-rate", "inf", "--max-concurrency", "4",
                       "--goodput", "e2el:1", "--save-result", out, "--no-progress")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stderr, "")
        with open(out) as f:
            j = json.load(f)
        self.assertEqual(j["completed"] + j["failed"], 12)
        self.assertEqual(j["completed"], 12, j["errors"])
        self.assertEqual(j["endpoint_type"], "openai-chat")
        self.assertGreater(j["dataset_prefix_reuse"], 0.3)
        self.assertLess(j["request_goodput"], j["request_throughput"])  # 1 ms E2EL: few meet it
        # Each turn re-sends the one before: the prompts grow within a session.
        self.assertGreater(max(j["input_lens"]), 2 * min(j["input_lens"]))

    def test_mooncake_trace_slice(self):
        if not os.path.isfile(TRACE):
            self.skipTest(f"{TRACE} is absent")
        out = os.path.join(self.tmp.name, "trace.json")
        r = self.bench("--dataset", "trace:" + TRACE, "--max-requests", "10",
                       "--length-scale", "0.01", "--time-scale", "0.0002",
                       "--save-result", out, "--no-progress")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(out) as f:
            j = json.load(f)
        self.assertEqual(j["completed"], 10, j["errors"])
        self.assertIn("Prompt words whose prefix was sent before", r.stdout)
        self.assertIn("Prompt tokens from prefix cache:", r.stdout)
        self.assertGreaterEqual(j["prefix_cache_hit_rate"], 0)
        self.assertLessEqual(j["total_cached_input_tokens"], j["total_input_tokens"])

    def test_sweep_reports_attainment_per_rate(self):
        out = os.path.join(self.tmp.name, "sweep.json")
        r = subprocess.run([h.CLEAVE, "bench", "sweep", "--base-url", self.serve.url.rstrip("/"),
                            "--dataset", "preset:chat", "--scale", "0.02", "--num-prompts", "6",
                            "--rates", "4,8", "--goodput", "ttft:60000", "--per-worker", "2",
                            "--max-duration", "60", "--no-progress", "--save-result", out],
                           capture_output=True, text=True, timeout=150)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("attainment", r.stdout)
        with open(out) as f:
            j = json.load(f)
        self.assertEqual([p["request_rate"] for p in j["points"]], [4, 8])
        for p in j["points"]:
            self.assertEqual(p["completed"] + p["failed"], 6)
            self.assertGreaterEqual(p["slo_attainment"], 0.0)
            self.assertLessEqual(p["slo_attainment"], 1.0)
            self.assertAlmostEqual(p["request_goodput_per_worker"], p["request_goodput"] / 2)
        self.assertIn(j["best_rate"], [0, 4, 8])
        self.assertAlmostEqual(j["best_rate_per_worker"], j["best_rate"] / 2)
        r = subprocess.run([h.CLEAVE, "bench", "sweep", "--base-url", self.serve.url.rstrip("/"),
                            "--rates", "4,x"], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2)
        self.assertIn("'x'", r.stderr)

    def test_bad_flags_name_the_value(self):
        r = self.bench("--dataset", "preset:poetry")
        self.assertEqual(r.returncode, 2)
        self.assertIn("poetry", r.stderr)
        r = self.bench("--request-rate", "fast")
        self.assertEqual(r.returncode, 2)
        self.assertIn("fast", r.stderr)
        r = self.bench("--goodput", "ttfx:5")
        self.assertEqual(r.returncode, 2)
        self.assertIn("ttfx", r.stderr)
        r = subprocess.run([h.CLEAVE, "bench", "serve", "--base-url", "ftp://127.0.0.1:1"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2)
        self.assertIn("ftp://", r.stderr)

    def test_head_probe_keeps_the_connection_intact(self):
        u = urllib.parse.urlparse(self.serve.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        try:
            for path in ["/metrics", "/health", "/v1/models", "/v1/completions"]:
                conn.request("HEAD", path)
                resp = conn.getresponse()
                self.assertEqual(resp.status, 405 if path == "/v1/completions" else 200, path)
                self.assertEqual(resp.read(), b"")
                conn.request("GET", "/health")
                resp = conn.getresponse()
                self.assertEqual(resp.status, 200, f"GET after HEAD {path}")
                self.assertEqual(json.loads(resp.read())["status"], "ok")
        finally:
            conn.close()


class IdleConnectionTest(unittest.TestCase):
    """A server that closes idle keep-alive connections quickly (router.idle_timeout_ms):
    every idle connection the bench holds is closed when the next burst comes."""

    @classmethod
    def setUpClass(cls):
        cls.serve = h.serve("--set", "router.idle_timeout_ms=300", name="serve-idle")
        cls.tmp = tempfile.TemporaryDirectory(prefix="cleave-bench-idle-")

    @classmethod
    def tearDownClass(cls):
        cls.serve.stop()
        cls.tmp.cleanup()

    def test_server_closes_an_idle_connection(self):
        u = urllib.parse.urlparse(self.serve.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            self.assertEqual(resp.status, 200)
            resp.read()
            time.sleep(1.0)
            conn.sock.settimeout(5)
            self.assertEqual(conn.sock.recv(1), b"")  # closed by the server, not by the timeout
        finally:
            conn.close()

    def test_bursts_after_idle_connections_closed(self):
        # Three at once open three connections; 1.5 s later the server has closed all three, and
        # the one request then must not fail on them (the bench drops them, or retries on a new
        # connection, never on another idle one); the same again 1.5 s after it.
        trace = os.path.join(self.tmp.name, "bursts.jsonl")
        with open(trace, "w") as f:
            for i, t in enumerate([0, 0, 0, 1500, 3000]):
                f.write(json.dumps({"timestamp": t, "input_length": 48, "output_length": 4,
                                    "hash_ids": [i]}) + "\n")
        out = os.path.join(self.tmp.name, "bursts.json")
        r = subprocess.run([h.CLEAVE, "bench", "serve", "--base-url", self.serve.url.rstrip("/"),
                            "--dataset", "trace:" + trace, "--max-duration", "60",
                            "--request-timeout", "30", "--no-progress", "--save-result", out],
                           capture_output=True, text=True, timeout=90)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(out) as f:
            j = json.load(f)
        self.assertEqual(j["completed"], 5, j["errors"])
        self.assertEqual(j["failed"], 0, j["errors"])


if __name__ == "__main__":
    h.harness_main()
