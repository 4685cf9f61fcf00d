"""Communicators: FSDP2 hooks that move compressed payloads between ranks and count every byte.

Reduce-scatter (``CompressedReduceScatter``, set with ``FSDPModule.set_custom_reduce_scatter``): FSDP2
hands over a flat gradient laid out as ``[world, shard]``; row ``d`` is what rank ``d`` must receive.

- Linear compressors (fp16/bf16 casts, shared-seed random-k, count-sketch) compress each row with the
  same seed on every rank, so the payloads line up element by element and one native
  ``reduce_scatter_tensor`` per payload tensor sums them on the wire.
- All others cannot be added on the wire (each rank has its own scales, indices or factors): each rank
  sends row ``d``'s payload to rank ``d`` with ``all_to_all_single``, and the receiver decompresses every
  source's payload and sums in float32, in rank order.

All-reduce over the replicate dimension of NO_SHARD / HYBRID_SHARD (``CompressedAllReduce``, set with
``FSDPModule.set_all_reduce_hook``): FSDP then runs on the shard sub-mesh and this hook averages the
reduced shard across replicas, natively for linear payloads and by ``all_gather`` of payloads otherwise.
Every replica decodes the same gathered bytes and adds them in rank order, so all replicas get the same
bits (float addition is not associative: any other order lets replicas drift apart).

No hook call waits for the device. Payloads travel without headers (``compress.payload``: the receiver
knows their layout); a variable-size compressor's kept counts are exchanged on the device and read to
the host once per call, the one wait such a method needs to size its buffers. Time is measured with
device events (``compress.timing``) and non-finite counts and sampled errors stay on the device until
``CommStats.take`` reads them, once a step.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from compress.payload import (
    SCALAR_BYTES, Compressor, Payload, is_variable_size, layout_nbytes, layout_of, nbytes, pack, unpack,
)
from compress.timing import DeviceClock
from compress.torch_compat import ReduceScatter, all_gather_bytes, all_gather_flat, reduce_scatter_flat


@dataclass
class CommStats:
    """Counters of one rank, summed over all hooks (``buffer_bytes``: the maximum); ``take()`` returns and clears them.

    Times, the non-finite count and the sampled sums are gathered on the device while hooks run and
    read by ``take()``, once a step, so that no hook call waits for the device.
    """

    calls: int = 0
    numel: int = 0
    bytes_raw: int = 0  # what the uncompressed float32 collective would send from this rank
    bytes_sent: int = 0  # what was sent, payloads plus count exchanges
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
        # Not counters, so take() leaves them: CompressionStats turns sampling on for the steps it samples.
        self.sampling = False
        self.clock = DeviceClock()
        self.hooks: list[HookCounters] = []  # each hook's device counters (see HookCounters)
        self._taken = [0.0] * 5  # run totals (non-finite, the four sample sums) already returned by take()

    def new_hook(self) -> HookCounters:
        """Device counters for one more hook."""
        self.hooks.append(HookCounters())
        return self.hooks[-1]

    def _device_totals(self) -> torch.Tensor | None:
        """The run totals of every hook (non-finite, sample sums) as one float64 tensor, summed on the current stream."""
        started = [hook.totals for hook in self.hooks if hook.totals is not None]
        if not started:
            return None
        return torch.stack([totals.to(started[0].device) for totals in started]).sum(0)

    def nonfinite_total(self) -> torch.Tensor | None:
        """Non-finite values seen this run, as a device tensor (None before any hook ran): the guard reads it."""
        totals = self._device_totals()
        return None if totals is None else totals[0]

    def take(self) -> dict[str, float]:
        """Every counter since the last take, then zero: waits for the device once (times) and reads it once."""
        for name, seconds in self.clock.read().items():
            setattr(self, name, getattr(self, name) + seconds)
        totals = self._device_totals()
        if totals is not None:
            read = totals.tolist()
            new = [total - taken for total, taken in zip(read, self._taken)]
            self._taken = read
            self.nonfinite += round(new[0])
            self.sample_err_sq += new[1]
            self.sample_ref_sq += new[2]
            self.sample_dot += new[3]
            self.sample_est_sq += new[4]
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return values


class HookCounters:
    """One hook's run totals on the device: non-finite values, and the four sums of sampled steps (float64).

    Made at the hook's first call on the stream it runs on and only added to in place there, so that hooks
    on different streams (HYBRID_SHARD's reduce-scatter and all-reduce) never touch the same memory;
    ``CommStats`` sums them on the default stream, which FSDP2 makes wait for every hook's stream.
    """

    def __init__(self) -> None:
        self.totals: torch.Tensor | None = None

    def _totals(self, device: torch.device) -> torch.Tensor:
        if self.totals is None:
            self.totals = torch.zeros(5, dtype=torch.float64, device=device)
        return self.totals

    def count_nonfinite(self, count: torch.Tensor) -> None:
        """Add a device count of non-finite values (no host read)."""
        self._totals(count.device)[0].add_(count)

    def add_samples(self, sums: torch.Tensor) -> None:
        """Add a sampled call's (err_sq, ref_sq, dot, est_sq) float64 sums, on the device."""
        self._totals(sums.device)[1:].add_(sums)


def kept_values(payload: Payload) -> int:
    """Elements of ``payload`` that carry a value: the k a sparsifier kept, all ``numel`` for every other method.

    Quantisers, the count-sketch and low rank encode every element (density 1.0). Known on the host
    (``Payload.kept``), so counting needs no read of the index encoding.
    """
    return payload.numel if payload.kept is None else payload.kept


def compressing(compressor: Compressor) -> bool:
    """Whether ``compressor`` compresses this call (1-bit Adam does not during its warm-up: ``compressing``)."""
    return bool(getattr(compressor, "compressing", True))


def adds_in_float32(compressor: Compressor) -> bool:
    """Whether a linear compressor's payloads add on the wire in float32 (randomk's values); a 16-bit cast's would
    add in 16 bits, rounding every partial sum."""
    inner = getattr(compressor, "inner", compressor)  # error feedback's
    return getattr(inner, "dtype", torch.float32) == torch.float32


def count_uncompressed(stats: CommStats, tensor: torch.Tensor, sent_share: float) -> None:
    """Count a call that sent ``tensor`` uncompressed; ``sent_share`` of its elements leave this rank."""
    stats.calls += 1
    stats.numel += tensor.numel()
    stats.values_sent += tensor.numel()
    stats.bytes_raw += round(sent_share * tensor.numel()) * 4
    stats.bytes_sent += round(sent_share * tensor.numel()) * tensor.element_size()


def screen(tensor: torch.Tensor, counters: HookCounters) -> torch.Tensor:
    """Non-finite gradient values are counted on the device (the strategy's guard reads the count) and sent as zeros."""
    finite = torch.isfinite(tensor)
    counters.count_nonfinite(finite.numel() - finite.sum())
    return torch.where(finite, tensor, 0.0)


def apply_op(result: torch.Tensor, op: object, world: int, prescaled: bool) -> torch.Tensor:
    """``result`` is the sum over ranks (or the mean, when inputs were ``prescaled`` by 1/world)."""
    if op == dist.ReduceOp.AVG:
        return result if prescaled else result / world
    if op == dist.ReduceOp.SUM:
        return result * world if prescaled else result
    raise ValueError(f"compressed reduce-scatter supports ReduceOp SUM and AVG, got {op}; do not set a gradient divide factor")


class RestoredState:
    """Compressor state loaded from a checkpoint, adopted by each stream that uses it at its hooks' first calls.

    Loaded tensors are allocated on the default stream; FSDP2 runs the hooks on its reduce-scatter and
    all-reduce streams. Each hook, at its first call after a load, records the tensors as used by its
    stream, so that the caching allocator does not hand their memory to the default stream while that
    stream still reads them (when a hook replaces a residual, the old one is freed). Once every hook has
    done so, the list is dropped, and with it the last reference to state the compressor has replaced.
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._hooks = 0  # hooks registered
        self._pending: set[int] = set()  # hooks that have not adopted since the last load

    def register(self) -> int:
        """A number for one more hook."""
        self._hooks += 1
        return self._hooks - 1

    def load(self, tensors: list[torch.Tensor]) -> None:
        """The compressor's tensors after a load (only CUDA ones matter)."""
        self.tensors = [t for t in tensors if t.is_cuda]
        self._pending = set(range(self._hooks)) if self.tensors else set()

    def adopt(self, hook: int) -> None:
        if hook not in self._pending:
            return
        self._pending.discard(hook)
        for tensor in self.tensors:
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        if not self._pending:
            self.tensors = []


class PayloadMover:
    """What the hooks share: the compressor, the counters, non-finite screening, per-call seeds and timing."""

    def __init__(self, compressor: Compressor, stats: CommStats, name: str, restored: RestoredState | None = None):
        self.compressor = compressor
        self.stats = stats
        self.name = name
        self.restored = restored or RestoredState()
        self._hook = self.restored.register()
        self.counters = stats.new_hook()
        self._base_seed = zlib.crc32(name.encode())
        self.calls = 0  # kept in checkpoints: a resumed run draws the seeds the uninterrupted one would

    def next_seed(self) -> int:
        """The next call's seed; every rank runs the same hooks in the same order, so it agrees across ranks."""
        self.restored.adopt(self._hook)
        self.calls += 1
        return self._base_seed * 1_000_003 + self.calls * 1009

    def screen(self, tensor: torch.Tensor) -> torch.Tensor:
        return screen(tensor, self.counters)

    def timed(self, counter: str, device: torch.device):
        """A block whose device time is added to ``counter`` (``compress_s``, ``decompress_s``, ...)."""
        return self.stats.clock.time(counter, device)

    def compress(self, tensor: torch.Tensor, key: str, seed: int, kept: int | None = None) -> Payload:
        with self.timed("compress_s", tensor.device):
            if kept is None:
                payload = self.compressor.compress(tensor, key, seed)
            else:
                payload = self.compressor.compress(tensor, key, seed, kept=kept)
        self.stats.values_sent += kept_values(payload)
        return payload

    def kept_counts(self, rows: list[torch.Tensor], keys: list[str]) -> torch.Tensor:
        """A variable-size compressor's count for each row, as one int64 device tensor."""
        with self.timed("compress_s", rows[0].device):
            return torch.stack([self.compressor.kept_count(row, key) for row, key in zip(rows, keys)]).long()

    def sample(self, payloads: list[Payload], inputs: list[torch.Tensor], keys: list[str]) -> None:
        """On a sampled step, decode this rank's own ``payloads`` and compare them with the ``inputs`` they came from.

        ``inputs`` are the rows as handed to the compressor, before error feedback adds its residual (a
        compressor that encodes something else, such as 1-bit Adam's momentum, names it: ``compared_with``). A
        measurement, not the method's cost: no communication, and not counted in compress_s/decompress_s.
        Call it before any collective, which may reduce payload tensors in place.
        """
        if not self.stats.sampling:
            return
        compared_with = getattr(self.compressor, "compared_with", None)
        if compared_with is not None:
            inputs = [compared_with(row, key) for row, key in zip(inputs, keys)]
        sums = torch.zeros(4, dtype=torch.float64, device=inputs[0].device)
        for payload, reference in zip(payloads, inputs):
            estimate = self.compressor.decompress(payload).float()
            reference = reference.float()
            sums += torch.stack([
                (estimate - reference).square().sum(), reference.square().sum(),
                (estimate * reference).sum(), estimate.square().sum(),
            ]).double()
        self.counters.add_samples(sums)

    def hold(self, size: int) -> None:
        """Record one call's send and receive buffers; the stats keep the largest call's."""
        self.stats.buffer_bytes = max(self.stats.buffer_bytes, size)

    def decompress(self, payloads: list[Payload], device: torch.device) -> torch.Tensor:
        """The float32 sum of the decompressed payloads, added in the order given (rank order: see the module docstring)."""
        with self.timed("decompress_s", device):
            total = self.compressor.decompress(payloads[0]).float()
            for payload in payloads[1:]:
                total = total + self.compressor.decompress(payload)
        return total

    def collective(self, fn, *args, extra: bool, **kwargs) -> None:
        """Run collective ``fn``; one beyond what the uncompressed path needs (``extra``) is counted and timed."""
        if not extra:
            fn(*args, **kwargs)
            return
        self.stats.extra_collectives += 1
        with self.timed("extra_collective_s", next(a.device for a in args if isinstance(a, torch.Tensor))):
            fn(*args, **kwargs)

    def read_counts(self, *counts: torch.Tensor) -> list[list[int]]:
        """Exchanged kept counts on the host: the one read a variable-size method makes per call."""
        flat = torch.cat([c.reshape(-1) for c in counts]).tolist()
        out, offset = [], 0
        for c in counts:
            out.append(flat[offset : offset + c.numel()])
            offset += c.numel()
        return out


def keep_alive(reduce_output: torch.Tensor) -> None:
    """Record an all-reduce hook's input as used by the hook's stream.

    FSDP2 allocates it on the reduce-scatter stream and, when it casts the result to another dtype, drops its
    last reference once the hook has been queued: without this its memory could be reused while the hook's
    kernels still read it.
    """
    if reduce_output.is_cuda:
        reduce_output.record_stream(torch.cuda.current_stream(reduce_output.device))


class CompressedReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter of compressed gradient rows (see the module docstring for the two paths)."""

    def __init__(self, compressor: Compressor, stats: CommStats, name: str, restored: RestoredState | None = None):
        self.mover = PayloadMover(compressor, stats, name, restored)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        mover, stats = self.mover, self.mover.stats
        world, rank = group.size(), group.rank()
        seed = mover.next_seed()
        if not compressing(mover.compressor):
            self._uncompressed(output_tensor, input_tensor, group, op)
            return None
        rows = mover.screen(input_tensor.float()).view(world, -1)
        stats.calls += 1
        stats.numel += rows.numel()
        stats.bytes_raw += (world - 1) * rows.shape[1] * 4
        keys = [self.key(d) for d in range(world)]
        if mover.compressor.linear:
            rows = rows / world  # average on the wire: the sum of fp16 payloads cannot overflow
        kept = theirs = [None] * world
        if is_variable_size(mover.compressor):
            kept, theirs = self._exchange_counts(mover.kept_counts(list(rows), keys), group)
        payloads = [mover.compress(rows[d], keys[d], seed + d, kept[d]) for d in range(world)]
        mover.sample(payloads, list(rows), keys)
        if mover.compressor.linear:
            result = mover.decompress([self._reduce_scatter_payloads(payloads, group, rank)], rows.device)
        else:
            result = mover.decompress(self._all_to_all(payloads, theirs, group, rank), rows.device)
        output_tensor.copy_(apply_op(result, op, world, prescaled=mover.compressor.linear))
        return None

    def key(self, destination: int) -> str:
        """The compressor's key for the row sent to rank ``destination``."""
        return f"{self.mover.name}/{destination}"

    def _uncompressed(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op: object) -> None:
        """FSDP2's own reduce-scatter, the same collective with the same op (a method's uncompressed warm-up)."""
        mover, stats, world = self.mover, self.mover.stats, group.size()
        mover.collective(reduce_scatter_flat, output_tensor, input_tensor, op=op, group=group, extra=False)
        count_uncompressed(stats, input_tensor, sent_share=(world - 1) / world)

    def _exchange_counts(self, counts: torch.Tensor, group) -> tuple[list[int], list[int]]:
        """This rank's count per destination row, and every source's count for this rank's row (one host read)."""
        mover, world = self.mover, group.size()
        received = torch.empty_like(counts)
        mover.collective(dist.all_to_all_single, received, counts, group=group, extra=True)
        mover.stats.bytes_sent += (world - 1) * 8
        mine, theirs = mover.read_counts(counts, received)
        return mine, theirs

    def _reduce_scatter_payloads(self, payloads: list[Payload], group, rank: int) -> Payload:
        mover, stats = self.mover, self.mover.stats
        world = len(payloads)
        summed, held = {}, 0
        for index, name in enumerate(payloads[0].tensors):
            shape = payloads[rank].tensors[name].shape
            stacked = torch.cat([p.tensors[name].reshape(-1) for p in payloads])
            out = stacked.new_empty(stacked.numel() // world)
            mover.collective(reduce_scatter_flat, out, stacked, op=dist.ReduceOp.SUM, group=group, extra=index > 0)
            summed[name] = out.view(shape)
            held += nbytes(stacked, out)
        mover.hold(held)
        mine = payloads[rank]
        # Scalars (seeds) are equal on all ranks and derived from the shared call count: not sent again.
        stats.bytes_sent += (world - 1) * (mine.nbytes - SCALAR_BYTES * len(mine.scalars))
        stats.bytes_index += (world - 1) * mine.index_nbytes
        return Payload(mine.numel, summed, mine.scalars, mine.index_names, mine.kept, mine.matrices)

    def _all_to_all(self, payloads: list[Payload], theirs: list[int | None], group, rank: int) -> list[Payload]:
        """Row ``d``'s payload to rank ``d``; every source's payload for this rank's row, in rank order."""
        mover, stats, world = self.mover, self.mover.stats, len(payloads)
        mine = payloads[rank]
        if theirs[0] is None:  # fixed size: every source's payload for this row is laid out as this rank's own
            layouts = [(layout_of(mine), mine)] * world
        else:
            layouts = [mover.compressor.layout(mine.numel, count) for count in theirs]
        send_sizes = [0 if d == rank else nbytes(*p.tensors.values()) for d, p in enumerate(payloads)]
        recv_sizes = [0 if s == rank else layout_nbytes(layout) for s, (layout, _) in enumerate(layouts)]
        send = torch.cat([pack(p) for d, p in enumerate(payloads) if d != rank])
        recv = send.new_empty(sum(recv_sizes))
        mover.collective(dist.all_to_all_single, recv, send, output_split_sizes=recv_sizes,
                         input_split_sizes=send_sizes, group=group, extra=False)
        mover.hold(nbytes(send, recv))
        stats.bytes_sent += sum(send_sizes)
        stats.bytes_index += sum(p.index_nbytes for d, p in enumerate(payloads) if d != rank)
        chunks = torch.split(recv, recv_sizes)
        return [mine if s == rank else unpack(chunks[s], layout, like) for s, (layout, like) in enumerate(layouts)]


class CompressedAllReduce:
    """All-reduce hook for the replicate dimension: averages a reduced shard across replicas (bit-identical on each)."""

    def __init__(self, compressor: Compressor, stats: CommStats, name: str, group: dist.ProcessGroup,
                 restored: RestoredState | None = None):
        self.mover = PayloadMover(compressor, stats, name, restored)
        self.group = group

    @property
    def key(self) -> str:
        """The compressor's key for this rank's reduced shard."""
        return f"{self.mover.name}/ar"

    def __call__(self, reduce_output: torch.Tensor) -> None:
        mover, stats, group = self.mover, self.mover.stats, self.group
        world = group.size()
        keep_alive(reduce_output)
        seed = mover.next_seed()
        if not compressing(mover.compressor):  # a method's uncompressed warm-up: the replicas' plain average
            mover.collective(dist.all_reduce, reduce_output, op=dist.ReduceOp.SUM, group=group, extra=False)
            reduce_output.div_(world)
            count_uncompressed(stats, reduce_output, sent_share=2 * (world - 1) / world)  # a ring all-reduce
            return
        flat = mover.screen(reduce_output.float()).view(-1)
        key = self.key
        stats.calls += 1
        stats.numel += flat.numel()
        stats.bytes_raw += 2 * (world - 1) * flat.numel() * 4 // world  # a ring all-reduce
        # 16-bit payloads (fp16, bf16) would add in 16 bits on the wire: gathered and added in float32 instead, as the
        # quantisers' are (for 2 replicas an all-gather sends what a ring all-reduce does)
        if mover.compressor.linear and adds_in_float32(mover.compressor):
            scaled = flat / world
            payload = mover.compress(scaled, key, seed)
            mover.sample([payload], [scaled], [key])
            mover.hold(nbytes(*payload.tensors.values()))  # reduced in place
            for index, tensor in enumerate(payload.tensors.values()):
                mover.collective(dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=group, extra=index > 0)
            stats.bytes_sent += 2 * (world - 1) * (payload.nbytes - SCALAR_BYTES * len(payload.scalars)) // world
            result = mover.decompress([payload], flat.device)
        else:
            result = mover.decompress(self._gather(flat, key, seed), flat.device) / world
        reduce_output.copy_(result.view_as(reduce_output))

    def _gather(self, flat: torch.Tensor, key: str, seed: int) -> list[Payload]:
        """Every replica's payload, in rank order, decoded from the same gathered bytes on every rank.

        Every rank compresses with the same seed (private randomness is salted by the rank), so a
        fixed-size payload has the same layout everywhere and needs no size exchange.
        """
        mover, stats, group = self.mover, self.mover.stats, self.group
        world = group.size()
        counts: list[int | None] = [None] * world
        kept = None
        if is_variable_size(mover.compressor):
            mine = mover.kept_counts([flat], [key])
            everyone = mine.new_empty(world)
            mover.collective(all_gather_flat, everyone, mine, group=group, extra=True)
            (counts,) = mover.read_counts(everyone)
            kept = counts[group.rank()]
            stats.bytes_sent += (world - 1) * 8
        payload = mover.compress(flat, key, seed, kept)
        mover.sample([payload], [flat], [key])
        if kept is None:
            layouts = [(layout_of(payload), payload)] * world
        else:
            layouts = [mover.compressor.layout(flat.numel(), count) for count in counts]
        longest = max(layout_nbytes(layout) for layout, _ in layouts)
        local = pack(payload)
        local = torch.nn.functional.pad(local, (0, longest - local.numel()))
        gathered = local.new_empty(world * longest)
        mover.collective(all_gather_bytes, gathered, local, group=group, extra=False)
        mover.hold(nbytes(local, gathered))
        stats.bytes_sent += (world - 1) * longest
        stats.bytes_index += (world - 1) * payload.index_nbytes
        parts = gathered.view(world, longest)
        return [unpack(parts[s], layout, like) for s, (layout, like) in enumerate(layouts)]
