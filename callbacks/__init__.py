"""Lightning callbacks that measure a run: throughput and compression statistics."""

from callbacks.compression import CompressionStats
from callbacks.throughput import Throughput

__all__ = ["CompressionStats", "Throughput"]
