"""What the tuner searches: a ``Candidate`` (one setting of the strategy knobs and the micro-batch), the user-restrictable
``SearchSpace`` of values per knob, and the ``RunShape`` the configs fix (processes, sequence, global batch).

A candidate maps onto a config overlay: ``trainer.strategy`` (``FSDP2Strategy`` or ``SlideFSDPStrategy``
with the candidate's knobs), ``data.init_args.batch_size`` (the micro-batch) and
``trainer.accumulate_grad_batches`` (so that micro-batch x accumulation stays the configs' batch per process).
SlideFSDP's ``update`` is searched among the exact schedules (``auto``, the one that fits, and the named ones); the
delayed update (a step's CPU update run during the next step: stale by one update) only where the space names it, and
with ``accumulate_on: host`` it needs the whole batch per process in one micro-batch: ``outside`` refuses it with
accumulation there.
"""

from __future__ import annotations

import json
import types
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from compress.config import METHODS, CompressionConfig
from lit_fsdp.diloco import OuterConfig
from lit_fsdp.lifecycle import DType
from lit_fsdp.strategy import Sharding
from offload.schedule import EXACT_UPDATES
from offload.strategy import SlideFSDPStrategy

_SLIDE_TYPES = get_type_hints(SlideFSDPStrategy.__init__)
ParamTransfer = _SLIDE_TYPES["param_transfer"]
GradSync = _SLIDE_TYPES["grad_sync"]
ActivationOffload = _SLIDE_TYPES["activation_offload"]
Update = _SLIDE_TYPES["update"]
StrategyName = Literal["fsdp2", "slide_fsdp"]

STRATEGY_CLASSES = {"fsdp2": "lit_fsdp.strategy.FSDP2Strategy", "slide_fsdp": "offload.SlideFSDPStrategy"}
COMMON_KNOBS = ("micro_batch", "param_dtype", "activation_checkpointing")
STRATEGY_KNOBS = {
    "fsdp2": ("sharding", "replicate_size", "blocks_per_group", "prefetch", "compile_blocks", "cpu_offload", "compression"),
    "slide_fsdp": ("window", "param_transfer", "grad_sync", "activation_offload", "update", "activation_plan",
                   "compile_blocks"),
}


@dataclass(frozen=True)
class RunShape:
    """What the configs fix and the search keeps: processes, nodes, device type, sequence length, batch per process."""

    world_size: int
    nodes: int
    accelerator: str  # cpu or cuda
    seq_len: int
    batch_per_process: int  # micro-batch x gradient accumulation
    clipping: bool
    loss_chunk_tokens: int = 0  # the model's chunked loss (lit_fsdp.loss); 0: the plain loss
    optimizer_state_dtype: str = "float32"  # SlideFSDP's AdamW moments on the host (the configs' SlideFSDP knob)
    master_dtype: str = "float32"  # SlideFSDP's master weights on the host (the configs' SlideFSDP knob)
    reduce_dtype: str = "auto"  # the configs' reduce_dtype: SlideFSDP's gradients reach the host in it (auto: compute dtype)
    outer: OuterConfig | None = None  # semi-synchronous training's outer step (the configs' sync_every > 0)
    on_nonfinite: str = "stop"  # the configs' guard: skip_step keeps SlideFSDP's gradients until the step's norm is known
    accumulate_on: str = "device"  # the configs' SlideFSDP knob: where micro-batches' gradients are summed

    @property
    def processes_per_node(self) -> int:
        return self.world_size // self.nodes


