"""The emulated slow link: two network namespaces joined by a rate-limited veth pair, and a check of its rate.

The namespaces' addresses (10.210.0.1/30 and 10.210.0.2/30) exist only inside them; both veth ends are shaped by a
``tc`` token-bucket filter (tbf). Creating them needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); ``SlowLink`` removes
what it created on exit, on an error, on Ctrl-C and on SIGTERM. The rate check runs this file inside the namespaces:
``python slow_link.py receive PORT`` in node 1, ``python slow_link.py send ADDRESS PORT BYTES`` in node 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


class LinkError(RuntimeError):
    """Setting up the emulated link failed; the message is one line naming the command and its error."""

    def __init__(self, message: str, stderr: str | None = None):
        super().__init__(message)
        self.stderr = stderr  # the failed command's error output; None when the command did not run


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as ``1gbit``, ``500mbit``, ``100kbit``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r} is not a tc rate; use e.g. 1gbit, 10gbit, 500mbit")
    return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]


def tc_rate(rate: str) -> str:
    """argparse type: a rate ``parse_rate`` reads, kept as tc spells it."""
    try:
        parse_rate(rate)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return rate


def _command(*argv: str) -> str:
    """Run an iproute2 command; its stdout, or LinkError with the command and its stderr."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise LinkError(f"`{argv[0]}` not found; install iproute2") from None
    if result.returncode != 0:
        stderr = result.stderr.strip() or f"exit {result.returncode}"
        raise LinkError(f"`{' '.join(argv)}` failed: {stderr}", stderr)
    return result.stdout


class SlowLink:
    """Two network namespaces joined by a rate-limited veth pair; removed again on exit.

    Names carry the pid, so concurrent benchmarks do not collide. SIGTERM and SIGHUP are turned into
    ``SystemExit`` while the link exists, so the teardown in ``__exit__`` runs for them as for Ctrl-C.
    """

    def __init__(self, rate: str, tag: str | None = None):
        tag = tag or str(os.getpid())
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.namespaces = (f"lit_fsdp-{tag}-0", f"lit_fsdp-{tag}-1")
        self.veths = (f"lfa{tag}"[:15], f"lfb{tag}"[:15])  # interface names: 15 characters at most
        self.addresses = ("10.210.0.1", "10.210.0.2")
        self._created: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self._handlers: dict[int, object] = {}

    def qdisc(self) -> list[str]:
        """The tc qdisc arguments for one veth end.

        tbf (token bucket) shapes the rate only, with no added delay or loss: what a slow link is for
        bulk transfers. Its bucket must hold at least one timer tick of traffic (rate / HZ; HZ=250
        is the coarsest common kernel tick) and a 64 KiB GSO packet, or the rate falls short; the
        queue holds 50 ms at the rate, so TCP sees queueing rather than drops.
        """
        burst = max(int(self.rate_bps / 8 / 250), 128 * 1024)
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "50ms"]

    def __enter__(self) -> SlowLink:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._handlers[signum] = signal.signal(signum, _exit_on_signal)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        for ns in self.namespaces:
            try:
                _command("ip", "netns", "add", ns)
            except LinkError as error:
                if error.stderr is None:  # no `ip` at all
                    raise
                if "exists" in error.stderr:  # not ours: it is left alone
                    raise LinkError(
                        f"network namespace {ns} already exists (left by a killed run?); remove it with `ip netns del {ns}`"
                    ) from None
                raise LinkError(
                    f"needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; tried "
                    f"`ip netns add {ns}`: {error.stderr}; run it as root (sudo)"
                ) from None
            self._created.append(("netns", ns))
        a, b = self.veths
        _command("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        self._created.append(("link", a))
        for ns, veth, address in zip(self.namespaces, self.veths, self.addresses):
            _command("ip", "link", "set", veth, "netns", ns)
            _command("ip", "-n", ns, "addr", "add", f"{address}/30", "dev", veth)
            _command("ip", "-n", ns, "link", "set", "lo", "up")
            _command("ip", "-n", ns, "link", "set", veth, "up")
            _command("tc", "-n", ns, "qdisc", "add", "dev", veth, "root", *self.qdisc())
        self._created.remove(("link", a))  # each end now lives in a namespace and goes with it

    def close(self) -> None:
        """Delete what was created, newest first; safe to call twice. A namespace takes its veth with it."""
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            while self._created:
                kind, name = self._created.pop()
                command = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
                try:
                    _command(*command)
                except LinkError as error:
                    print(f"bench_slow_link: could not remove {kind} {name}: {error}; remove it by hand", file=sys.stderr)
        finally:
            for signum, handler in {**previous, **self._handlers}.items():
                signal.signal(signum, handler)
            self._handlers.clear()

    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program in node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node]]


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


# --- link check ----------------------------------------------------------------------------------


def probe_receive(port: int) -> None:
    """Receiver half of the link check (run inside node 1): count bytes to EOF, answer with the count."""
    with socket.create_server(("0.0.0.0", port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            total = 0
            while chunk := connection.recv(1 << 20):
                total += len(chunk)
            connection.sendall(total.to_bytes(8, "big"))


def probe_send(address: str, port: int, nbytes: int) -> None:
    """Sender half (run inside node 0): time ``nbytes`` until the receiver has counted them all."""
    block = bytes(1 << 20)
    with socket.create_connection((address, port), timeout=60) as connection:
        start = time.perf_counter()
        for _ in range(0, nbytes, len(block)):
            connection.sendall(block)
        connection.shutdown(socket.SHUT_WR)
        answer = b""
        while len(answer) < 8 and (chunk := connection.recv(8 - len(answer))):
            answer += chunk
        seconds = time.perf_counter() - start
    print(json.dumps({"bytes": int.from_bytes(answer, "big"), "seconds": seconds}))


def measure_rate(link: SlowLink, seconds: float = 1.0, port: int = 5201) -> dict[str, float]:
    """Send about ``seconds`` worth of data at the nominal rate from node 0 to node 1; the measured rate."""
    nbytes = max(int(link.rate_bps / 8 * seconds), 16 << 20)
    script = [sys.executable, str(Path(__file__).resolve())]
    receiver = subprocess.Popen(
        [*link.exec_prefix(1), *script, "receive", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        if receiver.stdout.readline().strip() != "ready":
            raise LinkError(f"link check: the receiver in {link.namespaces[1]} did not start (exit {receiver.wait()})")
        sent = _command(*link.exec_prefix(0), *script, "send", link.addresses[1], str(port), str(nbytes))
        result = json.loads(sent)
        receiver.wait(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return {"measured_gbit_s": result["bytes"] * 8 / result["seconds"] / 1e9, **result}


def main(argv: list[str]) -> None:
    """The rate check's halves, as ``measure_rate`` runs them inside the namespaces."""
    if argv[:1] == ["receive"] and len(argv) == 2:
        return probe_receive(int(argv[1]))
    if argv[:1] == ["send"] and len(argv) == 4:
        return probe_send(argv[1], int(argv[2]), int(argv[3]))
    sys.exit(f"usage: {Path(__file__).name} receive PORT | send ADDRESS PORT BYTES")


if __name__ == "__main__":
    main(sys.argv[1:])
