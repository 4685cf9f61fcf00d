"""Lightning callbacks that measure a run: throughput, memory, compression statistics, and a results record."""

from callbacks.compression import CompressionStats
from callbacks.memory import Memory
from callbacks.results import Results
from callbacks.throughput import Throughput

__all__ = ["CompressionStats", "Memory", "Results", "Throughput"]
