"""Weights & Biases, the default logger: offline unless the user has set W&B up, its files in the run folder.

Without the wandb package the default is ``CSVFallbackLogger`` instead (``default_logger``): metrics in a CSV
file in the run folder; a WandbLogger whose wandb fails to import is replaced by one (``without_broken_wandb``).
``SaveConfig`` puts the resolved config in the run folder and in every W&B run; ``publish_summary`` puts the run's
results record in every W&B run's summary.
"""

from __future__ import annotations

import configparser
import importlib.util
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import lightning.pytorch as pl
import yaml
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.utilities import rank_zero_info

from lit_fsdp.errors import OneLineError

# W&B's cloud, whose `wandb login` key is stored under either name (recent wandb's default base URL is the second).
_CLOUD_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")


def _wandb_settings() -> configparser.SectionProxy:
    """W&B's settings files, the folder's over the user's: ``~/.config/wandb/settings`` (``wandb login --host``)
    and ``./wandb/settings`` (``wandb offline``, ``wandb online``)."""
    settings = configparser.ConfigParser(interpolation=None)
    user = Path(os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb").expanduser() / "settings"
    folder = Path(os.environ.get("WANDB_DIR") or ".") / "wandb" / "settings"
    try:
        settings.read([user, folder])
    except configparser.Error:
        pass  # W&B itself warns about a malformed file; here it only means "no settings"
    if not settings.has_section("default"):
        settings.add_section("default")
    return settings["default"]


def _netrc_has_key(hosts: set[str]) -> bool:
    """Whether the netrc file W&B reads (``$NETRC`` or ``~/.netrc``) holds a password for one of ``hosts``."""
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError):  # missing or unreadable: W&B would not find a key there either
        return False
    return any((entry := entries.authenticators(host)) and entry[2] for host in hosts)


def offline_by_default() -> bool:
    """True unless the user has set W&B up, read from the environment and files only (no network).

    Set up means: ``WANDB_MODE`` in the environment or a ``mode`` in W&B's settings files (W&B's own rules
    then decide), ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE`` set, an ``api_key`` in the settings
    files, or a ``wandb login`` key in the netrc file for ``WANDB_BASE_URL``, the settings' ``base_url`` or W&B's cloud.
    """
    settings = _wandb_settings()
    if os.environ.get("WANDB_MODE") or settings.get("mode"):
        return False
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.get("api_key"):
        return False
    urls = (os.environ.get("WANDB_BASE_URL"), settings.get("base_url"))
    hosts = {urlsplit(url).hostname for url in urls if url} | set(_CLOUD_HOSTS)
    return not _netrc_has_key({host for host in hosts if host})


def wandb_installed() -> bool:
    """Whether the wandb package is there, found without importing it (that takes most of a second)."""
    return importlib.util.find_spec("wandb") is not None


def wandb_import_error() -> str | None:
    """None if the installed wandb package imports, else the first line of what its import raised (a protobuf
    release it was not built for is the usual cause). It imports wandb: call it only where W&B is about to be used."""
    try:
        import wandb  # noqa: F401
    except Exception as error:  # whatever a broken install raises: ImportError, TypeError from protobuf, ...
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return None


def default_logger() -> dict[str, str]:
    """``--trainer.logger``'s default: W&B, or ``CSVFallbackLogger`` when the wandb package is missing."""
    name = "WandbLogger" if wandb_installed() else "CSVFallbackLogger"
    return {"class_path": f"lit_fsdp.wandb_logger.{name}"}


class CSVFallbackLogger(CSVLogger):
    """The default logger without the wandb package: Lightning's CSVLogger, ``metrics.csv`` under the run folder."""

    def __init__(self) -> None:
        # No arguments: jsonargparse would hand a default logger's init_args to a --trainer.logger that takes them.
        super().__init__(save_dir=".")  # the run folder, from use_folder (the CLI calls it before training)
        #: why not W&B, and how to get it: said by use_folder
        self.reason = "the wandb package is not installed", "`pip install wandb` to log to W&B"

    def use_folder(self, folder: str) -> None:
        """Log under ``folder`` (the run folder), and say once, on rank 0, why not to W&B and how to get it."""
        self._save_dir = self._root_dir = os.path.abspath(folder)
        why, fix = self.reason
        rank_zero_info(f"lit_fsdp: {why}: metrics go to {self.log_dir}/metrics.csv instead of Weights & Biases ({fix})")


def without_broken_wandb(loggers: list[Logger]) -> list[Logger]:
    """``loggers`` with its WandbLoggers replaced by one CSVFallbackLogger when wandb is installed but fails to import.

    Every rank decides alike before any worker starts; otherwise rank 0 would fail at its first log and the others
    wait for it. Imports wandb only when there is a WandbLogger (rank 0 would import it anyway).
    """
    if not any(isinstance(logger, WandbLogger) for logger in loggers) or (error := wandb_import_error()) is None:
        return loggers
    fallback = CSVFallbackLogger()
    fallback.reason = (f"the wandb package is installed but fails to import ({error})",
                       "`pip install --force-reinstall wandb` to repair it, or `pip uninstall wandb`")
    first = next(index for index, logger in enumerate(loggers) if isinstance(logger, WandbLogger))
    kept = [fallback if index == first else logger for index, logger in enumerate(loggers)]
    return [logger for logger in kept if not isinstance(logger, WandbLogger)]  # the first logger names trainer.log_dir


