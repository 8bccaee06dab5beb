"""Test hosts in network namespaces: one namespace per host, joined by a bridge that lives in a
namespace of its own, each host with one address on 198.18.77.0/24 (RFC 2544's benchmarking
range; nothing outside the namespaces this module made is ever addressed). Faults are injected
inside a host's namespace only: packet loss and partitions with nftables; added latency with
tc netem where the kernel has it, else with a delay line of this module's own (`relay`): a
process in the switch's namespace that holds each frame the host sends for the delay before
passing it on to the bridge.

Needs root and iproute2; `available()` says why not where either is missing. Every namespace,
and so every interface and rule, is removed by `Topology.close()` (also at exit).
"""

import atexit
import collections
import ctypes
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

SUBNET = "198.18.77"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _run(*args, check=True):
    r = subprocess.run(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def available():
    """None when hosts can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (iproute2, nftables)"
    probe = f"clvprobe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        r = _run("ip", "netns", "exec", probe, "nft", "add", "table", "inet", "probe", check=False)
        if r.returncode != 0:
            return f"nftables does not work in a namespace: {r.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


class Host:
    def __init__(self, topo, name, index, port):
        self.name = name
        self.ns = f"{topo.tag}-{name}"
        self.ip = f"{SUBNET}.{index}"
        self.topo = topo
        self.port = port     # this host's end in the switch's namespace (on the bridge)
        self._relay = None   # the delay line's process, while one runs

    def exec_args(self, args):
        """`args` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns] + list(args)

    def run(self, *args, check=True):
        return _run(*self.exec_args(args), check=check)

    def enter(self):
        """Moves the calling thread into this host's namespace: sockets it opens from now on
        live there (a thread of its own per host: namespaces are per thread)."""
        fd = os.open(f"/run/netns/{self.ns}", os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({self.ns}): {os.strerror(err)}")
        finally:
            os.close(fd)

    # Faults. Each one is a rule in this host's own table `clvfault` (or its qdisc).
    def _table(self):
        self.run("nft", "add", "table", "inet", "clvfault")
        for hook in ("input", "output"):
            self.run("nft", f"add chain inet clvfault {hook} "
                            f"{{ type filter hook {hook} priority 0; policy accept; }}")

    def drop_randomly(self, percent):
        """Drops `percent` % of the packets this host sends and receives."""
        self._table()
        for hook in ("input", "output"):
            self.run("nft", f"add rule inet clvfault {hook} numgen random mod 100 < {percent} drop")

    def partition_from(self, other):
        """Drops every packet between this host and `other` (both directions, seen here)."""
        self._table()
        self.run("nft", f"add rule inet clvfault output ip daddr {other.ip} drop")
        self.run("nft", f"add rule inet clvfault input ip saddr {other.ip} drop")

    def delay(self, ms):
        """Adds `ms` of latency to what this host sends: tc netem where the kernel has it, else a
        delay line in the switch's namespace between the host's port and the bridge. Returns
        how: "netem" or "relay"."""
        r = self.run("tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", f"{ms}ms",
                     check=False)
        if r.returncode == 0:
            return "netem"
        # The port leaves the bridge; a veth pair (q: the relay's end, r: on the bridge) takes
        # its place, and the relay moves frames port -> q after `ms`, q -> port at once.
        sw, q, b = self.topo.sw, f"q{self.port}", f"r{self.port}"
        sw("ip", "link", "add", q, "type", "veth", "peer", "name", b)
        sw("ip", "link", "set", b, "master", "br0")
        for dev in (q, b):
            sw("ip", "link", "set", dev, "up")
        sw("ip", "link", "set", self.port, "nomaster")
        self._relay = subprocess.Popen(
            ["ip", "netns", "exec", self.topo.switch, sys.executable, os.path.abspath(__file__),
             "relay", self.port, q, str(ms)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            preexec_fn=lambda: _libc.prctl(1, signal.SIGKILL))  # PR_SET_PDEATHSIG
        line = self._relay.stdout.readline()
        if not line.startswith("relaying"):
            self.heal()
            raise RuntimeError(f"the delay line of {self.name} did not start: {line!r}")
        return "relay"

    def heal(self):
        self.run("nft", "delete", "table", "inet", "clvfault", check=False)
        self.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if self._relay is not None:
            self._relay.kill()
            self._relay.wait(timeout=10)
            self._relay.stdout.close()
            self._relay = None
            sw = lambda *a: _run("ip", "netns", "exec", self.topo.switch, *a, check=False)  # noqa
            sw("ip", "link", "del", f"q{self.port}")
            sw("ip", "link", "set", self.port, "master", "br0")


def rtt_ms(src, dst, samples=20):
    """The median time of a TCP handshake from host `src` to host `dst` (one round trip), in ms:
    a listener on a free port in dst's namespace, connections from src's."""
    ready, port, times, errors = threading.Event(), [0], [], []

    def serve():
        try:
            dst.enter()
            with socket.socket() as ls:
                ls.bind((dst.ip, 0))
                ls.listen(samples)
                port[0] = ls.getsockname()[1]
                ready.set()
                ls.settimeout(10)
                for _ in range(samples):
                    ls.accept()[0].close()
        except OSError as e:
            errors.append(e)
            ready.set()

    def connect():
        try:
            src.enter()
            ready.wait(10)
            for _ in range(samples):
                with socket.socket() as c:
                    c.settimeout(10)
                    t0 = time.perf_counter()
                    c.connect((dst.ip, port[0]))
                    times.append((time.perf_counter() - t0) * 1000)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=serve), threading.Thread(target=connect)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors or len(times) != samples:
        raise RuntimeError(f"rtt {src.name} -> {dst.name}: {errors or 'timed out'}")
    return sorted(times)[samples // 2]


class Topology:
    """Hosts named `names`, all on one bridge. Addresses: SUBNET.10, .11, ... in order."""

    def __init__(self, names):
        self.tag = f"clv{os.getpid() % 100000}"
        self.switch = f"{self.tag}-sw"
        self.hosts = {}
        self._closed = False
        atexit.register(self.close)
        try:
            _run("ip", "netns", "add", self.switch)
            sw = self.sw
            sw("ip", "link", "add", "br0", "type", "bridge")
            sw("ip", "link", "set", "br0", "up")
            sw("ip", "link", "set", "lo", "up")
            for i, name in enumerate(names):
                port = f"p{i}"
                host = Host(self, name, 10 + i, port)
                _run("ip", "netns", "add", host.ns)
                # Both ends are made in the switch's namespace, then one moves to the host.
                sw("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0")
                sw("ip", "link", "set", "eth0", "netns", host.ns)
                sw("ip", "link", "set", port, "master", "br0")
                sw("ip", "link", "set", port, "up")
                host.run("ip", "addr", "add", f"{host.ip}/24", "dev", "eth0")
                host.run("ip", "link", "set", "eth0", "up")
                host.run("ip", "link", "set", "lo", "up")
                self.hosts[name] = host
        except Exception:
            self.close()
            raise

    def sw(self, *args):
        """`args` run in the switch's namespace."""
        return _run("ip", "netns", "exec", self.switch, *args)

    def __getitem__(self, name):
        return self.hosts[name]

    def heal_all(self):
        for h in self.hosts.values():
            h.heal()

    def close(self):
        if self._closed:
            return
        self._closed = True
        for h in self.hosts.values():
            if h._relay is not None:
                h._relay.kill()
            _run("ip", "netns", "del", h.ns, check=False)
        _run("ip", "netns", "del", self.switch, check=False)


class NsThreadPool:
    """A pool of threads that all live in one host's namespace (for clients of its servers)."""

    def __init__(self, host, workers):
        import concurrent.futures
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, initializer=host.enter)

    def submit(self, fn, *args):
        return self._pool.submit(fn, *args)

    def call(self, fn, *args, timeout=60):
        return self._pool.submit(fn, *args).result(timeout=timeout)

    def shutdown(self):
        self._pool.shutdown(wait=False, cancel_futures=True)



# The delay line: `python3 netns_hosts.py relay PORT Q MS`, run in the switch's namespace.
# Frames the host sends (they arrive on PORT) leave through Q after MS milliseconds, in order;
# frames from the bridge (they arrive on Q) leave through PORT at once. Both sockets carry the
# virtio-net header (PACKET_VNET_HDR), so that segmentation-offloaded frames and partial
# checksums pass through whole, as they would through a switch. A frame the kernel cannot take
# (ENOBUFS) is dropped, as a congested link would.
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
ETH_P_ALL = 0x0003


def _relay(port, q, ms):
    socks = {}
    for dev in (port, q):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.bind((dev, 0))
        s.setblocking(False)
        socks[dev] = s
    src, dst = socks[port], socks[q]
    delay = ms / 1000.0
    held = collections.deque()  # (due, frame) of the host's frames, oldest first
    print("relaying", flush=True)
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _send(dst, held.popleft()[1])
        timeout = max(0.0, held[0][0] - now) if held else None
        readable, _, _ = select.select([src, dst], [], [], timeout)
        for s in readable:
            while True:
                try:
                    frame, addr = s.recvfrom(1 << 18)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:  # what this relay itself sent
                    continue
                if s is src:
                    held.append((time.monotonic() + delay, frame))
                else:
                    _send(src, frame)


def _send(sock, frame):
    try:
        sock.send(frame)
    except (BlockingIOError, OSError):
        pass  # dropped, as a full link would


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "relay":
    _relay(sys.argv[2], sys.argv[3], float(sys.argv[4]))
