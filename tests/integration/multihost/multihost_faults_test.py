"""Multi-host fault tests: the router, two prefill and two decode workers, each a "host" of its
own (a network namespace with its own address, all on one bridge; netns_hosts.py), the KV moving
over tcp;ofi_rxm between them, real `cleave router` and `cleave worker` processes on
stories260K. Under load (bounded: a fixed number of requests, each with a deadline) each case
injects one fault:

  loss        1% of the packets of every host dropped (nftables)
  latency     2 ms added to what every host sends (tc netem, or where the kernel has none the
              delay line of netns_hosts.py); checked by a round-trip time before and after
  partition   prefill-0 and decode-0 cut apart while transfers run, healed after 2.5 s
  kill        SIGKILL of prefill-0, then (own case) of decode-0

and checks: no request hangs (each ends within its deadline); a request that something could
still serve completes with exactly the text of an undisturbed run (greedy and seeded requests:
the reference texts are taken from a fault-free round first); a request that cannot be served
ends with a clear error; every surviving worker ends with all KV blocks free (no used, reserved
or pinned block, no reservation). The figures of each case (time to detect, time to recover,
requests retried, failed) are printed on stderr.

A stream whose decode side fails after its first token (decode-0 killed mid-stream, or its KV
notice cut off by the partition so that decode-0's lease ends it) is migrated by the router
(issue 18: router.max_migrations): the prompt and the tokens delivered so far go to another
prefill + decode, and the stream completes. So in every case every request completes with the
undisturbed text; the kill-decode case strikes while decode-0 reports a running request and
prints how many streams were migrated (cleave:migrations_total{outcome="resumed"}).

Usage: python3 multihost_faults_test.py CLEAVE_BINARY MODELS_DIR   (exit 77: skipped)
"""

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns_hosts  # noqa: E402

SKIP = 77
CLEAVE = MODELS = None
HOSTS = ["router", "prefill-0", "prefill-1", "decode-0", "decode-1"]
GRPC_PORT, METRICS_PORT, HTTP_PORT = 7001, 9100, 8000
PROMPTS = 32           # distinct requests (prompt and sampling), their texts taken fault-free
CLIENTS = 8            # requests in flight during a case's load
LOAD_S = 4.0           # each case's load: CLIENTS loops sending requests for this long...
MAX_REQUESTS = 2000    # ...or until this many were sent
FAULT_AT_S = 0.5       # the fault comes this long into the load
MAX_TOKENS = 48
REQUEST_TIMEOUT_S = 30  # router.request_timeout_ms: the bound on a request's first token
DEADLINE_S = 60         # no request of a case may take longer than this (else: it hangs)
BLOCKS_FREE_S = 20      # surviving pools have every block free this long after the load


def prompt_of(i):
    return f"Once upon a time {i}"


def sampling_of(i):
    # Even requests greedy, odd ones seeded sampling: both must reproduce exactly.
    return {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i}


