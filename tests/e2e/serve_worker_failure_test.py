"""End-to-end: a decode worker killed (SIGKILL) under load, `cleave serve` with
pools.decode.replicas=2 and router.policy_decode=round_robin, at a moment its own load report
(GetLoad, over grpcio) shows it decoding. No request hangs; requests that had not started
streaming when the worker died succeed on the other worker; the streams that were on it are
migrated (router.max_migrations): they complete, with exactly the text of an undisturbed run of
the same seeded request (rerun afterwards), and cleave:migrations_total{outcome="resumed"} counts
them; serve restarts the worker on its address and the router takes it back.

The flake of old ("no stream ended with an error although the killed worker had reported a
running request"): the router never ended or retried a started stream silently. The victim's
load report is the engine's snapshot after its previous step, and the streams of a round all
have the same length and run in one batch, so they end in the same step: a report of
"running" could come when every started stream on the victim had just ended (the kill then cut
nothing), with the victim's other streams still before their first token (retried, rightly).
Such a kill is not the scenario: the test now sees it (no migration counted), waits for the
restart and tries again (at most KILLS times), instead of failing on it.

Usage: python3 serve_worker_failure_test.py CLEAVE_BINARY MODELS_DIR
"""

import concurrent.futures
import http.client
import json
import os
import signal
import sys
import tempfile
import threading
import time
import unittest
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_harness as h  # noqa: E402

BEFORE = 12   # long streams running when the worker is killed
AFTER = 16    # requests sent right after it
ROUNDS = 3    # rounds of BEFORE streams, until one is seen running on a worker
BOUND_S = 90.0
KILLS = 3     # kills until one lands on streams mid-way (see above)


