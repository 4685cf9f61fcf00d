"""Quantised parameter all-gather for FSDP2 (ZeRO++'s qwZ): FULL_SHARD and HYBRID_SHARD gather weights in int8 or fp8.

FSDP2 copies each rank's parameter shards into one flat all-gather input and gathers it into the unsharded
flat buffer that forward and backward read (``FSDPModule.set_custom_all_gather``). This hook quantises
the input blockwise (a float32 scale per ``chunk_size`` values), all-gathers the payloads as bytes, and
dequantises every rank's part, its own included, so all ranks compute with the same weights. The sharded
parameters the optimizer updates are not touched: only the gathered copies are quantised.

Every rank's input has the same size, so every payload has the layout of this rank's own: the bytes
travel without a header and decode without a host read, and the forward's prefetch is never stalled.
"""

from __future__ import annotations

import torch

from compress.communicator import CommStats
from compress.payload import Compressor, layout_of, pack, unpack
from compress.torch_compat import AllGather, all_gather_bytes


class QuantizedAllGather(AllGather):
    """FSDP2 all-gather of quantised flat parameter shards; bytes counted against the unquantised gather."""

    def __init__(self, codec: Compressor, stats: CommStats, name: str):
        self.codec, self.stats, self.name = codec, stats, name

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if not input_tensor.is_floating_point():  # mixed dtypes travel as raw bytes: nothing to quantise
            return all_gather_bytes(output_tensor, input_tensor, group=group, async_op=async_op)
        world, numel, device = group.size(), input_tensor.numel(), input_tensor.device
        with self.stats.clock.time("gather_codec_s", device):
            payload = self.codec.compress(input_tensor.float(), self.name, 0)
            local = pack(payload)
        gathered = local.new_empty(world * local.numel())
        all_gather_bytes(gathered, local, group=group)
        with self.stats.clock.time("gather_codec_s", device):
            layout = layout_of(payload)
            parts = [self.codec.decompress(unpack(part, layout, payload)) for part in gathered.view(world, -1)]
            output_tensor.view(world, numel).copy_(torch.stack(parts))
        self.stats.gather_bytes_raw += (world - 1) * numel * input_tensor.element_size()
        self.stats.gather_bytes_sent += (world - 1) * local.numel()
        return None
