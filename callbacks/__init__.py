"""Lightning callbacks that measure a run: throughput, memory, communication, compression and offload statistics, host syncs, quality, and a results record; and the checkpoint callback every run gets."""

from callbacks.checkpoint import ModelCheckpoint
from callbacks.comm_profiler import CommProfiler
from callbacks.compression import CompressionStats
from callbacks.host_syncs import HostSyncs
from callbacks.memory import Memory
from callbacks.offload import OffloadStats
from callbacks.quality import Quality
from callbacks.results import Results
from callbacks.throughput import Throughput

__all__ = ["CommProfiler", "CompressionStats", "HostSyncs", "Memory", "ModelCheckpoint", "OffloadStats", "Quality", "Results",
           "Throughput"]
