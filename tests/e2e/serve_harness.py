"""Starts and stops real `cleave serve` / `cleave router` processes for the end-to-end tests.

Usage by a test script: `python3 TEST.py CLEAVE_BINARY MODELS_DIR`. The script calls
`harness_main()`, which skips (exit 77) when ../shared's model is absent and fails with a clear
message when the `openai` package is missing (scripts/install-deps.sh installs it).
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

SKIP = 77
CLEAVE = None
MODELS = None

WORKER_LINE = re.compile(r"^worker (\w+) (\S+) pid (\d+) listening on (\S+)$")
EXIT_LINE = re.compile(r"^worker (\w+) (\S+) pid (\d+) exited: (.*)$")
LISTENING_LINE = re.compile(r"^cleave (serve|router) listening on (http://\S+)")
# serve: "gRPC API (cleave.v1.Inference, ...) on HOST:PORT"; router: "..., gRPC API on HOST:PORT)"
GRPC_LINE = re.compile(r"gRPC API(?: \([^)]*\))? on ([^\s)]+)")


def model_path():
    return os.path.join(MODELS, "stories260K.gguf")


def golden_text():
    with open(os.path.join(MODELS, "stories260K-empty.txt"), "rb") as f:
        return f.read().decode("utf-8")


class Process:
    """One `cleave serve` or `cleave router` child: its stdout lines (parsed as they come), its
    stderr in a log file, the URL it serves on."""

    def __init__(self, args, name, start_timeout=90.0):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"cleave-{name}-", suffix=".log",
                                               delete=False)
        self.lines = []
        self.lines_lock = threading.Lock()
        self.events = queue.Queue()
        self.proc = subprocess.Popen([CLEAVE] + args, stdout=subprocess.PIPE,
                                     stderr=self.log, stdin=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.url = None
        deadline = time.monotonic() + start_timeout
        while self.url is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.fail(f"{name}: no listening line within {start_timeout} s")
            try:
                line = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None:
                    self.fail(f"{name} exited with {self.proc.returncode} before listening")
                continue
            m = LISTENING_LINE.match(line)
            if m:
                self.url = m.group(2)
        self.wait_health(start_timeout)

    def _read(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self.lines_lock:
                self.lines.append(line)
            self.events.put(line)

    def fail(self, message):
        self.kill()
        raise AssertionError(f"{message}\n--- {self.name} log tail:\n{self.log_tail()}")

    def log_tail(self, n=60):
        try:
            with open(self.log.name, "r", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def stdout_lines(self):
        with self.lines_lock:
            return list(self.lines)

    def grpc_target(self, timeout=10.0):
        """HOST:PORT of the router's gRPC API, from its stdout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.stdout_lines():
                m = GRPC_LINE.search(line)
                if m:
                    return m.group(1)
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no gRPC API line in its output")

    def workers(self):
        """{worker id: (pool, pid, address)} from the latest listening line of each worker."""
        out = {}
        for line in self.stdout_lines():
            m = WORKER_LINE.match(line)
            if m:
                out[m.group(2)] = (m.group(1), int(m.group(3)), m.group(4))
        return out

    def all_worker_pids(self):
        pids = set()
        for line in self.stdout_lines():
            m = WORKER_LINE.match(line) or EXIT_LINE.match(line)
            if m:
                pids.add(int(m.group(3)))
        return pids

    def get(self, path, timeout=5.0):
        """(status, body text) of GET url+path."""
        try:
            with urllib.request.urlopen(self.url + path.lstrip("/"), timeout=timeout) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def post(self, path, body, headers=None, timeout=30.0):
        """(status, body text) of POST url+path with a JSON body."""
        req = urllib.request.Request(self.url + path.lstrip("/"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def wait_health(self, timeout):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"{self.name} exited with {self.proc.returncode}")
            try:
                status, _ = self.get("/health", timeout=2)
                if status == 200:
                    return
                last = status
            except OSError as e:
                last = e
            time.sleep(0.1)
        self.fail(f"{self.name}: /health not 200 within {timeout} s (last: {last})")

    def metrics(self):
        """{(name, frozenset(labels)): value} of GET /metrics."""
        status, text = self.get("/metrics")
        if status != 200:
            raise AssertionError(f"/metrics answered {status}")
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$", line)
            if not m:
                continue
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
            out[(m.group(1), labels)] = float(m.group(4))
        return out

    def metric(self, name, **labels):
        return self.metrics().get((name, frozenset(labels.items())))

    def stop(self, timeout=30.0):
        """SIGTERM, then the exit status (0 expected) and no worker left running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.fail(f"{self.name} did not exit within {timeout} s of SIGTERM")
        self.reader.join(timeout=5)
        self.proc.stdout.close()
        self.log.close()
        if code != 0:
            raise AssertionError(f"{self.name} exited with {code}\n{self.log_tail()}")
        alive = [pid for pid in self.all_worker_pids() if pid_alive(pid)]
        if alive:
            raise AssertionError(f"{self.name} exited but its workers {alive} still run")
        try:
            os.unlink(self.log.name)
        except OSError:
            pass

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait(timeout=10)
        self.reader.join(timeout=5)
        self.proc.stdout.close()
        self.log.close()
        # The workers follow through their death signal (PR_SET_PDEATHSIG).
        for pid in self.all_worker_pids():
            wait_gone(pid, 10)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is reaped by its parent; one that is only a zombie has exited.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def wait_gone(pid, timeout):
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not pid_alive(pid)


def serve(*extra, name="serve"):
    """`cleave serve` on stories260K, disaggregated, on a free port, small KV pools."""
    args = ["serve", "--model", model_path(), "--host", "127.0.0.1", "--port", "0",
            "--grpc-port", "0",
            "--set", "router.health_interval_ms=200",
            "--set", "pools.prefill.kv_cache_bytes=33554432",
            "--set", "pools.decode.kv_cache_bytes=33554432"]
    return Process(args + list(extra), name)


def router(serve_proc, *extra, name="router"):
    """`cleave router` against the workers of a running serve."""
    pools = {}
    for _, (pool, _, address) in sorted(serve_proc.workers().items()):
        pools.setdefault(pool, []).append(address)
    args = ["router", "--model", model_path(), "--host", "127.0.0.1", "--port", "0",
            "--grpc-port", "0",
            "--set", "router.health_interval_ms=200"]
    for pool, addresses in pools.items():
        args += ["--set", f"pools.{pool}.workers={','.join(addresses)}"]
    return Process(args + list(extra), name)


def client(proc, api_key="none", timeout=60.0):
    import openai
    return openai.OpenAI(base_url=proc.url + "v1", api_key=api_key, max_retries=0,
                         timeout=timeout)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def grpc_stubs(out_dir, stem):
    """(STEM_pb2, STEM_pb2_grpc) for proto/cleave/v1/STEM.proto, generated by grpc_tools' protoc
    into out_dir (grpcio-tools, installed by scripts/install-deps.sh)."""
    import importlib
    proto_dir = os.path.join(REPO, "proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}",
                    f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                    os.path.join(proto_dir, "cleave", "v1", f"{stem}.proto")], check=True)
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    return (importlib.import_module(f"cleave.v1.{stem}_pb2"),
            importlib.import_module(f"cleave.v1.{stem}_pb2_grpc"))


def warm_up_client(client, model):
    """One streaming and one plain completion from this thread, before a test uses `client` from
    many threads at once: the openai package's pydantic models build their schemas lazily on
    first use, and building them from several threads at once can fail
    ("PydanticUserError: ... BaseModel cannot be instantiated directly")."""
    for _ in client.completions.create(model=model, prompt="Hi", max_tokens=2, stream=True,
                                       stream_options={"include_usage": True}):
        pass
    client.completions.create(model=model, prompt="Hi", max_tokens=2)


def harness_main():
    global CLEAVE, MODELS
    if len(sys.argv) < 3:
        print(f"usage: {sys.argv[0]} CLEAVE_BINARY MODELS_DIR [unittest args]", file=sys.stderr)
        sys.exit(2)
    CLEAVE, MODELS = sys.argv[1], sys.argv[2]
    del sys.argv[1:3]
    if not os.path.isfile(model_path()):
        print(f"SKIP: {model_path()} is absent (../shared not checked out)", file=sys.stderr)
        sys.exit(SKIP)
    try:
        import openai  # noqa: F401
    except ImportError:
        print("FAIL: the Python package `openai` is missing; run scripts/install-deps.sh",
              file=sys.stderr)
        sys.exit(1)
    unittest.main(verbosity=2)
