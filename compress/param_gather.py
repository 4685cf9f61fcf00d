"""Quantised parameter all-gather for FSDP2 (ZeRO++'s qwZ): FULL_SHARD and HYBRID_SHARD gather weights in int8 or fp8.

FSDP2 copies each rank's parameter shards into one flat all-gather input and gathers it into the unsharded
flat buffer that forward and backward read (``FSDPModule.set_custom_all_gather``). This hook quantises
the input blockwise (a float32 scale per ``chunk_size`` values), all-gathers the payloads as bytes, and
dequantises every rank's part, its own included, so all ranks compute with the same weights. The sharded
parameters the optimizer updates are not touched: only the gathered copies are quantised.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from compress.communicator import CommStats, _Timer, deserialize, serialize
from compress.payload import Compressor


class QuantizedAllGather(AllGather):
    """FSDP2 all-gather of quantised flat parameter shards; bytes counted against the unquantised gather."""

    def __init__(self, codec: Compressor, stats: CommStats, name: str):
        self.codec, self.stats, self.name = codec, stats, name

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if not input_tensor.is_floating_point():  # mixed dtypes travel as raw bytes: nothing to quantise
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        world, numel = group.size(), input_tensor.numel()
        with _Timer(input_tensor.device) as timer:
            local = serialize(self.codec.compress(input_tensor.float(), self.name, 0))
        gathered = local.new_empty(world * local.numel())
        dist.all_gather_single(gathered, local, group=group)
        with _Timer(input_tensor.device) as decode:
            parts = [self.codec.decompress(deserialize(part, numel)) for part in gathered.view(world, -1)]
            output_tensor.view(world, numel).copy_(torch.stack(parts))
        self.stats.gather_bytes_raw += (world - 1) * numel * input_tensor.element_size()
        self.stats.gather_bytes_sent += (world - 1) * local.numel()
        self.stats.gather_codec_s += timer.seconds + decode.seconds
        return None
