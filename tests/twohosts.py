"""Two network hosts on one machine, for multi-node launches: two network namespaces joined by a
veth pair, node 0 at 192.0.2.1 and node 1 at 192.0.2.2 (a documentation range, and only inside
the namespaces this helper makes and deletes). Each node runs the real `torchrun --nnodes 2
--node-rank K --master-addr <node 0>` command in its own namespace, with GLOO_SOCKET_IFNAME set to
its end of the pair; the helper only builds the hosts and runs the nodes' commands.

    with TwoHosts() as hosts:
        nodes = hosts.torchrun(["-m", "minirl.ppo", ...], nproc=2)   # [node 0, node 1]

`TwoHosts.unavailable()` says why a machine cannot have them (not root, no `ip`, `ip netns`
refused): the tests skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from conftest import ROOT, TORCHRUN_VARS

ADDRS = ("192.0.2.1", "192.0.2.2")


@dataclass
class Node:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


class TwoHosts:
    def __init__(self):
        tag = f"mrl{os.getpid() % 100000}{int(time.time() * 1000) % 1000}"
        self.ns = (f"{tag}n0", f"{tag}n1")
        self.ifs = (f"{tag}a", f"{tag}b")  # interface names stay under 15 characters

    @staticmethod
    def unavailable() -> str | None:
        """Why two hosts cannot be made here, or None."""
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2) on this machine"
        if os.geteuid() != 0:
            return "two network namespaces need root (`ip netns add`)"
        probe = f"mrlprobe{os.getpid() % 100000}"
        p = _ip("netns", "add", probe)
        if p.returncode != 0:
            return f"`ip netns add` refused: {p.stderr.strip()}"
        _ip("netns", "del", probe)
        return None

    def __enter__(self) -> TwoHosts:
        try:
            for ns in self.ns:
                self._must("netns", "add", ns)
            self._must("link", "add", self.ifs[0], "type", "veth", "peer", "name", self.ifs[1])
            for ns, iface, addr in zip(self.ns, self.ifs, ADDRS):
                self._must("link", "set", iface, "netns", ns)
                self._must("-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
                self._must("-n", ns, "link", "set", iface, "up")
                self._must("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.ns:  # deleting a namespace deletes its end of the pair, and with it the other end
            _ip("netns", "del", ns)

    def _must(self, *args: str) -> None:
        p = _ip(*args)
        if p.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")

    def popen(self, node: int, cmd: list[str], out_dir: str, env: dict | None = None) -> subprocess.Popen:
        """Start `cmd` on `node` (in its namespace, its interface named for gloo), its output in
        `out_dir`/node{K}.out and .err."""
        base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
        full = {**base, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": self.ifs[node], **(env or {})}
        with open(os.path.join(out_dir, f"node{node}.out"), "w") as out, \
                open(os.path.join(out_dir, f"node{node}.err"), "w") as err:
            return subprocess.Popen(["ip", "netns", "exec", self.ns[node], *cmd], cwd=ROOT, env=full,
                                    stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    def torchrun(self, args: list[str], out_dir, nproc: int = 2, port: int = 29500, timeout: float = 600,
                 grace: float = 60, env: dict | None = None, during=None) -> list[Node]:
        """Run `torchrun --nnodes 2 --node-rank K --nproc-per-node nproc --master-addr <node 0> <args>`
        on both nodes at once. When one node fails, the other gets `grace` seconds to leave by itself
        before its whole process tree is killed (it would otherwise wait on a store for its whole
        timeout). `during(procs)`, if given, is called every poll while both run (a test that kills a
        node mid-run); it returns True once it has acted."""
        out_dir = str(out_dir)
        procs = [self.popen(k, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                str(k), f"--nproc-per-node={nproc}", "--master-addr", ADDRS[0],
                                "--master-port", str(port), *args], out_dir, env) for k in range(2)]
        deadline, failed_at = time.time() + timeout, None
        try:
            while any(p.poll() is None for p in procs) and time.time() < deadline:
                if during is not None and during(procs):
                    during = None
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = time.time()
                if failed_at is not None and time.time() - failed_at > grace:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                kill_tree(p.pid)  # torchrun starts each worker in a session of its own
                p.wait()
        nodes = []
        for k, p in enumerate(procs):
            read = lambda ext: open(os.path.join(out_dir, f"node{k}.{ext}"), errors="replace").read()  # noqa: E731
            nodes.append(Node(k, p.returncode, read("out"), read("err")))
            if p.returncode != 0:
                print(f"----- node {k}: exit {p.returncode} -----\n{nodes[-1].stdout[-5000:]}\n"
                      f"----- node {k} stderr -----\n{nodes[-1].stderr[-5000:]}")
        return nodes


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
