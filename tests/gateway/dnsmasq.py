"""A real DNS server for the tests: Debian's dnsmasq on a free loopback port, with the
A records of a hosts file it rereads on SIGHUP (records change while kvgate runs).

dnsmasq answers only for ``.test`` (``--local``), so a name it does not hold is
NXDOMAIN, never a refusal; it asks nobody upstream and drops no privileges. Missing
dnsmasq fails the test (scripts/test.sh installs ``dnsmasq-base``), never skips it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path

DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"


def free_udp_port() -> int:
    """A loopback port free for both UDP and TCP: dnsmasq binds both (a port free for
    UDP alone made it exit 2 once, when TCP had it)."""
    while True:
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(("127.0.0.1", 0))
        port = u.getsockname()[1]
        t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            t.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            t.close()
            u.close()
        return port


class Dnsmasq:
    def __init__(self, directory: Path, srv: Iterable[str] = (), records: Iterable[str] = ()):
        assert os.path.exists(DNSMASQ), f"{DNSMASQ} missing: apt-get install dnsmasq-base"
        self.hosts = directory / "hosts"
        self.hosts.write_text("")
        self.port = free_udp_port()
        self.server = f"127.0.0.1:{self.port}"
        self._args = [
            DNSMASQ,
            "--no-daemon",
            "--conf-file=/dev/null",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            "--local=/test/",
            f"--addn-hosts={self.hosts}",
            "--user=root",
            "--cache-size=0",
            *(f"--srv-host={s}" for s in srv),
            *(f"--host-record={r}" for r in records),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def _launch(self) -> None:
        self.proc = subprocess.Popen(
            self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    async def start(self) -> None:
        self._launch()
        assert self.proc is not None
        for _ in range(100):  # until it answers on its port
            if self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited {self.proc.returncode}: {self._args}")
            if await self._answers():
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("dnsmasq did not answer")

    async def _answers(self) -> bool:
        import dns.asyncquery
        import dns.message

        try:
            q = dns.message.make_query("probe.test", "A")
            await dns.asyncquery.udp(q, "127.0.0.1", port=self.port, timeout=0.2)
            return True
        except Exception:
            return False

    def set_hosts(self, name: str, addresses: Iterable[str]) -> None:
        """Make `name` resolve to `addresses` (dnsmasq rereads the file on SIGHUP)."""
        self.hosts.write_text("".join(f"{a} {name}\n" for a in addresses))
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
