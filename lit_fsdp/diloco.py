"""Semi-synchronous data parallelism (DiLoCo and Streaming DiLoCo) across the replicate dimension.

Each replica group trains on its own for ``sync_every`` (H) optimizer steps: FSDP2 reduces gradients inside the group
only. Then the groups average the pseudo-gradient ``delta = theta_outer - theta_local`` over the replicate dimension
and apply it to ``theta_outer`` with Nesterov SGD (Douillard et al., arXiv 2311.08105: learning rate 0.7, momentum
0.9); each replica restarts from the new ``theta_outer``. Its inner AdamW state stays its own. ``SemiSyncConfig``
holds H and the outer step (``OuterConfig``).

Streaming (arXiv 2501.18512): the model is cut into ``fragments`` (FSDP units taken in turn: unit u belongs to
fragment u mod P) that synchronise at staggered steps, fragment p at the steps t = p * H / P (mod H). A
fragment's average is sent at step t and applied ``delay`` steps later (tau): the exchange runs on a thread of
its own, on the host, while the inner steps go on. Then the fragment's local weights become
``mix * local + (1 - mix) * theta_outer`` (alpha; 0 restarts the fragment from ``theta_outer``).

Each rank keeps ``theta_outer`` and the outer momentum in float32 for its own shard of the trained
parameters, in (pinned) host memory or on the device. The pseudo-gradients go through a codec from
``compress`` (none, bf16, int8 with ``num_bits`` 4, topk with a quantiser and error feedback, ...) by
``compress.communicator.CompressedAllReduce``: every replica decodes the same gathered bytes in rank order, so
every replica applies the same update to the same bits.

A run ends on a synchronisation (``end_on_synchronisation``, at fit's last step): averages in flight are applied and
every fragment that trained since its last exchange is exchanged once more, in line, so the last model is the
average (every replica the same bits) and ``export`` writes it. That final average is for the model that leaves:
a checkpoint taken after it keeps the state from before it (each replica's weights, theta_outer, averages in flight),
so a run extended past its ``max_steps`` continues as the uninterrupted run would.

Bytes (``ExchangeCounters``, what ``callbacks.CompressionStats`` takes each step): ``bytes_raw`` counts, every
optimizer step, what a per-step float32 ring all-reduce of this rank's trained shard would send over the replicate
dimension; ``bytes_sent`` what the synchronisations sent, the final one included. Their ratio is the run's
``compression_ratio``, exact for any ``max_steps``. The run's figures (synchronisations, their time) are
``lit_fsdp.reporting.SemiSyncFigures``.

``lit_fsdp.semi_sync.SemiSync`` is what the strategy composes: it builds an ``OuterSync`` and calls it from the
strategy's life cycle.

Validation (``swap_in_outer``/``swap_out_outer``) scores theta_outer, the replicas' last average, the same on every
replica, so each rank's share of the validation set is scored by one model and the reduction covers the whole set.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from compress.communicator import CommStats, CompressedAllReduce
from compress.config import CompressionConfig
from lit_fsdp.errors import OneLineError
from lit_fsdp.reporting import SemiSyncFigures

#: codecs whose payload the replicate all-reduce can gather or add (``compress.communicators.COMPRESSED``)
OUTER_CODECS = ("none", "fp16", "bf16", "fp8", "int8", "qsgd", "natural", "topk", "randomk", "thresholdv", "signsgd",
                "onebit", "sparseloco")
_OPTION = "--trainer.strategy.init_args.outer"


@dataclass
class OuterConfig:
    """The outer step of semi-synchronous training: ``--trainer.strategy.init_args.outer '{lr: 0.7, codec: {method:
    int8, num_bits: 4}}'``; unset fields keep DiLoCo's defaults."""

    lr: float = 0.7
    """outer learning rate on the averaged pseudo-gradient"""
    momentum: float = 0.9
    """outer momentum"""
    nesterov: bool = True
    """Nesterov momentum (DiLoCo's outer optimizer)"""
    codec: CompressionConfig = field(default_factory=CompressionConfig)
    """how pseudo-gradients travel: {method: none} (float32), bf16, {method: int8, num_bits: 4}, {method: sparseloco}
    (64 of every 4096 values in 2 bits, with lr 1.0 and momentum 0.0), ... (python -m lit_fsdp compressors)"""
    fragments: int = 1
    """streaming: FSDP units taken in turn into this many fragments, each synchronised at its own step (1: the whole
    model at once)"""
    delay: int = 0
    """streaming: inner steps between sending a fragment's pseudo-gradient and applying its average (tau); the exchange
    runs meanwhile (needs state_device cpu)"""
    mix: float = 0.0
    """streaming: a fragment's local weights after its update, mix * local + (1 - mix) * outer (alpha; 0: the outer)"""
    state_device: Literal["cpu", "device"] = "cpu"
    """where theta_outer, the outer momentum and the exchange live: cpu (pinned on GPUs; the exchange runs on a thread
    over gloo and can overlap) or device (no copies; the exchange runs in line)"""

    def __post_init__(self) -> None:
        if isinstance(self.codec, dict):
            self.codec = CompressionConfig(**self.codec)
        if not self.lr > 0 or not 0 <= self.momentum < 1 or not 0 <= self.mix < 1:
            raise OneLineError(f"{_OPTION}: lr={self.lr}, momentum={self.momentum}, mix={self.mix}: give lr > 0 and "
                               "momentum and mix in [0, 1)")
        if self.fragments < 1 or self.delay < 0:
            raise OneLineError(f"{_OPTION}: fragments={self.fragments}, delay={self.delay}: give fragments >= 1 and "
                               "delay >= 0")
        if self.state_device not in ("cpu", "device"):
            raise OneLineError(f"{_OPTION}.state_device {self.state_device!r}: give cpu or device")
        if self.delay and self.state_device == "device":
            raise OneLineError(f"{_OPTION}: delay={self.delay} overlaps the exchange with the inner steps, which needs "
                               "state_device cpu; set delay 0 or state_device cpu")
        if self.codec.method not in OUTER_CODECS:
            raise OneLineError(f"{_OPTION}.codec.method {self.codec.method!r} cannot average pseudo-gradients across "
                               f"replicas; choose one of {', '.join(OUTER_CODECS)}")
        self.codec.build(rank=0)  # an unknown or misplaced codec parameter: one line now

    def check_units(self, units: int) -> None:
        """Refuse more fragments than the model has FSDP units."""
        if self.fragments > units:
            raise OneLineError(f"{_OPTION}.fragments={self.fragments} exceeds the model's {units} FSDP units (its blocks' "
                               f"and the root); give fragments <= {units} (or a smaller blocks_per_group)")

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for the results record."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["codec"] = {k: v for k, v in vars(self.codec).items() if v is not None}
        return values


@dataclass
class SemiSyncConfig:
    """Semi-synchronous training: ``sync_every`` (H) inner optimizer steps between two synchronisations of each
    fragment, and the outer step (``outer``). ``FSDP2Strategy`` builds it from its ``sync_every`` and ``outer``
    arguments; every setting that cannot run with H is refused here, in one line."""

    sync_every: int
    outer: OuterConfig = field(default_factory=OuterConfig)

    def __post_init__(self) -> None:
        every = self.sync_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"sync_every={every!r}: give the optimizer steps between synchronisations of the replica "
                             "groups, an integer >= 1, or 0 to synchronise every step")
        if isinstance(self.outer, dict):
            self.outer = OuterConfig(**self.outer)
        if self.outer.fragments > every:
            raise OneLineError(f"{_OPTION}.fragments={self.outer.fragments} exceeds sync_every={every}: each fragment "
                               "synchronises at its own step of the H; give fragments <= sync_every")
        if self.outer.delay >= every:
            raise OneLineError(f"{_OPTION}.delay={self.outer.delay}: a fragment's average must be applied before its "
                               f"next synchronisation, sync_every={every} steps later; give delay < sync_every")

    @property
    def name(self) -> str:
        """``diloco<H>``, in the strategy's label and the compression method's name."""
        return f"diloco{self.sync_every}"


