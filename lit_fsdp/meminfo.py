"""The host's memory as Linux reports it (``/proc/meminfo``): what SlideFSDP's preflight, ``callbacks.Memory`` and the
tuner's hardware detection read."""

from __future__ import annotations

from pathlib import Path


def meminfo_bytes(key: str) -> int | None:
    """``key``'s figure in /proc/meminfo (``MemTotal``, ``MemAvailable``, ...) in bytes; None where there is no such
    file or line."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_host_bytes() -> int | None:
    """MemAvailable: what the host can give without swapping; None where it does not say."""
    return meminfo_bytes("MemAvailable")
