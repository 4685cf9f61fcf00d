"""Lightning callbacks that measure a run: throughput, memory, communication, compression and offload statistics, host syncs, quality, and a results record; and the checkpoint, interrupt and model summary callbacks every run gets."""

from callbacks.checkpoint import ModelCheckpoint
from callbacks.comm_profiler import CommProfiler
from callbacks.compression import CompressionStats
from callbacks.host_syncs import HostSyncs
from callbacks.interrupt import InterruptCheckpoint
from callbacks.memory import Memory
from callbacks.model_summary import ModelSummary
from callbacks.offload import OffloadStats
from callbacks.quality import Quality
from callbacks.results import Results
from callbacks.throughput import Throughput

__all__ = ["CommProfiler", "CompressionStats", "HostSyncs", "InterruptCheckpoint", "Memory", "ModelCheckpoint",
           "ModelSummary", "OffloadStats", "Quality", "Results", "Throughput"]
