"""End-to-end: a small `cleave tune` on stories260K (two candidates, two sweep runs each, a
handful of requests per run), then `cleave serve --config` on the YAML it wrote, unchanged,
answering a completion. Checks the table, the chart and the confirmation line, not timings.

Usage: python3 serve_tune_test.py CLEAVE_BINARY MODELS_DIR
"""

import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402


class ServeTuneTest(unittest.TestCase):
    def test_small_tune_then_serve_its_config(self):
        with tempfile.TemporaryDirectory(prefix="cleave-tune-e2e-") as tmp:
            out = os.path.join(tmp, "tuned.yaml")
            r = subprocess.run([h.CLEAVE, "tune", "--model", h.model_path(),
                                "--workload", "preset:chat", "--scale", "0.02",
                                "--num-prompts", "6", "--slo", "ttft:60000,tpot:60000",
                                "--workers", "2", "--max-candidates", "2", "--max-runs", "2",
                                "--start-rate", "2", "--min-run-seconds", "0", "--budget-minutes", "4",
                                "--out", out],
                               capture_output=True, text=True, timeout=280)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("**recommended**", r.stdout)
            self.assertIn("Confirmation run:", r.stdout)
            self.assertIn("The search took", r.stdout)
            # Breadth first: both candidates are probed before either is swept.
            steps = [l.split(": ")[-1] for l in r.stderr.splitlines()
                     if l.startswith("cleave tune: candidate")]
            self.assertEqual([s.split(" at ")[0] for s in steps][:2], ["probe", "probe"], r.stderr)
            self.assertIn("sweep", steps, r.stderr)
            rows = [l for l in r.stdout.splitlines() if l.startswith("| ") and l[2].isdigit()]
            self.assertEqual(len(rows), 2, r.stdout)
            with open(os.path.join(tmp, "tuned.svg")) as f:
                svg = f.read()
            self.assertTrue(svg.startswith("<svg") and svg.rstrip().endswith("</svg>"))
            with open(os.path.join(tmp, "tuned.md")) as f:
                self.assertIn("**recommended**", f.read())
            with open(out) as f:
                yaml = f.read()
            self.assertIn("router:", yaml)
            self.assertIn(h.model_path(), yaml)

            serve = h.Process(["serve", "--config", out, "--host", "127.0.0.1", "--port", "0",
                               "--grpc-port", "0"], "tuned-serve")
            try:
                status, body = serve.post("/v1/completions", {"prompt": "Once upon a time",
                                                              "max_tokens": 4,
                                                              "temperature": 0})
                self.assertEqual(status, 200, body)
            finally:
                serve.stop()


if __name__ == "__main__":
    h.harness_main()