@dataclass(frozen=True)
class Candidate:
    """One setting of the searched knobs; the model, data and everything else come from the configs."""

    strategy: StrategyName = "fsdp2"
    micro_batch: int = 1
    param_dtype: DType = "auto"
    activation_checkpointing: int = 0
    sharding: Sharding = "FULL_SHARD"
    replicate_size: int | None = None
    blocks_per_group: int = 1
    prefetch: int = 0
    compile_blocks: bool = False
    cpu_offload: bool = False
    compression: str = "none"
    window: int = 2
    param_transfer: ParamTransfer = "full"
    grad_sync: GradSync = "gpu_reduce"
    activation_offload: ActivationOffload = "none"
    update: Update = "auto"
    activation_plan: Literal["auto"] | None = None  # SlideFSDP's plan chosen on the machine; None: activation_checkpointing

    def knobs(self) -> dict[str, Any]:
        """The knobs that apply to its strategy (``strategy`` first): what makes two candidates the same."""
        names = COMMON_KNOBS + STRATEGY_KNOBS[self.strategy]
        return {"strategy": self.strategy, **{name: getattr(self, name) for name in names}}

    def key(self) -> str:
        return json.dumps(self.knobs(), sort_keys=True)

    def changes(self, reference: Candidate) -> str:
        """The knobs that differ from ``reference``, as ``name=value`` pairs ("same" when none do)."""
        mine, theirs = self.knobs(), reference.knobs()
        diff = [f"{name}={value}" for name, value in mine.items() if theirs.get(name, object()) != value]
        return " ".join(diff) or "same"

    def with_knobs(self, knobs: dict[str, Any]) -> Candidate:
        """This candidate with ``knobs`` changed; an unknown knob name or a value of the wrong type (``2.0`` for an
        integer, ``"true"`` for a flag, a strategy that does not exist) raises ValueError naming what is accepted."""
        names = [f.name for f in fields(Candidate)]
        unknown = sorted(set(knobs) - set(names))
        if unknown:
            raise ValueError(f"unknown knob {unknown[0]!r}; knobs: {', '.join(names)}")
        for name, value in knobs.items():
            # A string outside a knob's options is left to the space's check (``outside``), which names the values
            # allowed in this search, except a strategy's name: it decides which knobs the candidate has.
            if not _accepts(_KNOB_TYPES[name], value, options=name == "strategy"):
                raise ValueError(f"{name}={value!r} is not accepted: {name} takes {_accepted(_KNOB_TYPES[name])}")
        changed = replace(self, **knobs)
        if changed.sharding != "HYBRID_SHARD":  # replicate_size means nothing without replicas
            changed = replace(changed, replicate_size=None)
        return changed

    def strategy_init_args(self, base_compression: dict[str, Any] | None = None) -> dict[str, Any]:
        """The strategy's init args this candidate sets (compression as a whole config: no stale parameter survives)."""
        args = {name: getattr(self, name) for name in ("param_dtype", "activation_checkpointing", *STRATEGY_KNOBS[self.strategy])}
        if self.strategy == "fsdp2":
            same = base_compression is not None and base_compression.get("method") == self.compression
            if same:
                args["compression"] = dict(base_compression)
            else:  # every field, so that no parameter of the configs' method is left over for another
                args["compression"] = None if self.compression == "none" else asdict(CompressionConfig(method=self.compression))
        return args

    def compression_config(self, base_compression: dict[str, Any] | None = None) -> CompressionConfig | None:
        """The compression this candidate trains with (``strategy_init_args``'s); None without gradient compression."""
        if self.strategy != "fsdp2" or self.compression == "none":
            return None
        return CompressionConfig(**self.strategy_init_args(base_compression)["compression"])

    def overlay(self, run: RunShape, base_compression: dict[str, Any] | None = None) -> dict[str, Any]:
        """The config that applies this candidate on top of the user's (what ``best.yaml`` holds)."""
        return {
            "trainer": {
                "accumulate_grad_batches": run.batch_per_process // self.micro_batch,
                "strategy": {"class_path": STRATEGY_CLASSES[self.strategy],
                             "init_args": self.strategy_init_args(base_compression)},
            },
            "data": {"init_args": {"batch_size": self.micro_batch}},
        }


def _all(alias: Any) -> list:
    return list(alias.__args__)


_KNOB_TYPES = get_type_hints(Candidate)


def _accepts(hint: Any, value: Any, options: bool = False) -> bool:
    """Whether ``value`` has the type ``hint`` exactly: True is not an integer, 2.0 is not 2 (JSON answers carry both).
    A Literal's value needs the options' type, and to be one of them with ``options``."""
    if get_origin(hint) is Literal:
        return any(type(value) is type(option) and (value == option or not options) for option in get_args(hint))
    if get_origin(hint) in (Union, types.UnionType):
        return any(_accepts(option, value, options) for option in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is int:
        return type(value) is int
    return isinstance(value, hint)


def _accepted(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(option) for option in get_args(hint))
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_accepted(option) for option in get_args(hint))
    return {int: "an integer", bool: "true or false", str: "a string", type(None): "null"}.get(hint, hint.__name__)


