"""End-to-end: a decode worker killed (SIGKILL) under load, `cleave serve` with
pools.decode.replicas=2 and router.policy_decode=round_robin, at a moment its own load report
(GetLoad, over grpcio) shows it decoding. No request hangs; requests that had not started streaming when the
worker died succeed on the other worker; the streams that were on it end with an error event;
serve restarts the worker on its address and the router takes it back.

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
        # /health needs one ready worker per pool; round_robin over both needs both ready.
        ready_until = time.monotonic() + 30
        while serve.metric("cleave:pool_workers_ready", pool="decode") != 2:
            self.assertLess(time.monotonic(), ready_until, "both decode workers never got ready")
            time.sleep(0.05)
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
            chunk or None)."""
            started, first_at = False, None
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
                if finish not in ("length", "stop"):
                    return "no_finish_reason", first_at
                return "ok", first_at
            except openai.APIError as e:
                kind = "error_after_start" if started else "error_before_start"
                return f"{kind}: {type(e).__name__}: {e}", first_at

        url = urllib.parse.urlsplit(serve.url)

        def raw_stream(i, max_tokens):
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
                    return f"error_before_start: HTTP {resp.status}: {resp.read()[:400]}", None
                first_at = time.monotonic()
                streams_started.release()
                data = b""
                while True:
                    piece = resp.read1(1 << 16)
                    if not piece:
                        break
                    data += piece
            except OSError as e:
                return f"connection error: {e}", None
            finally:
                conn.close()
            events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return f"stream without [DONE]: {events[-2:]}", first_at
            payloads = [json.loads(e) for e in events[:-1]]
            if "error" in payloads[-1]:
                return f"error_after_start: {payloads[-1]['error']['message']}", first_at
            if payloads[-1]["choices"][0]["finish_reason"] not in ("length", "stop"):
                return "no_finish_reason", first_at
            return "ok", first_at

        with concurrent.futures.ThreadPoolExecutor(ROUNDS * BEFORE + AFTER) as pool:
            # Kill as soon as the victim is decoding some of the streams (its own load report says
            # so; round_robin put half of them there): the kill lands mid-stream however the
            # machine's load spreads the first tokens, and streams not started yet are retried
            # on the other worker.
            # Wait until more streams have their first token than one worker can hold (round_robin
            # gives each worker BEFORE / 2): then the victim has a started stream, which must end
            # with an error event. A load report alone (running >= 1) could come while every
            # stream on the victim was still before its first token; those are retried, rightly,
            # and the scenario did not happen (seen once in six runs).
            # stories260K streams are short: on a loaded CI run every stream of a round has ended
            # before this thread polled once. Such a round is not the scenario; it must still
            # have succeeded whole, and a new round starts (at most ROUNDS).
            running_until = time.monotonic() + BOUND_S
            victim_id, before, earlier = None, [], []
            for round_no in range(ROUNDS):
                earlier += before
                before = [pool.submit(raw_stream, round_no * BEFORE + i, 1900)
                          for i in range(BEFORE)]
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
                    break
                print(f"round {round_no}: every stream ended before a decode worker was seen "
                      "decoding; another round", file=sys.stderr)
                for _ in range(BEFORE - (BEFORE // 2 + 2)):  # the rest of this round's starts
                    streams_started.acquire(timeout=0)
            self.assertIsNotNone(victim_id, f"no decode worker was seen decoding in {ROUNDS} "
                                 "rounds of streams")
            victim_pid = workers[victim_id][1]
            os.kill(victim_pid, signal.SIGKILL)
            kill_time = time.monotonic()
            after = [pool.submit(one, 100000 + i, 32) for i in range(AFTER)]
            done, pending = concurrent.futures.wait(earlier + before + after, timeout=BOUND_S)
            self.assertFalse(pending, f"{len(pending)} requests hang {BOUND_S} s after the kill")
            before_outcomes = [f.result() for f in before]
            after_outcomes = [f.result() for f in after]
            for f in earlier:  # rounds that ended before any kill: all whole
                self.assertEqual(f.result()[0], "ok", "a stream failed with no worker killed")
        print(f"all requests ended {time.monotonic() - kill_time:.1f} s after the kill",
              file=sys.stderr)

        errors_mid_stream = 0
        for outcome, first_at in before_outcomes + after_outcomes:
            if outcome.startswith("error_after_start"):
                # Only a stream that was already running on the killed worker may fail (its
                # first token may reach this client a moment after the kill).
                self.assertLess(first_at, kill_time + 2.0, outcome)
                errors_mid_stream += 1
            else:
                self.assertEqual(outcome, "ok")
        for outcome, _ in after_outcomes:
            self.assertEqual(outcome, "ok", "a request sent after the kill failed")
        print(f"{errors_mid_stream} of {len(before_outcomes)} streams ended with an error "
              f"event, {AFTER} requests sent after the kill succeeded", file=sys.stderr)
        self.assertGreater(errors_mid_stream, 0,
                           "no stream was on the killed worker: the scenario did not happen")
        self.assertLess(errors_mid_stream, len(before_outcomes), "every stream failed")

        # serve restarts the worker (same address) and the router takes it back.
        deadline = time.monotonic() + 30
        while True:
            w = serve.workers()
            restarted = w[victim_id][1] != victim_pid
            ready = serve.metric("cleave:pool_workers_ready", pool="decode")
            if restarted and ready == 2:
                break
            if time.monotonic() > deadline:
                self.fail(f"{victim_id} not back: restarted={restarted}, decode ready={ready}\n"
                          + "\n".join(serve.stdout_lines()))
            time.sleep(0.2)
        self.assertEqual(w[victim_id][2], workers[victim_id][2])
        self.assertTrue(any(line.startswith(f"worker decode {victim_id} pid {victim_pid} exited")
                            for line in serve.stdout_lines()))
        r = client.completions.create(model=model, prompt="", max_tokens=200, temperature=0)
        self.assertEqual(r.choices[0].text, h.golden_text())


if __name__ == "__main__":
    h.harness_main()