class WandbLogger(LightningWandbLogger):
    """Weights & Biases: offline unless W&B is set up (``wandb sync`` uploads later); files in the run folder."""

    def __init__(
        self,
        run_name: str | None = None,
        project: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        notes: str | None = None,
        dir: str | None = None,
        offline: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            run_name: W&B run name; default: the run's name in results.jsonl (method, world size, seed, time).
            project: W&B project; default: ``$WANDB_PROJECT`` or ``lit_fsdp``.
            group: W&B group, e.g. one per sweep or comparison.
            tags: W&B tags; default: the compression method.
            notes: A longer description of the run.
            dir: Folder that gets W&B's ``wandb/`` folder; default: the run folder (``trainer.default_root_dir``).
            offline: Log to local files only (upload later with ``wandb sync``); default: offline unless
                ``mode``, ``WANDB_MODE``, ``WANDB_API_KEY`` or a ``wandb login`` key is set.
        """
        if not wandb_installed():
            raise OneLineError(
                "--trainer.logger lit_fsdp.wandb_logger.WandbLogger needs the wandb package, which is not installed: "
                "`pip install wandb`, or drop the WandbLogger from trainer.logger (without wandb the default logs "
                "to CSV in the run folder)"
            )
        # Not `name`/`save_dir` (Lightning's spelling): jsonargparse keeps the default logger's init_args that
        # a class chosen by --trainer.logger also takes, and CSVLogger/TensorBoardLogger would get name=None
        # (no lightning_logs/ folder) and save_dir=None (by design, omni-us/jsonargparse#460).
        if offline is None:  # wandb.init's own `mode`, when given, decides like WANDB_MODE
            offline = kwargs.get("mode") is None and offline_by_default()
        if offline and kwargs.get("log_model"):
            raise ValueError(
                f"--trainer.logger.init_args.log_model {kwargs['log_model']} uploads checkpoints but W&B is offline: "
                "run `wandb login` or set WANDB_API_KEY, or set --trainer.logger.init_args.offline false"
            )
        # The CLI passes every wandb.init argument, None when unset: resume=None would undo Lightning's "allow".
        kwargs = {key: value for key, value in kwargs.items() if value is not None}
        super().__init__(
            name=run_name, project=project or os.environ.get("WANDB_PROJECT", "lit_fsdp"), group=group, tags=tags,
            notes=notes, save_dir=None, dir=dir, offline=offline, **kwargs,
        )
        if self._wandb_init.get("anonymous") is None:
            # Lightning always passes it; wandb warns on any value since anonymous mode went (wandb/wandb#10909).
            del self._wandb_init["anonymous"]

    def finalize(self, status: str) -> None:
        """After a failed fit (Lightning's ``finalize("failed")``), one line saying where its offline W&B run is: the
        metrics up to the failure, left for the user to look at, upload or delete (an online run is on W&B's server,
        marked as failed there). Rank 0 only: the others start no W&B run."""
        super().finalize(status)
        if status == "success" or self._experiment is None or not getattr(self._experiment, "dir", None):
            return
        folder = Path(self._experiment.dir).parent  # wandb/offline-run-<time>-<id>, whose files/ is run.dir
        if folder.name.startswith("offline-run-"):
            rank_zero_info(f"lit_fsdp: the failed run's offline W&B run is in {folder}: `wandb sync {folder}` uploads "
                           f"it, `rm -r {folder}` drops it")

    def use_run(self, folder: str, name: str, tags: list[str]) -> None:
        """Fill what the config left unset: W&B's files in the run ``folder``, the run's ``name``, its ``tags``.

        The CLI calls it on every rank before workers start (the logger is built before the trainer knows
        its folder) and before the W&B run exists; only rank 0 ever starts one (``rank_zero_experiment``).
        """
        if self._save_dir is None:
            self._save_dir = self._wandb_init["dir"] = os.path.abspath(folder)
            os.makedirs(self._save_dir, exist_ok=True)  # W&B falls back to a temp folder if it is missing
        if not self._wandb_init.get("name"):
            self._name = self._wandb_init["name"] = name
        if self._wandb_init.get("tags") is None:
            self._wandb_init["tags"] = tags


class SaveConfig(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` in ``trainer.log_dir``, a copy in the run folder, and the config in each W&B run."""

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Rank 0 only. With a CSV or TensorBoard logger log_dir is a version folder, so the run folder gets its
        # own copy; it is always overwritten (the last run's config, as checkpoints/last.ckpt is the last state).
        path = os.path.join(trainer.default_root_dir, self.config_filename)
        os.makedirs(trainer.default_root_dir, exist_ok=True)
        self.parser.save(self.config, path, skip_none=False, overwrite=True, multifile=self.multifile)
        wandb_loggers = [logger for logger in trainer.loggers if isinstance(logger, LightningWandbLogger)]
        if wandb_loggers:
            config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
            for logger in wandb_loggers:
                logger.experiment.config.update(config, allow_val_change=True)


def publish_summary(trainer: pl.Trainer, record: dict[str, Any]) -> None:
    """Rank 0 puts ``record`` (the run's results.jsonl line) in the summary of each W&B run of the trainer."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            if isinstance(logger, LightningWandbLogger):
                logger.experiment.summary.update(record)
