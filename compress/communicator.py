"""Communicators: FSDP2 hooks that move compressed payloads between ranks and count every byte.

Reduce-scatter (``CompressedReduceScatter``, set with ``FSDPModule.set_custom_reduce_scatter``): FSDP2
hands over a flat gradient laid out as ``[world, shard]``; row ``d`` is what rank ``d`` must receive.

- Linear compressors (fp16/bf16 casts, shared-seed random-k, count-sketch) compress each row with the
  same seed on every rank, so the payloads line up element by element and one native
  ``reduce_scatter_tensor`` per payload tensor sums them on the wire.
- All others cannot be added on the wire (each rank has its own scales, indices or factors): each rank
  sends row ``d``'s payload to rank ``d`` with ``all_to_all_single`` (sizes first, then bytes), and the
  receiver decompresses every source's payload and sums in float32.

All-reduce over the replicate dimension of NO_SHARD / HYBRID_SHARD (``CompressedAllReduce``, set with
``FSDPModule.set_all_reduce_hook``): FSDP then runs on the shard sub-mesh and this hook averages the
reduced shard across replicas, natively for linear payloads and by ``all_gather`` of payloads otherwise.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from compress.payload import SCALAR_BYTES, Compressor, Payload
from compress.sparsify import BITMAP, POSITIONS, _Sparsifier, count


@dataclass
class CommStats:
    """Counters of one rank, summed over all hooks (``buffer_bytes``: the maximum); ``take()`` returns and clears them."""

    calls: int = 0
    numel: int = 0
    bytes_raw: int = 0  # what the uncompressed float32 collective would send from this rank
    bytes_sent: int = 0  # what was sent, payloads plus headers plus size exchanges
    bytes_index: int = 0
    compress_s: float = 0.0
    decompress_s: float = 0.0
    extra_collectives: int = 0  # collectives beyond the one the uncompressed path needs
    extra_collective_s: float = 0.0
    nonfinite: int = 0
    values_sent: int = 0  # elements given a value in the payloads (see ``kept_values``); over numel: the density
    buffer_bytes: int = 0  # the send and receive buffers of one call: the largest call's, not a sum
    # The quantised parameter all-gather (compress.param_gather), apart from the gradients' figures.
    gather_bytes_raw: int = 0  # what the unquantised all-gather would send from this rank
    gather_bytes_sent: int = 0
    gather_codec_s: float = 0.0
    # Sampled steps only (``sampling``): this rank's own payloads decoded locally against their input rows.
    sample_err_sq: float = 0.0  # ||estimate - gradient||^2
    sample_ref_sq: float = 0.0  # ||gradient||^2
    sample_dot: float = 0.0  # <estimate, gradient>
    sample_est_sq: float = 0.0  # ||estimate||^2

    def __post_init__(self) -> None:
        # A switch, not a counter, so take() leaves it: CompressionStats turns it on for the steps it samples.
        self.sampling = False

    def take(self) -> dict[str, float]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return values


_SET_BITS = torch.tensor([bin(byte).count("1") for byte in range(256)], dtype=torch.int64)


def kept_values(compressor: Compressor, payload: Payload) -> int:
    """Elements of ``payload`` that carry a value: the k kept by a sparsifier, all ``numel`` for every other method.

    Quantisers, the count-sketch and low rank encode every element (density 1.0). Read from the index
    encoding, so a sparsifier whose values are quantised (and bit-packed) is counted exactly too.
    """
    sparsifier = getattr(compressor, "inner", compressor)  # under error feedback
    sparsifier = getattr(sparsifier, "sparsifier", sparsifier)  # sparsify-then-quantize
    if not isinstance(sparsifier, _Sparsifier):
        return payload.numel
    if POSITIONS in payload.tensors:
        return payload.tensors[POSITIONS].numel()
    if BITMAP in payload.tensors:  # a popcount; the padding bits of the last byte are zero
        bitmap = payload.tensors[BITMAP]
        return int(_SET_BITS.to(bitmap.device)[bitmap.long()].sum())
    return count(payload.numel, sparsifier.ratio, sparsifier.k)  # random-k: positions come from the seed


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Wall time of a block, device-synchronised so asynchronous kernels are counted where they run."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> "_Timer":
        _sync(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync(self.device)
        self.seconds = time.perf_counter() - self._start


def serialize(payload: Payload) -> torch.Tensor:
    """Payload as one uint8 buffer: a JSON header (names, dtypes, shapes, scalars), then raw tensor bytes."""
    layout = {
        "t": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in payload.tensors.items()],
        "s": payload.scalars,
        "i": list(payload.index_names),
    }
    header = json.dumps(layout, separators=(",", ":")).encode()
    device = next(iter(payload.tensors.values())).device if payload.tensors else torch.device("cpu")
    parts = [torch.tensor(list(len(header).to_bytes(4, "little")) + list(header), dtype=torch.uint8, device=device)]
    parts += [t.contiguous().view(-1).view(torch.uint8) for t in payload.tensors.values()]
    return torch.cat(parts)


def deserialize(buffer: torch.Tensor, numel: int) -> Payload:
    header_len = int.from_bytes(bytes(buffer[:4].tolist()), "little")
    layout = json.loads(bytes(buffer[4 : 4 + header_len].tolist()).decode())
    offset = 4 + header_len
    tensors = {}
    for name, dtype_name, shape in layout["t"]:
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        # A copy: a slice at an odd byte offset cannot be viewed as a wider dtype.
        tensors[name] = buffer[offset : offset + nbytes].clone().view(dtype).view(shape)
        offset += nbytes
    return Payload(numel=numel, tensors=tensors, scalars=layout["s"], index_names=tuple(layout["i"]))


def screen(tensor: torch.Tensor, stats: CommStats) -> torch.Tensor:
    """Non-finite gradient values are counted (the strategy's guard reads the count) and replaced by zeros rather than sent."""
    finite = torch.isfinite(tensor)
    bad = int(finite.numel() - finite.sum())
    if bad:
        stats.nonfinite += bad
        tensor = torch.where(finite, tensor, torch.zeros_like(tensor))
    return tensor


def _apply_op(result: torch.Tensor, op: object, world: int, prescaled: bool) -> torch.Tensor:
    """``result`` is the sum over ranks (or the mean, when inputs were ``prescaled`` by 1/world)."""
    if op == dist.ReduceOp.AVG:
        return result if prescaled else result / world
    if op == dist.ReduceOp.SUM:
        return result * world if prescaled else result
    raise ValueError(f"compressed reduce-scatter supports ReduceOp SUM and AVG, got {op}; do not set a gradient divide factor")


class _PayloadMover:
    """What both hooks share: the compressor, the counters, non-finite screening and per-call seeds."""

    def __init__(self, compressor: Compressor, stats: CommStats, name: str):
        self.compressor = compressor
        self.stats = stats
        self.name = name
        self._base_seed = zlib.crc32(name.encode())
        self.calls = 0  # kept in checkpoints: a resumed run draws the seeds the uninterrupted one would

    def next_seed(self) -> int:
        # Every rank runs the same hooks in the same order, so the call count agrees across ranks.
        self.calls += 1
        return self._base_seed * 1_000_003 + self.calls * 1009

    def screen(self, tensor: torch.Tensor) -> torch.Tensor:
        return screen(tensor, self.stats)

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        with _Timer(tensor.device) as timer:
            payload = self.compressor.compress(tensor, key, seed)
        self.stats.compress_s += timer.seconds
        self.stats.values_sent += kept_values(self.compressor, payload)
        return payload

    def sample(self, payloads: list[Payload], inputs: list[torch.Tensor]) -> None:
        """On a sampled step, decode this rank's own ``payloads`` and compare them with the ``inputs`` they came from.

        ``inputs`` are the rows as handed to the compressor, before error feedback adds its residual. A
        measurement, not the method's cost: no communication, and not counted in compress_s/decompress_s.
        Call it before any collective, which may reduce payload tensors in place.
        """
        if not self.stats.sampling:
            return
        sums = torch.zeros(4, dtype=torch.float64, device=inputs[0].device)
        for payload, reference in zip(payloads, inputs):
            estimate = self.compressor.decompress(payload).float()
            reference = reference.float()
            sums += torch.stack([
                (estimate - reference).square().sum(), reference.square().sum(),
                (estimate * reference).sum(), estimate.square().sum(),
            ]).double()
        err_sq, ref_sq, dot, est_sq = sums.tolist()  # one device sync for the whole call
        self.stats.sample_err_sq += err_sq
        self.stats.sample_ref_sq += ref_sq
        self.stats.sample_dot += dot
        self.stats.sample_est_sq += est_sq

    def hold(self, nbytes: int) -> None:
        """Record one call's send and receive buffers; the stats keep the largest call's."""
        self.stats.buffer_bytes = max(self.stats.buffer_bytes, nbytes)

    def decompress(self, payloads: list[Payload], device: torch.device) -> torch.Tensor:
        """The float32 sum of the decompressed payloads."""
        with _Timer(device) as timer:
            total = self.compressor.decompress(payloads[0]).float()
            for payload in payloads[1:]:
                total = total + self.compressor.decompress(payload)
        self.stats.decompress_s += timer.seconds
        return total

    def collective(self, fn, *args, extra: bool, **kwargs) -> None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with _Timer(device) as timer:
            fn(*args, **kwargs)
        if extra:
            self.stats.extra_collectives += 1
            self.stats.extra_collective_s += timer.seconds


class CompressedReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter of compressed gradient rows (see the module docstring for the two paths)."""

    def __init__(self, compressor: Compressor, stats: CommStats, name: str):
        self.mover = _PayloadMover(compressor, stats, name)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        mover, stats = self.mover, self.mover.stats
        world, rank = group.size(), group.rank()
        rows = mover.screen(input_tensor.float()).view(world, -1)
        seed = mover.next_seed()
        stats.calls += 1
        stats.numel += rows.numel()
        stats.bytes_raw += (world - 1) * rows.shape[1] * 4
        if mover.compressor.linear:
            rows = rows / world  # average on the wire: the sum of fp16 payloads cannot overflow
        payloads = [mover.compress(rows[d], f"{mover.name}/{d}", seed + d) for d in range(world)]
        mover.sample(payloads, list(rows))
        if mover.compressor.linear:
            result = mover.decompress([self._reduce_scatter_payloads(payloads, group, rank)], rows.device)
        else:
            result = mover.decompress(self._all_to_all(payloads, group, rank, rows.shape[1]), rows.device)
        output_tensor.copy_(_apply_op(result, op, world, prescaled=mover.compressor.linear))
        return None

    def _reduce_scatter_payloads(self, payloads: list[Payload], group, rank: int) -> Payload:
        mover, stats = self.mover, self.mover.stats
        world = len(payloads)
        summed, held = {}, 0
        for index, name in enumerate(payloads[0].tensors):
            shape = payloads[rank].tensors[name].shape
            stacked = torch.cat([p.tensors[name].reshape(-1) for p in payloads])
            out = stacked.new_empty(stacked.numel() // world)
            mover.collective(dist.reduce_scatter_tensor, out, stacked, op=dist.ReduceOp.SUM, group=group, extra=index > 0)
            summed[name] = out.view(shape)
            held += _nbytes(stacked, out)
        mover.hold(held)
        mine = payloads[rank]
        # Scalars (seeds) are equal on all ranks and derived from the shared call count: not sent again.
        stats.bytes_sent += (world - 1) * (mine.nbytes - SCALAR_BYTES * len(mine.scalars))
        stats.bytes_index += (world - 1) * mine.index_nbytes
        return Payload(numel=mine.numel, tensors=summed, scalars=mine.scalars, index_names=mine.index_names)

    def _all_to_all(self, payloads: list[Payload], group, rank: int, numel: int) -> list[Payload]:
        mover, stats = self.mover, self.mover.stats
        buffers = [serialize(p) if d != rank else None for d, p in enumerate(payloads)]
        device = next(b.device for b in buffers if b is not None)
        send_sizes = torch.tensor([0 if b is None else b.numel() for b in buffers], dtype=torch.int64, device=device)
        recv_sizes = torch.empty_like(send_sizes)
        mover.collective(dist.all_to_all_single, recv_sizes, send_sizes, group=group, extra=True)
        send = torch.cat([b for b in buffers if b is not None])
        recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=device)
        mover.collective(
            dist.all_to_all_single, recv, send,
            output_split_sizes=recv_sizes.tolist(), input_split_sizes=send_sizes.tolist(), group=group, extra=False,
        )
        mover.hold(_nbytes(*(b for b in buffers if b is not None), send, recv, send_sizes, recv_sizes))
        stats.bytes_sent += int(send_sizes.sum()) + send_sizes.numel() * 8
        stats.bytes_index += sum(p.index_nbytes for d, p in enumerate(payloads) if d != rank)
        received = [payloads[rank]]
        for source, chunk in enumerate(torch.split(recv, recv_sizes.tolist())):
            if source != rank:
                received.append(deserialize(chunk, numel))
        return received


class CompressedAllReduce:
    """All-reduce hook for the replicate dimension: averages a reduced shard across replicas."""

    def __init__(self, compressor: Compressor, stats: CommStats, name: str, group: dist.ProcessGroup):
        self.mover = _PayloadMover(compressor, stats, name)
        self.group = group

    def __call__(self, reduce_output: torch.Tensor) -> None:
        mover, stats, group = self.mover, self.mover.stats, self.group
        world = group.size()
        flat = mover.screen(reduce_output.float()).view(-1)
        seed = mover.next_seed()
        stats.calls += 1
        stats.numel += flat.numel()
        stats.bytes_raw += 2 * (world - 1) * flat.numel() * 4 // world  # a ring all-reduce
        if mover.compressor.linear:
            scaled = flat / world
            payload = mover.compress(scaled, f"{mover.name}/ar", seed)
            mover.sample([payload], [scaled])
            mover.hold(_nbytes(*payload.tensors.values()))  # reduced in place
            for index, tensor in enumerate(payload.tensors.values()):
                mover.collective(dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=group, extra=index > 0)
            stats.bytes_sent += 2 * (world - 1) * (payload.nbytes - SCALAR_BYTES * len(payload.scalars)) // world
            result = mover.decompress([payload], flat.device)
        else:
            payload = mover.compress(flat, f"{mover.name}/ar", seed + group.rank())
            mover.sample([payload], [flat])
            buffer = serialize(payload)
            sizes = [torch.zeros(1, dtype=torch.int64, device=flat.device) for _ in range(world)]
            mover.collective(dist.all_gather, sizes, torch.tensor([buffer.numel()], device=flat.device), group=group, extra=True)
            longest = int(max(s.item() for s in sizes))
            gathered = [torch.empty(longest, dtype=torch.uint8, device=flat.device) for _ in range(world)]
            padded = torch.nn.functional.pad(buffer, (0, longest - buffer.numel()))
            mover.collective(dist.all_gather, gathered, padded, group=group, extra=False)
            mover.hold(_nbytes(buffer, padded, *gathered, *sizes))
            stats.bytes_sent += (world - 1) * (longest + 8)
            stats.bytes_index += (world - 1) * payload.index_nbytes
            me = group.rank()
            payloads = [payload] + [deserialize(g[: int(s.item())], flat.numel()) for i, (g, s) in enumerate(zip(gathered, sizes)) if i != me]
            result = mover.decompress(payloads, flat.device) / world
        reduce_output.copy_(result.view_as(reduce_output))
