"""Semi-synchronous training (DiLoCo) as ``FSDP2Strategy`` composes it: ``SemiSync``.

The strategy builds one from its ``sync_every`` and ``outer`` arguments (``SemiSync.build``; none for ``sync_every``
0, which synchronises every step) and calls each of its hooks from one place of its own life cycle:

- before launch, ``check_mesh`` (a replicate dimension of 2 or more replica groups) and ``check_units`` (no more
  fragments than FSDP units);
- ``setup``, once the network is sharded: the replicate group the exchange runs on, and theta_outer from the weights
  (``lit_fsdp.diloco.OuterSync``, which holds the mechanics: fragments, the exchange, the outer step);
- ``after_optimizer_step``: the synchronisations due, and at fit's last step the final one, before the last
  validation and checkpoint;
- ``before_validation``, ``score_replica`` and ``after_validation``: inside fit, validation scores theta_outer (the
  same model on every replica, so the ranks' shares make one set), and each replica's own weights as
  ``val/loss_replica``;
- ``state_dict`` and ``load_state_dict``: each rank's outer state and its replica's weights and optimizer state,
  which differ between synchronisations, in the checkpoint;
- ``on_train_end`` (a run that ended otherwise than at ``max_steps`` ends on a synchronisation too) and ``teardown``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh

from lit_fsdp.diloco import OuterConfig, OuterSync, SemiSyncConfig, local_shard
from lit_fsdp.lightning_compat import logged_step
from lit_fsdp.loss import target_count
from lit_fsdp.reporting import SemiSyncFigures


class SemiSync:
    """Semi-synchronous training's life cycle inside a strategy (see the module docstring); ``config`` holds H and
    the outer step, ``outer_sync`` the outer state once ``setup`` built it."""

    def __init__(self, config: SemiSyncConfig):
        self.config = config
        self.outer_sync: OuterSync | None = None
        self._units: list[torch.nn.Module] = []
        self._device = torch.device("cpu")
        self._replica_loss: torch.Tensor | None = None

    @classmethod
    def build(cls, sync_every: int, outer: OuterConfig | dict | None, per_step_hook: bool,
              sharded_checkpoints: bool) -> SemiSync | None:
        """The component for a strategy's ``sync_every`` and ``outer`` (DiLoCo's outer step when unset), None for
        ``sync_every`` 0; what cannot run beside the strategy's other settings is refused in one line."""
        if sync_every == 0 and type(sync_every) is int:
            if outer is not None:
                raise ValueError("outer sets the outer step of semi-synchronous training; set sync_every too (e.g. 32)")
            return None
        config = SemiSyncConfig(sync_every, outer or OuterConfig())
        if per_step_hook:
            raise ValueError(f"sync_every={sync_every} exchanges pseudo-gradients between replicas every {sync_every} "
                             "steps, which a per-step compression hook cannot take part in; drop compression/comm_hook "
                             "and give the codec as outer.codec (e.g. {method: int8, num_bits: 4})")
        if not sharded_checkpoints:
            raise ValueError(f"sync_every={sync_every}: each replica's weights differ between synchronisations and "
                             "every rank checkpoints its own; keep save_distributed_checkpoint true")
        return cls(config)

    def compression_method(self) -> str:
        """``diloco<H>_<codec>``, ``_streaming`` after it with fragments."""
        outer = self.config.outer
        return f"{self.config.name}_{outer.codec.method}" + ("_streaming" if outer.fragments > 1 else "")

    # --- before launch ---------------------------------------------------------------------------------

    def check_mesh(self, shape: tuple[int, ...], sharding: str, processes: int) -> None:
        """Refuse a mesh without 2 or more replica groups to synchronise."""
        if len(shape) == 1 or shape[0] == 1:
            every = self.config.sync_every
            raise ValueError(
                f"sync_every={every} synchronises replica groups, but {sharding} on {processes} process(es) has "
                f"{'no replicate dimension' if len(shape) == 1 else 'one replica'}; use sharding HYBRID_SHARD with "
                "replicate_size >= 2 (or NO_SHARD on 2+ processes), or sync_every 0")

    def check_units(self, units: int) -> None:
        """Refuse more fragments than the model's ``units`` FSDP units."""
        self.config.outer.check_units(units)

    # --- the life cycle ---------------------------------------------------------------------------------

    def setup(self, mesh: DeviceMesh, units: list[torch.nn.Module], device: torch.device) -> None:
        """Once the network is sharded into ``units`` (blocks first, the root last): the replicate group and the
        outer state, theta_outer from the weights."""
        group = replicate_group(mesh, on_host=self.config.outer.state_device == "cpu")
        self._units, self._device = units, device
        self.outer_sync = OuterSync(self.config, outer_fragments(units, self.config.outer), group, device)

    def after_optimizer_step(self, trainer: pl.Trainer) -> None:
        """The synchronisations due after this step; at fit's last step the run ends on one."""
        assert self.outer_sync is not None
        self.outer_sync.after_step()
        # the trainer's global_step counts this step once the strategy's optimizer_step returns
        if trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps:
            self.outer_sync.end_on_synchronisation()  # before the last validation and checkpoint

    def on_train_end(self) -> None:
        """A run ended by max_epochs or a callback ends on a synchronisation too."""
        if self.outer_sync is not None:
            self.outer_sync.end_on_synchronisation()

    def teardown(self) -> None:
        """Wait for the exchanges in flight and end the exchange thread."""
        if self.outer_sync is not None:
            self.outer_sync.close()

    def figures(self) -> SemiSyncFigures | None:
        return None if self.outer_sync is None else self.outer_sync.figures()

    # --- validation ---------------------------------------------------------------------------------

    def before_validation(self, trainer: pl.Trainer) -> None:
        """Inside fit (a sanity check included), theta_outer goes into the weights: the replicas' last average."""
        if self._scores_outer(trainer):
            self._replica_loss = torch.zeros(2, dtype=torch.float64, device=self._device)
            self._swap(self.outer_sync.swap_in_outer)

    def score_replica(self, trainer: pl.Trainer, module: pl.LightningModule, batch: dict[str, torch.Tensor]) -> None:
        """This replica's own weights on the batch too, for ``val/loss_replica``."""
        if self._scores_outer(trainer):
            self._swap(self.outer_sync.swap_out_outer)
            with torch.no_grad():
                targets = target_count(batch["labels"])
                self._replica_loss += torch.stack([module._loss(batch)[0].double() * targets, targets.double()])
            self._swap(self.outer_sync.swap_in_outer)

    def after_validation(self, trainer: pl.Trainer, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The replica's own weights back; its loss, summed over the ranks, logged as ``val/loss_replica``."""
        if self._scores_outer(trainer):
            self._swap(self.outer_sync.swap_out_outer)
            total = reduce_sum(self._replica_loss)
            loss = float(total[0] / total[1])
            for logger in trainer.loggers:  # at the step Lightning logs val/loss at
                logger.log_metrics({"val/loss_replica": loss, "val/ppl_replica": math.exp(loss)},
                                   step=logged_step(trainer))

    def _swap(self, write: Callable[[], None]) -> None:
        """Write other weights into the shards; a unit left unsharded (NO_SHARD's root keeps its weights gathered after
        a forward) would go on computing with the old ones, so every unit reshards and gathers them again."""
        write()
        for unit in self._units:
            unit.reshard()

    def _scores_outer(self, trainer: pl.Trainer | None) -> bool:
        return self.outer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING

    # --- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
        """This rank's outer state and its replica's weights and optimizer state (the replicas differ between
        synchronisations: each rank keeps its own)."""
        assert self.outer_sync is not None
        return {**self.outer_sync.state_dict(), **replica_state(model, optimizers, self.outer_sync.replica_weights())}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None, model: torch.nn.Module,
                        optimizers: list[torch.optim.Optimizer], path: Any) -> None:
        """Adopt what ``state_dict`` saved; None: the checkpoint at ``path`` holds none for this run (a fully
        synchronous run's, or another number of processes'), so every replica and theta_outer start from its weights."""
        assert self.outer_sync is not None
        if state is None:
            rank_zero_info(f"{path} holds no outer state for this run: every replica and theta_outer start from its "
                           f"weights, and the replicas synchronise every {self.config.sync_every} steps from here")
            self.outer_sync.reset_outer()
        else:
            self.outer_sync.load_state_dict(state)
            load_replica_state(model, optimizers, state)


