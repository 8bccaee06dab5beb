"""End-to-end: 200 concurrent streaming requests through `cleave serve` (stories260K,
disaggregated) all complete within a bound, 20 more are dropped by their client mid-stream,
and afterwards every worker's KV blocks are free again (the router's per-pool KV usage, from
the workers' load reports, is back to 0 with every worker ready) and nothing is running.

Usage: python3 serve_concurrency_test.py CLEAVE_BINARY MODELS_DIR
"""

import concurrent.futures
import os
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402

STREAMS = 200
DROPPED = 20
TIME_BOUND_S = 120.0


class ServeConcurrencyTest(unittest.TestCase):
    def test_200_concurrent_streams_then_blocks_free(self):
        serve = h.serve("--set", "router.io_threads=2")
        try:
            self.run_load(serve)
        finally:
            serve.stop()

    def run_load(self, serve):
        client = h.client(serve, timeout=TIME_BOUND_S)
        model = client.models.list().data[0].id
        h.warm_up_client(client, model)
        prompts = ["Once upon a time", "The little dog", "Lily and Ben", "One day, a bird",
                   "Tom had a red ball"]
        barrier = threading.Barrier(STREAMS + DROPPED)

        def stream_one(i):
            barrier.wait()
            resp = client.completions.create(
                model=model, prompt=prompts[i % len(prompts)] + f" {i}", max_tokens=24,
                temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True})
            text, finish, usage = "", None, None
            for chunk in resp:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    text += c.text or ""
                    finish = c.finish_reason or finish
            return text, finish, usage

        def drop_one(i):
            barrier.wait()
            resp = client.completions.create(
                model=model, prompt=f"A long story {i}", max_tokens=1000, temperature=0.8,
                seed=i, stream=True, extra_body={"ignore_eos": True})
            got = 0
            for _ in resp:
                got += 1
                if got == 3:
                    break
            resp.close()  # the client disconnects mid-stream
            return got

        # The pools' KV usage while the load runs: it must rise above 0, so that its return to
        # 0 below means the blocks were given back.
        peak = {"decode": 0.0}
        sampling = threading.Event()

        def sample():
            while not sampling.is_set():
                v = serve.metric("cleave:kv_cache_usage_perc", pool="decode") or 0.0
                peak["decode"] = max(peak["decode"], v)
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(STREAMS + DROPPED) as pool:
            streams = [pool.submit(stream_one, i) for i in range(STREAMS)]
            drops = [pool.submit(drop_one, i) for i in range(DROPPED)]
            done, pending = concurrent.futures.wait(streams + drops, timeout=TIME_BOUND_S)
            self.assertFalse(pending, f"{len(pending)} requests still running after "
                                      f"{TIME_BOUND_S} s")
        elapsed = time.monotonic() - start
        sampling.set()
        sampler.join()
        self.assertGreater(peak["decode"], 0.0, "the decode pool's KV usage never rose")
        for f in streams:
            text, finish, usage = f.result()
            self.assertIn(finish, ("stop", "length"))
            self.assertIsNotNone(usage)
            self.assertGreaterEqual(usage.completion_tokens, 1)
            self.assertLessEqual(usage.completion_tokens, 24)
            if finish == "length":
                self.assertEqual(usage.completion_tokens, 24)
        for f in drops:
            self.assertEqual(f.result(), 3)
        print(f"{STREAMS} streams (+{DROPPED} dropped) in {elapsed:.1f} s, peak decode KV usage "
              f"{peak['decode']:.4f}", file=sys.stderr)

        # Every worker's blocks back to free: the pools' KV usage (blocks held by requests,
        # reservations and transfers over the ready workers) is 0 with every worker ready.
        pools = {"prefill": 1, "decode": 1}
        deadline = time.monotonic() + 15
        while True:
            m = serve.metrics()
            usage = {p: m.get(("cleave:kv_cache_usage_perc", frozenset({("pool", p)})))
                     for p in pools}
            ready = {p: m.get(("cleave:pool_workers_ready", frozenset({("pool", p)})))
                     for p in pools}
            running = m.get(("cleave:num_requests_running", frozenset()))
            waiting = m.get(("cleave:num_requests_waiting", frozenset()))
            settled = (all(usage[p] == 0 for p in pools) and
                       all(ready[p] == pools[p] for p in pools) and running == 0 and
                       waiting == 0)
            if settled:
                break
            if time.monotonic() > deadline:
                self.fail(f"not settled 15 s after the load: kv usage {usage}, workers ready "
                          f"{ready}, running {running}, waiting {waiting}")
            time.sleep(0.2)
        # The server still answers.
        r = client.completions.create(model=model, prompt="", max_tokens=200, temperature=0)
        self.assertEqual(r.choices[0].text, h.golden_text())


if __name__ == "__main__":
    h.harness_main()