class ServeWorkerFailureTest(unittest.TestCase):
    def test_kill_decode_worker_under_load(self):
        # round_robin: requests alternate between the two decode workers, so that streams are
        # on the victim when it dies and requests sent after it are first sent there.
        serve = h.serve("--set", "pools.decode.replicas=2",
                        "--set", "router.policy_decode=round_robin")
        try:
            self.run_kill(serve)
            # serve itself SIGKILLed: its workers follow (PR_SET_PDEATHSIG), none is left.
            pids = [pid for _, pid, _ in serve.workers().values()]
            os.kill(serve.proc.pid, signal.SIGKILL)
            serve.proc.wait(timeout=10)
            for pid in pids:
                self.assertTrue(h.wait_gone(pid, 15), f"worker {pid} outlived a killed serve")
        finally:
            serve.kill()

    def run_kill(self, serve):
        import openai
        client = h.client(serve, timeout=BOUND_S)
        model = client.models.list().data[0].id
        h.warm_up_client(client, model)
        workers = serve.workers()
        self.assertEqual(sorted(w for w in workers if workers[w][0] == "decode"),
                         ["decode-0", "decode-1"])
        self.wait_both_decoders_ready(serve)
        import grpc
        stubs_dir = tempfile.TemporaryDirectory(prefix="cleave-worker-stubs-")
        self.addCleanup(stubs_dir.cleanup)
        worker_pb2, worker_pb2_grpc = h.grpc_stubs(stubs_dir.name, "worker")
        decoders = {}
        for wid in ("decode-0", "decode-1"):
            channel = grpc.insecure_channel(workers[wid][2])
            self.addCleanup(channel.close)
            decoders[wid] = worker_pb2_grpc.WorkerStub(channel)
        streams_started = threading.Semaphore(0)

        def one(i, max_tokens):
            """('ok' | 'error_after_start: ...' | 'error_before_start: ...', time of the first
            chunk or None, text)."""
            started, first_at, text = False, None, ""
            try:
                resp = client.completions.create(
                    model=model, prompt=f"Once upon a time {i}", max_tokens=max_tokens,
                    temperature=0.7, seed=i, stream=True, extra_body={"ignore_eos": True})
                finish = None
                for chunk in resp:
                    if not started:
                        started = True
                        first_at = time.monotonic()
                    for c in chunk.choices:
                        finish = c.finish_reason or finish
                        text += c.text or ""
                if finish not in ("length", "stop"):
                    return "no_finish_reason", first_at, text
                return "ok", first_at, text
            except openai.APIError as e:
                kind = "error_after_start" if started else "error_before_start"
                return f"{kind}: {type(e).__name__}: {e}", first_at, text

        url = urllib.parse.urlsplit(serve.url)

        def raw_stream(i, max_tokens, signal_start=True):
            """one() over plain http.client, which reads a stream far faster than the openai
            client parses it: the load is then bounded by the server, not by this process."""
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=BOUND_S)
            try:
                body = json.dumps({"model": model, "prompt": f"Once upon a time {i}",
                                   "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
                                   "stream": True, "ignore_eos": True})
                conn.request("POST", "/v1/completions", body,
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()  # the head comes with the first token
                if resp.status != 200:
                    return (f"error_before_start: HTTP {resp.status}: {resp.read()[:400]}", None,
                            "")
                first_at = time.monotonic()
                if signal_start:
                    streams_started.release()
                data = b""
                while True:
                    piece = resp.read1(1 << 16)
                    if not piece:
                        break
                    data += piece
            except OSError as e:
                return f"connection error: {e}", None, ""
            finally:
                conn.close()
            events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return f"stream without [DONE]: {events[-2:]}", first_at, ""
            payloads = [json.loads(e) for e in events[:-1]]
            text = "".join(c["text"] for p in payloads for c in p.get("choices", []))
            if "error" in payloads[-1]:
                return f"error_after_start: {payloads[-1]['error']['message']}", first_at, text
            if payloads[-1]["choices"][0]["finish_reason"] not in ("length", "stop"):
                return "no_finish_reason", first_at, text
            return "ok", first_at, text

        def resumed():
            return serve.metric("cleave:migrations_total", outcome="resumed") or 0

        with concurrent.futures.ThreadPoolExecutor(ROUNDS * BEFORE + AFTER) as pool:
            for kill_no in range(KILLS):
                migrated_before = resumed()
                victim_id, victim_pid, kill_time, before, after, earlier = \
                    self.kill_one_mid_stream(pool, decoders, worker_pb2, workers, serve,
                                             raw_stream, one, streams_started)
                migrated = resumed() - migrated_before
                if migrated > 0:
                    break
                # The kill cut no stream (the victim's streams had all ended, its report was a
                # step old): not the scenario. Everything must have succeeded all the same.
                for f in earlier + before + after:
                    self.assertEqual(f.result()[0], "ok", "a request failed")
                print(f"kill {kill_no}: {victim_id} was killed when no stream was mid-way on it; "
                      "waiting for its restart and killing again", file=sys.stderr)
                self.wait_restarted(serve, victim_id, victim_pid, workers)
                workers = serve.workers()
                for wid in decoders:
                    channel = grpc.insecure_channel(workers[wid][2])
                    self.addCleanup(channel.close)
                    decoders[wid] = worker_pb2_grpc.WorkerStub(channel)
            self.assertGreater(migrated, 0, f"{KILLS} kills and none landed mid-stream")
            before_outcomes = [f.result() for f in before]
            after_outcomes = [f.result() for f in after]
            for f in earlier:  # rounds that ended before any kill: all whole
                self.assertEqual(f.result()[0], "ok", "a stream failed with no worker killed")
        print(f"all requests ended {time.monotonic() - kill_time:.1f} s after the kill; "
              f"{migrated:.0f} streams were migrated", file=sys.stderr)
        # Every request completes: those not started were retried, those started were migrated.
        for outcome, _, _ in before_outcomes + after_outcomes:
            self.assertEqual(outcome, "ok")

        self.wait_restarted(serve, victim_id, victim_pid, workers)
        self.assertEqual(serve.workers()[victim_id][2], workers[victim_id][2])
        self.assertTrue(any(line.startswith(f"worker decode {victim_id} pid {victim_pid} exited")
                            for line in serve.stdout_lines()))
        # The undisturbed run of the same seeded requests (both workers back) gives the same
        # text, byte for byte: the migrated streams lost and repeated nothing.
        with concurrent.futures.ThreadPoolExecutor(BEFORE) as rerun_pool:
            reruns = [rerun_pool.submit(raw_stream, self.kill_round_first + i, 1900, False)
                      for i in range(len(before_outcomes))]
        for i, (f, (_, _, text)) in enumerate(zip(reruns, before_outcomes)):
            outcome, _, want = f.result()
            self.assertEqual(outcome, "ok", f"rerun of stream {i}")
            self.assertEqual(text, want, f"stream {i}: the text differs from an undisturbed run")
        r = client.completions.create(model=model, prompt="", max_tokens=200, temperature=0)
        self.assertEqual(r.choices[0].text, h.golden_text())

    def wait_both_decoders_ready(self, serve):
        # /health needs one ready worker per pool; round_robin over both needs both ready.
        ready_until = time.monotonic() + 30
        while serve.metric("cleave:pool_workers_ready", pool="decode") != 2:
            self.assertLess(time.monotonic(), ready_until, "both decode workers never got ready")
            time.sleep(0.05)

    def wait_restarted(self, serve, victim_id, victim_pid, workers):
        """serve restarts the worker (same address) and the router takes it back."""
        deadline = time.monotonic() + 30
        while True:
            w = serve.workers()
            restarted = w[victim_id][1] != victim_pid
            ready = serve.metric("cleave:pool_workers_ready", pool="decode")
            if restarted and ready == 2:
                return
            if time.monotonic() > deadline:
                self.fail(f"{victim_id} not back: restarted={restarted}, decode ready={ready}\n"
                          + "\n".join(serve.stdout_lines()))
            time.sleep(0.2)

    def kill_one_mid_stream(self, pool, decoders, worker_pb2, workers, serve, raw_stream, one,
                            streams_started):
        """Rounds of BEFORE long streams until a decode worker is seen decoding; kills it and
        sends AFTER requests; waits for all. (victim id, its pid, kill time, the kill round's
        futures, the AFTER futures, the earlier rounds' futures)."""
        # Kill as soon as the victim is decoding some of the streams (its own load report says
        # so; round_robin put half of them there): the kill lands mid-stream however the
        # machine's load spreads the first tokens, and streams not started yet are retried on
        # the other worker. Wait until more streams have their first token than one worker can
        # hold (round_robin gives each worker BEFORE / 2): then the victim has a started stream.
        # stories260K streams are short: on a loaded CI run every stream of a round has ended
        # before this thread polled once. Such a round is not the scenario; it must still have
        # succeeded whole, and a new round starts (at most ROUNDS).
        running_until = time.monotonic() + BOUND_S
        victim_id, before, earlier = None, [], []
        base = getattr(self, "next_stream", 0)
        for round_no in range(ROUNDS):
            earlier += before
            first = base + round_no * BEFORE
            before = [pool.submit(raw_stream, first + i, 1900) for i in range(BEFORE)]
            for _ in range(BEFORE // 2 + 2):
                left = max(0.0, running_until - time.monotonic())
                self.assertTrue(streams_started.acquire(timeout=left),
                                "the streams never started")
            # The victim is the first decode worker seen decoding.
            while victim_id is None and not all(f.done() for f in before):
                for wid, stub in decoders.items():
                    if stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=10).running >= 1:
                        victim_id = wid
                        break
                else:
                    self.assertLess(time.monotonic(), running_until,
                                    "no decode worker ever ran a stream")
                    time.sleep(0.005)
            if victim_id is not None:
                self.kill_round_first = first
                break
            print(f"round {round_no}: every stream ended before a decode worker was seen "
                  "decoding; another round", file=sys.stderr)
            for _ in range(BEFORE - (BEFORE // 2 + 2)):  # the rest of this round's starts
                streams_started.acquire(timeout=0)
        self.next_stream = base + ROUNDS * BEFORE
        self.assertIsNotNone(victim_id, f"no decode worker was seen decoding in {ROUNDS} "
                             "rounds of streams")
        victim_pid = serve.workers()[victim_id][1]
        os.kill(victim_pid, signal.SIGKILL)
        kill_time = time.monotonic()
        after = [pool.submit(one, 100000 + self.next_stream + i, 32) for i in range(AFTER)]
        _, pending = concurrent.futures.wait(earlier + before + after, timeout=BOUND_S)
        self.assertFalse(pending, f"{len(pending)} requests hang {BOUND_S} s after the kill")
        # The rest of the kill round's starts, so that the next kill's rounds count their own.
        while streams_started.acquire(timeout=0):
            pass
        return victim_id, victim_pid, kill_time, before, after, earlier


if __name__ == "__main__":
    h.harness_main()