@dataclass
class SearchSpace:
    """The values each knob may take; restrict any of them, e.g. ``--tune.space.sharding [FULL_SHARD,NO_SHARD]``."""

    strategy: list[StrategyName] = field(default_factory=lambda: ["fsdp2", "slide_fsdp"])
    """fsdp2 (FSDP2Strategy) and slide_fsdp (SlideFSDP offload: proposed when nothing else fits)"""
    micro_batch: list[int] | None = None
    """sequences per process per micro-batch; gradient accumulation keeps the configs' batch (default: its divisors)"""
    param_dtype: list[DType] = field(default_factory=lambda: _all(DType))
    """compute dtypes (auto: bfloat16 on GPUs, float32 on CPU)"""
    activation_checkpointing: list[int] = field(default_factory=lambda: [0, 1, 2])
    """0 off, 1 every block, k every k-th block"""
    sharding: list[Sharding] = field(default_factory=lambda: _all(Sharding))
    """FSDP2 sharding modes"""
    replicate_size: list[int] | None = None
    """HYBRID_SHARD replica groups (default: the divisors of the world size between 1 and it)"""
    blocks_per_group: list[int] = field(default_factory=lambda: [1, 2, 4])
    """blocks per FSDP2 unit"""
    prefetch: list[int] = field(default_factory=lambda: [0, 1, 2])
    """FSDP2 units all-gathered ahead"""
    compile_blocks: list[bool] = field(default_factory=lambda: [False, True])
    """torch.compile each block (proposed on GPUs only: on CPU the compile outlasts a short trial)"""
    cpu_offload: list[bool] = field(default_factory=lambda: [False, True])
    """FSDP2 with torch's CPUOffloadPolicy"""
    compression: list[str] = field(default_factory=lambda: ["none"])
    """gradient compression methods (opt in, e.g. [none,int8]; a trial whose losses leave the default's is flagged)"""
    window: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    """SlideFSDP blocks on the device at once"""
    param_transfer: list[ParamTransfer] = field(default_factory=lambda: _all(ParamTransfer))
    """SlideFSDP parameter transfer"""
    grad_sync: list[GradSync] = field(default_factory=lambda: _all(GradSync))
    """SlideFSDP gradient reduction"""
    activation_offload: list[ActivationOffload] = field(default_factory=lambda: _all(ActivationOffload))
    """SlideFSDP activation offload"""
    update: list[Update] = field(default_factory=lambda: ["auto", *EXACT_UPDATES])
    """SlideFSDP's update schedules (exact; add delayed, a step's update run during the next, to search the stale one)"""
    activation_plan: list[Literal["auto"] | None] = field(default_factory=lambda: [None, "auto"])
    """SlideFSDP's activation plan: null (activation_checkpointing decides) or auto (keep, host or recompute per block)"""

    def resolve(self, run: RunShape) -> dict[str, list]:
        """The allowed values of every knob for ``run``; a value that cannot work raises ValueError before any trial."""
        values: dict[str, list] = {f.name: getattr(self, f.name) for f in fields(self)}
        batch, world = run.batch_per_process, run.world_size
        values["micro_batch"] = values["micro_batch"] or [m for m in range(1, batch + 1) if batch % m == 0]
        values["replicate_size"] = values["replicate_size"] or [r for r in range(2, world) if world % r == 0]
        for name, low in (("micro_batch", 1), ("activation_checkpointing", 0), ("blocks_per_group", 1), ("prefetch", 0),
                          ("window", 1), ("replicate_size", 1)):
            bad = [v for v in values[name] if v < low]
            if bad:
                raise ValueError(f"--tune.space.{name} value {bad[0]} must be >= {low}")
        for m in values["micro_batch"]:
            if batch % m:
                raise ValueError(f"--tune.space.micro_batch {m} does not divide the batch per process {batch} "
                                 "(--data.batch_size x --trainer.accumulate_grad_batches)")
        for r in values["replicate_size"]:
            if world % r:
                raise ValueError(f"--tune.space.replicate_size {r} does not divide the world size {world}: "
                                 f"no ({r}, {world}/{r}) device mesh; use divisors of {world}")
        for method in values["compression"]:
            if method not in METHODS:
                raise ValueError(f"--tune.space.compression {method!r} is not a method; choose from {', '.join(METHODS)}")
        if any(not values[name] for name in ("strategy", "sharding", "param_dtype")):
            raise ValueError("--tune.space.strategy, sharding and param_dtype need at least one value each")
        if batch not in values["micro_batch"] and run.accumulate_on == "host":  # all accumulate: no delayed update
            if values["update"] and all(value == "delayed" for value in values["update"]):
                raise ValueError(f"--tune.space.update [delayed] needs the batch per process {batch} in one "
                                 f"micro-batch (no accumulation): add {batch} to --tune.space.micro_batch")
            values["update"] = [value for value in values["update"] if value != "delayed"]
        for name in ("update", "activation_plan"):
            if not values[name]:
                raise ValueError(f"--tune.space.{name} needs at least one value")
        return values


def outside(candidate: Candidate, allowed: dict[str, list], run: RunShape) -> str | None:
    """Why ``candidate`` cannot run here, or None: a value outside the space, a mesh or batch split that does not exist."""
    for name, value in candidate.knobs().items():
        if name == "replicate_size" and candidate.sharding != "HYBRID_SHARD":
            continue
        if value not in allowed[name]:
            return f"{name}={value!r} is outside the search space {allowed[name]}"
    if candidate.strategy == "fsdp2" and candidate.sharding == "HYBRID_SHARD" and candidate.replicate_size is None:
        return "HYBRID_SHARD needs a replicate_size"
    if candidate.strategy == "slide_fsdp" and candidate.param_transfer == "shard" and run.processes_per_node < 2:
        return "param_transfer=shard needs >= 2 processes per node"
    if (candidate.strategy == "slide_fsdp" and candidate.update == "delayed"
            and candidate.micro_batch < run.batch_per_process and run.accumulate_on == "host"):
        return (f"update=delayed cannot accumulate gradients on the host: micro_batch={candidate.micro_batch} is under "
                f"the batch per process {run.batch_per_process}; use micro_batch={run.batch_per_process}, "
                "update=auto or accumulate_on: device")
    return None
