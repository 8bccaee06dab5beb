"""Test hosts in network namespaces: one namespace per host, joined by a bridge that lives in a
namespace of its own, each host with one address on 198.18.77.0/24 (RFC 2544's benchmarking
range; nothing outside the namespaces this module made is ever addressed). Faults are injected
inside a host's namespace only: packet loss and partitions with nftables, added latency with
tc netem where the kernel has it.

Needs root and iproute2; `available()` says why not where either is missing. Every namespace,
and so every interface and rule, is removed by `Topology.close()` (also at exit).
"""

import atexit
import ctypes
import os
import shutil
import subprocess

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
    def __init__(self, topo, name, index):
        self.name = name
        self.ns = f"{topo.tag}-{name}"
        self.ip = f"{SUBNET}.{index}"
        self.topo = topo

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
        """Adds `ms` of latency to what this host sends (tc netem); False when the kernel has no
        netem."""
        r = self.run("tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", f"{ms}ms",
                     check=False)
        return r.returncode == 0

    def heal(self):
        self.run("nft", "delete", "table", "inet", "clvfault", check=False)
        self.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)


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
            sw = lambda *a: _run("ip", "netns", "exec", self.switch, *a)  # noqa: E731
            sw("ip", "link", "add", "br0", "type", "bridge")
            sw("ip", "link", "set", "br0", "up")
            sw("ip", "link", "set", "lo", "up")
            for i, name in enumerate(names):
                host = Host(self, name, 10 + i)
                _run("ip", "netns", "add", host.ns)
                port = f"p{i}"
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

