"""Lightning callbacks that measure a run: throughput (and, as they land, memory, communication, compression)."""

from callbacks.throughput import Throughput

__all__ = ["Throughput"]