def outer_fragments(units: list[torch.nn.Module], config: OuterConfig) -> list[list[torch.Tensor]]:
    """The trained parameters of each fragment: FSDP units (blocks first, the root last, as ``parallelize`` returns
    them) taken in turn, unit u into fragment u mod ``config.fragments``; each parameter in the innermost unit holding it."""
    config.check_units(len(units))
    fragments = config.fragments
    seen: set[int] = set()
    out: list[list[torch.Tensor]] = [[] for _ in range(fragments)]
    for index, unit in enumerate(units):
        for param in unit.parameters():
            if id(param) not in seen and param.requires_grad:
                seen.add(id(param))
                out[index % fragments].append(param)
    return out


def replica_state(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                  held: dict[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """This rank's shards of its replica's trained weights and optimizer state, which differ from the other
    replicas' between synchronisations (a sharded checkpoint keeps one replica's): copies on the CPU. ``held``
    (``OuterSync.replica_weights``): weights by parameter ``id`` to keep instead of the current ones."""
    held = held or {}
    state = {f"weights/{i}": held.get(id(p), local_shard(p)).detach().cpu().clone() for i, p in enumerate(_trained(model))}
    for o, optimizer in enumerate(optimizers):
        for i, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    state[f"optimizer{o}/{i}/{key}"] = local_shard(value).detach().cpu().clone()
    return state


def load_replica_state(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                       state: dict[str, torch.Tensor]) -> None:
    """Put ``replica_state``'s copies back into this rank's weights and optimizer state."""
    with torch.no_grad():
        for i, param in enumerate(_trained(model)):
            local_shard(param).copy_(state[f"weights/{i}"])
        for o, optimizer in enumerate(optimizers):
            for i, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
                for key, value in optimizer.state.get(param, {}).items():
                    saved = state.get(f"optimizer{o}/{i}/{key}")
                    if isinstance(value, torch.Tensor) and saved is not None:
                        local_shard(value).copy_(saved)


def _trained(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def replicate_group(mesh: DeviceMesh, on_host: bool) -> dist.ProcessGroup:
    """The process group the outer exchange runs on: the mesh's replicate group, or (``on_host``) a gloo group of
    the same ranks of its own, which a thread may use while the training's collectives run (every rank builds
    every shard position's group, in the same order)."""
    if not on_host:
        return mesh["replicate"].get_group()
    ranks = mesh.mesh  # (replicate, shard) ranks
    mine = None
    for position in range(ranks.shape[1]):
        members = ranks[:, position].tolist()
        group = dist.new_group(members, backend="gloo")
        if dist.get_rank() in members:
            mine = group
    assert mine is not None
    return mine