def ring_all_reduce_bytes(numel: int, replicas: int) -> int:
    """What one rank sends in a float32 ring all-reduce of ``numel`` values over ``replicas`` ranks."""
    return round(2 * (replicas - 1) / replicas * numel) * 4  # as compress.communicator.count_uncompressed counts it


def outer_state_bytes(config: OuterConfig, trained: int) -> int:
    """One rank's outer state for its ``trained`` parameters (its shard): theta_outer and the momentum in float32,
    the codec's error-feedback residual, and one fragment's pseudo-gradient in flight."""
    per_parameter = 8 + (4 if config.codec.error_feedback else 0)
    return per_parameter * trained + 4 * -(-trained // config.fragments)


def exchange_bytes(config: SemiSyncConfig, trained: int, replicas: int, sample: int = 1 << 20) -> float:
    """What one rank sends per optimizer step, averaged over ``sync_every`` steps: a ring all-reduce of its ``trained``
    shard for ``none`` and the codecs that add on the wire, otherwise its payload to every other replica. The
    payload's size is measured on ``sample`` random values."""
    sync_every = config.sync_every
    compressor = config.outer.codec.build(rank=0)
    if compressor is None:
        return ring_all_reduce_bytes(trained, replicas) / sync_every
    n = min(trained, sample)
    payload = compressor.compress(torch.randn(n, generator=torch.Generator().manual_seed(0)), "estimate", 1)
    share = payload.nbytes / (4 * n)
    if getattr(compressor, "linear", False):
        return ring_all_reduce_bytes(trained, replicas) * share / sync_every
    return (replicas - 1) * 4 * trained * share / sync_every


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded parameter (or optimizer state), the tensor itself otherwise."""
    return param.to_local() if isinstance(param, DTensor) else param


class ExchangeCounters:
    """This rank's outer exchanges as ``callbacks.CompressionStats`` takes them each step
    (``lit_fsdp.reporting.CommCounters``).

    ``bytes_raw`` is counted every inner step: what a per-step float32 ring all-reduce of the trained shard would send.
    The other counters are those of the exchanges that ended since the last take. Each fragment's all-reduce counts
    into a ``CommStats`` of its own, because it may run on the exchange thread while this is taken; that is read once
    the exchange ended, less its raw bytes (one synchronisation's, not one per step).
    """

    sampling = False  # CompressionStats sets it on sampled steps; pseudo-gradients are not sampled

    def __init__(self) -> None:
        self.bytes_raw = 0
        self._ended: list[dict[str, float]] = []

    def add_exchange(self, counters: dict[str, float]) -> None:
        """An ended exchange's counters, as its ``CommStats.take()`` returned them."""
        self._ended.append(counters)

    def take(self) -> dict[str, float]:
        """Every counter since the last take, ``CommStats``' fields (``buffer_bytes`` the largest call's), then zero."""
        taken = CommStats().take()  # every counter at zero, of its type
        for ended in self._ended:
            for key, value in ended.items():
                taken[key] = max(taken[key], value) if key == "buffer_bytes" else taken[key] + value
        taken["bytes_raw"] = self.bytes_raw
        self.bytes_raw, self._ended = 0, []
        return taken


class _Fragment:
    """One fragment's trained parameters, its theta_outer and momentum (flat float32), and its exchange: the
    all-reduce over the replicas, the counters it fills and the exchange in flight."""

    def __init__(self, index: int, params: list[torch.Tensor], offset: int, device: torch.device, pin: bool,
                 codec: Any, group: dist.ProcessGroup):
        self.index, self.params, self.offset = index, params, offset
        self.numel = sum(local_shard(p).numel() for p in params)
        self.outer = torch.empty(self.numel, dtype=torch.float32, device=device, pin_memory=pin)
        self.momentum = torch.zeros(self.numel, dtype=torch.float32, device=device, pin_memory=pin)
        self.stats = CommStats()
        self.reducer = CompressedAllReduce(codec, self.stats, f"outer{index}", group)
        self.pending: torch.Tensor | None = None  # the averaged pseudo-gradient, once the exchange ended
        self.apply_at: int | None = None  # the inner step after which it is applied
        self.exchange: Future | None = None  # on the exchange thread
        self.exchange_s = 0.0

    @property
    def exchanges(self) -> int:
        """The fragment's exchanges so far. They seed the codec's shared randomness
        (``compress.communicator.PayloadMover.calls``), so a checkpoint keeps them: a resumed run draws the seeds
        the uninterrupted one would."""
        return self.reducer.mover.calls

    @exchanges.setter
    def exchanges(self, count: int) -> None:
        self.reducer.mover.calls = count

    def local_flat(self, device: torch.device) -> torch.Tensor:
        """This rank's shard of the fragment's weights, flat float32 on ``device``."""
        return torch.cat([local_shard(p).detach().reshape(-1).to(device=device, dtype=torch.float32)
                          for p in self.params])

    def write_local(self, flat: torch.Tensor) -> None:
        """Put ``flat`` (float32, on any device) into the weights' shards."""
        start = 0
        with torch.no_grad():
            for param in self.params:
                local = local_shard(param)
                local.copy_(flat[start : start + local.numel()].view_as(local))
                start += local.numel()


class OuterSync:
    """Every rank's outer state and the synchronisations of its fragments (see the module docstring).

    ``settings``: H and the outer step; ``fragments``: the trained parameters of each fragment, in the same order on
    every rank; ``group``: the replicate process group (gloo for ``state_device: cpu``). ``after_step`` follows every
    optimizer step. ``config`` (the codec's), ``stats`` (``ExchangeCounters``) and ``compressor`` are what
    ``callbacks.CompressionStats`` reads (``lit_fsdp.reporting.CompressionReport``); ``figures`` the run's figures.
    """

    def __init__(self, settings: SemiSyncConfig, fragments: list[list[torch.Tensor]], group: dist.ProcessGroup,
                 device: torch.device):
        outer = settings.outer
        self.settings, self.config, self.sync_every, self.group = settings, outer.codec, settings.sync_every, group
        self.replicas = group.size()
        self.device = torch.device("cpu") if outer.state_device == "cpu" else device
        pin = self.device.type == "cpu" and device.type == "cuda"
        self.compressor = outer.codec.build(rank=dist.get_rank())
        codec = self.compressor or _Uncompressed()
        P = len(fragments)
        self.fragments = [_Fragment(i, params, i * self.sync_every // P, self.device, pin, codec, group)
                          for i, params in enumerate(fragments)]
        self.trained_numel = sum(f.numel for f in self.fragments)
        self.stats = ExchangeCounters()
        self.steps = 0  # inner optimizer steps taken
        self.syncs = 0
        self.wait_s = 0.0  # the main thread's time blocked on exchanges
        self._thread: ThreadPoolExecutor | None = None
        self._payloads = [0, 0]  # the run's bytes sent and values given in payloads (``stats`` is taken each step)
        self._final_at: int | None = None  # the step the run ended on a synchronisation
        self._before_final: dict[str, torch.Tensor] = {}  # the state a checkpoint keeps from before that
        self._held: list[torch.Tensor] | None = None  # each fragment's local weights while theta_outer is swapped in
        self.reset_outer()

    def reset_outer(self) -> None:
        """theta_outer from the current weights (identical on every replica at the start)."""
        for fragment in self.fragments:
            fragment.outer.copy_(fragment.local_flat(self.device))
            fragment.momentum.zero_()

    # --- the step ---------------------------------------------------------------------------------

    def after_step(self) -> None:
        """One inner optimizer step was taken: apply the averages due now, then send the fragments due now."""
        self.steps += 1
        self.stats.bytes_raw += ring_all_reduce_bytes(self.trained_numel, self.replicas)
        for fragment in self.fragments:
            if fragment.apply_at == self.steps:
                self._apply(fragment)
        for fragment in self.fragments:
            if self.steps % self.sync_every == fragment.offset:
                self._send(fragment)
                if self.settings.outer.delay == 0:
                    self._apply(fragment)

    def _send(self, fragment: _Fragment, in_line: bool = False) -> None:
        delta = fragment.outer - fragment.local_flat(self.device)
        fragment.apply_at = self.steps + (0 if in_line else self.settings.outer.delay)
        self.syncs += 1
        if in_line or self.settings.outer.delay == 0:
            self._exchange(fragment, delta)
            return
        if self._thread is None:  # one thread: the exchanges run in the order sent, the same on every rank
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outer-sync")
        fragment.exchange = self._thread.submit(self._exchange, fragment, delta)

    @staticmethod
    def _exchange(fragment: _Fragment, delta: torch.Tensor) -> None:
        """Average ``delta`` over the replicas (in place, every replica the same bits); on the thread, if any."""
        begin = time.perf_counter()
        fragment.reducer(delta)
        fragment.pending = delta
        fragment.exchange_s += time.perf_counter() - begin

    def _wait(self, fragment: _Fragment) -> None:
        """Until the fragment's exchange has ended; then its counters join ``stats``."""
        if fragment.exchange is not None:
            begin = time.perf_counter()
            exchange, fragment.exchange = fragment.exchange, None
            try:
                exchange.result()
            except Exception as error:
                raise RuntimeError(f"the outer synchronisation of fragment {fragment.index} failed: {error}") from error
            finally:
                self.wait_s += time.perf_counter() - begin
        taken = fragment.stats.take()
        self.stats.add_exchange(taken)
        self._payloads[0] += int(taken["bytes_sent"])
        self._payloads[1] += int(taken["values_sent"])

    def _apply(self, fragment: _Fragment) -> None:
        """Nesterov SGD on theta_outer with the averaged pseudo-gradient, then the fragment's local weights."""
        self._wait(fragment)
        delta, fragment.pending, fragment.apply_at = fragment.pending, None, None
        assert delta is not None
        config = self.settings.outer
        if config.momentum:
            fragment.momentum.mul_(config.momentum).add_(delta)
            update = delta.add(fragment.momentum, alpha=config.momentum) if config.nesterov else fragment.momentum
        else:
            update = delta
        fragment.outer.add_(update, alpha=-config.lr)
        if config.mix:
            fragment.write_local(fragment.local_flat(self.device).mul_(config.mix).add_(fragment.outer, alpha=1 - config.mix))
        else:
            fragment.write_local(fragment.outer)

    def end_on_synchronisation(self) -> None:
        """End the run on a synchronisation: apply every average in flight, exchange (in line) each fragment that
        trained since it was last sent, and make every replica's weights theta_outer. Once per step; a checkpoint
        taken after it keeps the state from before it (the module docstring)."""
        if self.steps == 0 or self._final_at == self.steps:
            return
        self._before_final = {key: value.clone() for key, value in self.state_dict().items()}  # codec state: not copies
        self._before_final.update({f"fragment{f.index}/local": f.local_flat(torch.device("cpu")) for f in self.fragments})
        for fragment in self.fragments:
            if fragment.apply_at is not None:
                self._apply(fragment)
        for fragment in self.fragments:
            if (self.steps - fragment.offset) % self.sync_every:  # trained since it was last sent
                self._send(fragment, in_line=True)
                self._apply(fragment)
            fragment.write_local(fragment.outer)  # mix: the local part goes too
        self._final_at = self.steps

    def replica_weights(self) -> dict[int, torch.Tensor]:
        """Each trained parameter's local shard (by ``id``) where the weights hold something else now: from before the
        run's final synchronisation, or kept aside while validation scores theta_outer (a checkpoint saved then keeps
        the replica's own); empty otherwise."""
        if self._final_at == self.steps:
            flats = [self._before_final[f"fragment{f.index}/local"] for f in self.fragments]
        elif self._held is not None:
            flats = self._held
        else:
            return {}
        held = {}
        for fragment, flat in zip(self.fragments, flats):
            start = 0
            for param in fragment.params:
                numel = local_shard(param).numel()
                held[id(param)] = flat[start : start + numel].view_as(local_shard(param))
                start += numel
        return held

    def swap_in_outer(self) -> None:
        """Put theta_outer into the weights (for validation), keeping each fragment's local weights aside."""
        if self._held is None:
            self._held = [f.local_flat(self.device) for f in self.fragments]
            for fragment in self.fragments:  # theta_outer changes on this thread only (an exchange sends a copy)
                fragment.write_local(fragment.outer)

    def swap_out_outer(self) -> None:
        """Put back the local weights ``swap_in_outer`` kept aside."""
        if self._held is not None:
            for fragment, local in zip(self.fragments, self._held):
                fragment.write_local(local)
            self._held = None

    def finish(self) -> None:
        """Wait for every exchange in flight (the end of training, or before a checkpoint)."""
        for fragment in self.fragments:
            self._wait(fragment)

    def close(self) -> None:
        """Wait for the exchanges in flight and end the exchange thread."""
        self.finish()
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None

    # --- figures ------------------------------------------------------------------------------------

    def figures(self) -> SemiSyncFigures:
        """Synchronisations, the exchanges' time and the share of it the inner steps hid (1 - waited / exchanged)."""
        exchanged = sum(f.exchange_s for f in self.fragments)
        delay = self.settings.outer.delay
        hidden = None
        if exchanged and delay:
            hidden = max(0.0, 1.0 - self.wait_s / exchanged)
        # bytes per value a gathered payload carries (positions, codes, scales: SparseLoCo's 1.8125), as measured
        gathered = self.compressor is not None and not getattr(self.compressor, "linear", False)
        sent_values = self._payloads[1] * (self.replicas - 1)
        per_value = self._payloads[0] / sent_values if gathered and sent_values else None
        return SemiSyncFigures(outer_syncs=self.syncs, outer_sync_s=exchanged, outer_wait_s=self.wait_s,
                               outer_bytes_per_value=per_value, outer_hidden_share=hidden if delay else 0.0,
                               sync_every=self.sync_every, outer=self.settings.outer.as_dict())

    # --- checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's outer state: steps, theta_outer, momentum, every average in flight (waited for) with the
        step it is due, the codec's residuals and seeds."""
        self.finish()
        if self._final_at == self.steps:  # the run ended on a synchronisation: what continues is from before it
            return {k: v for k, v in self._before_final.items() if not k.endswith("/local")}
        state: dict[str, torch.Tensor] = {"steps": torch.tensor(self.steps), "syncs": torch.tensor(self.syncs)}
        for fragment in self.fragments:
            name = f"fragment{fragment.index}"
            state[f"{name}/outer"] = fragment.outer.cpu().clone()
            state[f"{name}/momentum"] = fragment.momentum.cpu().clone()
            state[f"{name}/calls"] = torch.tensor(fragment.exchanges)
            if fragment.pending is not None:
                state[f"{name}/pending"] = fragment.pending.cpu().clone()
                state[f"{name}/apply_at"] = torch.tensor(fragment.apply_at)
        codec_state = getattr(self.compressor, "state_dict", None)
        if codec_state is not None:
            state.update({f"codec/{key}": value.cpu() for key, value in codec_state().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.finish()
        self._final_at, self._before_final = None, {}
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        for fragment in self.fragments:
            name = f"fragment{fragment.index}"
            if state[f"{name}/outer"].numel() != fragment.numel:
                raise ValueError(f"the checkpoint's outer state of fragment {fragment.index} holds "
                                 f"{state[f'{name}/outer'].numel()} values, this run's {fragment.numel}: resume with "
                                 "the same model, sharding and outer.fragments")
            fragment.outer.copy_(state[f"{name}/outer"])
            fragment.momentum.copy_(state[f"{name}/momentum"])
            fragment.exchanges = int(state[f"{name}/calls"])
            pending = state.get(f"{name}/pending")
            fragment.pending = None if pending is None else pending.to(self.device)
            fragment.apply_at = None if pending is None else int(state[f"{name}/apply_at"])
        codec = {k.removeprefix("codec/"): v.to(self.device) for k, v in state.items() if k.startswith("codec/")}
        if codec and hasattr(self.compressor, "load_state_dict"):
            self.compressor.load_state_dict(codec)


class _Uncompressed:
    """The ``none`` codec for ``CompressedAllReduce``: its uncompressed path (a plain all-reduce, then / replicas)."""

    compressing = False