class Proc:
    """One `cleave` process inside a host's namespace: stdout lines collected, stderr in a file."""

    def __init__(self, host, args, ready_line):
        self.host = host
        self.log = tempfile.NamedTemporaryFile(prefix=f"cleave-{host.name}-", suffix=".log",
                                               delete=False)
        self.lines = []
        self.proc = subprocess.Popen(host.exec_args([CLEAVE] + args), stdout=subprocess.PIPE,
                                     stderr=self.log, stdin=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if ready_line in line:
                    ready.set()
        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 60
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{host.name} did not start:\n{self.tail()}")

    def tail(self, n=40):
        with open(self.log.name, errors="replace") as f:
            return f"--- {self.host.name}:\n" + "".join(f.readlines()[-n:])

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close()

    def _close(self):
        if self.proc.stdout and not self.proc.stdout.closed:
            try:
                self.proc.stdout.close()
            except OSError:
                pass
        self.log.close()


def start_worker(host, role):
    return Proc(host, [
        "worker", "--set", f"worker.role={role}",
        "--set", f"model.path={os.path.join(MODELS, 'stories260K.gguf')}",
        "--set", f"worker.listen={host.ip}:{GRPC_PORT}",
        "--set", f"worker.id={host.name}",
        "--set", f"worker.metrics_port={METRICS_PORT}",
        "--set", "worker.lease_ms=5000",
        "--set", "engine.kv_cache_bytes=33554432",
        "--set", "transfer.provider=tcp;ofi_rxm",
        "--set", f"transfer.node={host.ip}",
        "--set", "transfer.completion_timeout_ms=2000",
    ], "listening on")


def start_router(topo):
    r = topo["router"]
    pools = {pool: ",".join(f"{topo[f'{pool}-{k}'].ip}:{GRPC_PORT}" for k in (0, 1))
             for pool in ("prefill", "decode")}
    return Proc(r, [
        "router", "--set", f"model.path={os.path.join(MODELS, 'stories260K.gguf')}",
        "--set", f"router.host={r.ip}", "--set", f"router.port={HTTP_PORT}",
        "--set", "router.grpc_port=-1", "--set", "router.served_model_name=stories260K",
        "--set", f"pools.prefill.workers={pools['prefill']}",
        "--set", f"pools.decode.workers={pools['decode']}",
        # round_robin on both: prefill-0 pairs with decode-0, so the partitioned pair is used.
        "--set", "router.policy_prefill=round_robin",
        "--set", "router.policy_decode=round_robin",
        "--set", "router.health_interval_ms=200",
        "--set", "router.health_timeout_ms=500",
        "--set", f"router.request_timeout_ms={REQUEST_TIMEOUT_S * 1000}",
    ], "cleave router listening on")


def http_json(host_ip, port, method, path, body=None, timeout=10):
    conn = http.client.HTTPConnection(host_ip, port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"} if body is not None else {})
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


def metrics(host_ip, port):
    """{name: value} of the unlabelled (or first-labelled) samples of GET /metrics."""
    status, text = http_json(host_ip, port, "GET", "/metrics")
    if status != 200:
        raise AssertionError(f"{host_ip}:{port}/metrics answered {status}")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, _, value = line.rpartition(" ")
            out.setdefault(name_labels, float(value))
            out.setdefault(name_labels.split("{")[0] + "#sum", 0.0)
            out[name_labels.split("{")[0] + "#sum"] += float(value)
    return out


def stream_completion(router_ip, i, deadline_s, on_first_token=None):
    """(outcome, text, first_token_at, seconds) of one streamed completion: outcome is 'ok',
    'error_after_start: MSG', 'error_before_start: MSG' or 'hang'. on_first_token() is called
    once the response head (which comes with the first token) is in."""
    t0 = time.monotonic()
    body = {"model": "stories260K", "prompt": prompt_of(i), "max_tokens": MAX_TOKENS,
            "stream": True, "ignore_eos": True, **sampling_of(i)}
    conn = http.client.HTTPConnection(router_ip, HTTP_PORT, timeout=deadline_s)
    first_at, text = None, []
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return (f"error_before_start: HTTP {resp.status} {resp.read()[:300]!r}", "", None,
                    time.monotonic() - t0)
        first_at = time.monotonic()
        if on_first_token:
            on_first_token()
        buf = b""
        while True:
            piece = resp.read1(1 << 16)
            if not piece:
                break
            buf += piece
    except (OSError, http.client.HTTPException) as e:
        kind = "hang" if isinstance(e, TimeoutError) else "connection_error"
        return f"{kind}: {e}", "", first_at, time.monotonic() - t0
    finally:
        conn.close()
    events = [ln[6:] for ln in buf.decode().split("\n") if ln.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"stream without [DONE]: {events[-2:]}", "", first_at, time.monotonic() - t0
    finish = None
    for e in events[:-1]:
        payload = json.loads(e)
        if "error" in payload:
            return (f"error_after_start: {payload['error'].get('message', '')}", "".join(text),
                    first_at, time.monotonic() - t0)
        for c in payload.get("choices", []):
            text.append(c.get("text", ""))
            finish = c.get("finish_reason") or finish
    if finish != "length":
        return f"finish {finish}", "".join(text), first_at, time.monotonic() - t0
    return "ok", "".join(text), first_at, time.monotonic() - t0


class Cluster:
    """The router and the four workers, each on its host, and probes of their /metrics."""

    def __init__(self, topo, probes):
        self.topo, self.probes = topo, probes
        self.workers, self.router = {}, None
        try:
            for name in HOSTS[1:]:
                self.workers[name] = start_worker(topo[name], name.split("-")[0])
            self.router = start_router(topo)
            self.wait_ready(2, 2)
        except Exception:
            self.stop()
            raise

    def stop(self):
        if self.router:
            self.router.stop()
        for w in self.workers.values():
            w.stop()

    def tails(self):
        procs = ([self.router] if self.router else []) + list(self.workers.values())
        return "\n".join(p.tail() for p in procs)

    def router_metrics(self):
        return self.probes.call(metrics, self.topo["router"].ip, HTTP_PORT)

    def worker_metrics(self, name):
        return self.probes.call(metrics, self.topo[name].ip, METRICS_PORT)

    def ready(self, pool):
        return self.router_metrics().get(f'cleave:pool_workers_ready{{pool="{pool}"}}', 0)

    def wait_ready(self, prefill, decode, timeout=30):
        deadline = time.monotonic() + timeout
        while (self.ready("prefill"), self.ready("decode")) != (prefill, decode):
            if time.monotonic() > deadline:
                raise AssertionError(f"router never saw {prefill} prefill and {decode} decode "
                                     f"workers ready\n{self.tails()}")
            time.sleep(0.1)


class MultiHostFaultTest(unittest.TestCase):
    topo = clients = probes = None
    reference = {}

    @classmethod
    def setUpClass(cls):
        cls.topo = netns_hosts.Topology(HOSTS)
        cls.clients = netns_hosts.NsThreadPool(cls.topo["router"], CLIENTS)
        cls.probes = netns_hosts.NsThreadPool(cls.topo["router"], 2)  # metrics, beside the load
        cluster = Cluster(cls.topo, cls.probes)
        try:
            # The undisturbed texts (and a check that the hosts talk at all).
            futures = [cls.clients.submit(stream_completion, cls.topo["router"].ip, i, DEADLINE_S)
                       for i in range(PROMPTS)]
            for i, f in enumerate(futures):
                outcome, text, _, _ = f.result(timeout=DEADLINE_S + 5)
                if outcome != "ok":
                    raise AssertionError(f"fault-free request {i}: {outcome}\n" + cluster.tails())
                cls.reference[i] = text
        finally:
            cluster.stop()

    @classmethod
    def tearDownClass(cls):
        if cls.clients:
            cls.clients.shutdown()
            cls.probes.shutdown()
        if cls.topo:
            cls.topo.close()

    def setUp(self):
        self.cluster = Cluster(self.topo, self.probes)

    def tearDown(self):
        self.topo.heal_all()
        self.cluster.stop()

    def load(self, fault=None):
        """CLIENTS loops send requests (request k: prompt k % PROMPTS) for LOAD_S seconds (at most
        MAX_REQUESTS); fault() is called FAULT_AT_S into it, with requests in flight. Returns
        ([(prompt id, outcome, text, first_at, secs, started_at)], fault time)."""
        lock, results, sent = threading.Lock(), [], [0]
        t0 = time.monotonic()

        def loop():
            while time.monotonic() - t0 < LOAD_S:
                with lock:
                    if sent[0] >= MAX_REQUESTS:
                        return
                    k = sent[0]
                    sent[0] += 1
                started_at = time.monotonic()
                r = stream_completion(self.topo["router"].ip, k % PROMPTS, DEADLINE_S)
                with lock:
                    results.append((k % PROMPTS,) + r + (started_at,))

        futures = [self.clients.submit(loop) for _ in range(CLIENTS)]
        fault_time = None
        if fault:
            time.sleep(max(0.0, t0 + FAULT_AT_S - time.monotonic()))
            fault_time = time.monotonic()
            fault()
        for f in futures:
            f.result(timeout=LOAD_S + DEADLINE_S + 10)
        return results, fault_time

    def assert_blocks_free(self, survivors):
        deadline = time.monotonic() + BLOCKS_FREE_S
        for name in survivors:
            while True:
                m = self.cluster.worker_metrics(name)
                held = {k: m.get(k, 0) for k in ("cleave:kv_blocks_used", "cleave:kv_blocks_reserved",
                                                  "cleave:kv_blocks_pinned", "cleave:kv_reservations")}
                if not any(held.values()):
                    break
                if time.monotonic() > deadline:
                    self.fail(f"{name} still holds KV blocks {BLOCKS_FREE_S} s after the load: "
                              f"{held}\n{self.cluster.tails()}")
                time.sleep(0.2)

    def assert_undisturbed(self, results, allowed_errors=lambda r: False):
        """Every result ok with the reference text, except those allowed_errors() accepts."""
        for i, outcome, text, first_at, secs, _ in results:
            self.assertLess(secs, DEADLINE_S, f"request {i} took {secs:.1f} s")
            if outcome == "ok":
                self.assertEqual(text, self.reference[i], f"request {i}: text differs from the "
                                 "undisturbed run")
            else:
                self.assertTrue(allowed_errors((i, outcome, text, first_at, secs)),
                                f"request {i}: {outcome}\n{self.cluster.tails()}")

    def figures(self, case, results, fault_time, before, detected_at=None):
        after = self.cluster.router_metrics()
        retries = after.get("cleave:router_dispatch_retries_total#sum", 0) - \
            before.get("cleave:router_dispatch_retries_total#sum", 0)
        failed = sum(1 for r in results if r[1] != "ok")
        line = (f"figures {case}: {len(results)} requests, {failed} ended with an error, "
                f"{retries:.0f} attempts retried, slowest {max(r[4] for r in results):.2f} s")
        if fault_time is not None:
            # Recovered: the first request sent after the fault that ended whole.
            ok_after = [r[5] + r[4] for r in results if r[5] > fault_time and r[1] == "ok"]
            self.assertTrue(ok_after, f"{case}: no request sent after the fault succeeded")
            line += f", recovered {min(ok_after) - fault_time:.2f} s after the fault"
            if detected_at is not None:
                line += f", detected {detected_at - fault_time:.2f} s after it"
        print(line, file=sys.stderr)

    def test_packet_loss(self):
        before = self.cluster.router_metrics()

        def fault():
            for h in self.topo.hosts.values():
                h.drop_randomly(1)
        results, t = self.load(fault)
        self.topo.heal_all()
        self.assert_undisturbed(results)
        self.figures("loss 1%", results, t, before)
        self.assert_blocks_free(HOSTS[1:])

    def test_latency(self):
        hosts = list(self.topo.hosts.values())
        base = netns_hosts.rtt_ms(self.topo["router"], self.topo["prefill-0"])
        how = {h.delay(2) for h in hosts}
        # Every host's sends are 2 ms late: a round trip between two hosts takes 4 ms more.
        rtt = {f"{a.name}->{b.name}": netns_hosts.rtt_ms(a, b) for a, b in
               ((self.topo["router"], self.topo["prefill-0"]),
                (self.topo["prefill-0"], self.topo["decode-0"]))}
        print(f"figures latency: added by {'/'.join(sorted(how))}; round trip {base:.2f} ms "
              f"before, " + ", ".join(f"{k} {v:.2f} ms" for k, v in rtt.items()) + " after",
              file=sys.stderr)
        for k, v in rtt.items():
            self.assertGreater(v, base + 3.5, f"{k}: the delay is not there")
            self.assertLess(v, base + 30, f"{k}: far more delay than 2 ms each way")
        before = self.cluster.router_metrics()
        results, t = self.load()
        self.topo.heal_all()
        self.assert_undisturbed(results)
        self.figures("latency 2 ms", results, t, before)
        self.assert_blocks_free(HOSTS[1:])

    def test_partition_prefill_from_decode(self):
        before = self.cluster.router_metrics()
        p0 = self.cluster.worker_metrics("prefill-0")
        heal = threading.Timer(2.5, lambda: (self.topo["prefill-0"].heal(),
                                             self.topo["decode-0"].heal()))

        def fault():
            self.topo["prefill-0"].partition_from(self.topo["decode-0"])
            self.topo["decode-0"].partition_from(self.topo["prefill-0"])
            heal.start()
        try:
            results, t = self.load(fault)
        finally:
            heal.cancel()
        self.topo.heal_all()
        # prefill-0's transfers to decode-0 failed: the scenario happened.
        p0_after = self.cluster.worker_metrics("prefill-0")
        failures = p0_after.get("cleave:kv_handoff_failures_total#sum", 0) - \
            p0.get("cleave:kv_handoff_failures_total#sum", 0)
        # A request whose first token came from prefill-0 but whose KV notice was cut off on its
        # way to decode-0 fails when decode-0's lease runs out; the router migrates it (to
        # decode-1, or to decode-0 once healed), so it too has the undisturbed text.
        self.assert_undisturbed(results)
        self.figures("partition prefill-0/decode-0", results, t, before)
        print(f"figures partition: {failures:.0f} handoffs of prefill-0 failed", file=sys.stderr)
        self.assertGreater(failures, 0, "no transfer crossed the partition: the scenario did "
                           "not happen")
        self.assert_blocks_free(HOSTS[1:])

    def kill_case(self, victim):
        before = self.cluster.router_metrics()
        pool = victim.split("-")[0]
        detected = [None]

        def fault():
            if pool == "decode":
                # Strike while it decodes (its own gauge says so, bounded), so that the kill is
                # likely to cut streams mid-way: those are the ones to migrate.
                until = time.monotonic() + 2.0
                while time.monotonic() < until and self.cluster.worker_metrics(victim).get(
                        "cleave:num_requests_running", 0) < 1:
                    time.sleep(0.002)
            self.cluster.workers[victim].kill()

            def watch():
                while self.cluster.ready(pool) != 1 and time.monotonic() - t0 < 15:
                    time.sleep(0.05)
                detected[0] = time.monotonic()
            t0 = time.monotonic()
            threading.Thread(target=watch, daemon=True).start()
        results, t = self.load(fault)
        return results, t, before, detected

    def test_kill_prefill_worker(self):
        results, t, before, detected = self.kill_case("prefill-0")
        self.assert_undisturbed(results)
        self.figures("SIGKILL prefill-0", results, t, before, detected[0])
        self.assert_blocks_free(["prefill-1", "decode-0", "decode-1"])

    def test_kill_decode_worker(self):
        results, t, before, detected = self.kill_case("decode-0")
        # The streams started on decode-0 are migrated and complete like every other request.
        self.assert_undisturbed(results)
        self.figures("SIGKILL decode-0", results, t, before, detected[0])
        after = self.cluster.router_metrics()
        migrated = after.get('cleave:migrations_total{outcome="resumed"}', 0) - \
            before.get('cleave:migrations_total{outcome="resumed"}', 0)
        # Short streams (MAX_TOKENS): the kill does not always cut one; when it does, the
        # migrated stream is among the undisturbed results above (the worker-level and e2e kill
        # tests make sure of a mid-stream kill).
        print(f"figures SIGKILL decode-0: {migrated:.0f} streams migrated", file=sys.stderr)
        self.assert_blocks_free(["prefill-0", "prefill-1", "decode-1"])


def main():
    global CLEAVE, MODELS
    if len(sys.argv) < 3:
        print(f"usage: {sys.argv[0]} CLEAVE_BINARY MODELS_DIR [unittest args]", file=sys.stderr)
        sys.exit(2)
    CLEAVE, MODELS = sys.argv[1], sys.argv[2]
    del sys.argv[1:3]
    if not os.path.isfile(os.path.join(MODELS, "stories260K.gguf")):
        print(f"SKIP: {MODELS}/stories260K.gguf is absent (../shared not checked out)",
              file=sys.stderr)
        sys.exit(SKIP)
    why = netns_hosts.available()
    if why:
        print(f"SKIP: multi-host tests need network namespaces: {why}", file=sys.stderr)
        sys.exit(SKIP)
    unittest.main(verbosity=2)


if __name__ == "__main__":
    main()
