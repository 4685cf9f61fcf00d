"""Models, tokenizers and data sets by their Hugging Face Hub names, resolved to folders of the local Hub cache.

``owner/name`` names a model or a tokenizer, ``owner/name:subfolder`` the Parquet shards of a data set's subfolder
(``wikimedia/wikipedia:20231101.en``); either may pin a revision (branch, tag or commit) after the name,
``owner/name@revision``. A name is looked up in the Hub cache as ``hf download`` leaves it ($HF_HUB_CACHE, else
$HF_HOME/hub, else ~/.cache/huggingface/hub); online (HF_HUB_OFFLINE unset) the files a run needs are downloaded into
it first. A path that exists is always a path: a local folder wins over a repository of the same name. Nothing here
runs a repository's code.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from lightning.pytorch.utilities import rank_zero_info

from lit_fsdp.errors import OneLineError

#: What a tokenizer needs of a repository (config.json: AutoTokenizer takes the model type from it when the
#: tokenizer's own config does not name its class).
TOKENIZER_FILES = ("config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "spiece.model", "chat_template.*")
#: What a model needs: its config, generation config, safetensors weights (as save_pretrained names them: other
#: formats and copies such as ``consolidated.safetensors`` or ``original/`` stay on the Hub) and its tokenizer.
MODEL_FILES = (*TOKENIZER_FILES, "generation_config.json", "model*.safetensors", "model.safetensors.index.json")

_PART = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9_])?"  # an owner or a repository name, as the Hub allows them
_REPO = rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[\w./-]+))?"
MODEL_NAME = re.compile(_REPO)
DATASET_NAME = re.compile(rf"{_REPO}:(?P<subfolder>[^:]+)")
#: The snapshots this process resolved, by name and cache, for the processes it starts (they inherit the
#: environment): every rank of a node reads the same commit, and does not ask the Hub again.
RESOLVED_ENV = "LIT_FSDP_HUB_SNAPSHOTS"
_TRUE = ("1", "ON", "YES", "TRUE")
#: The folder lit_fsdp's runs go in (every config's default_root_dir is under it): a name under it is a local path.
RUNS = "runs"


def hub_cache() -> Path:
    """The Hub cache folder, read from the environment now as huggingface_hub reads it (its own constants are read
    once, when it is imported)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) forbids asking the Hub, read from the environment now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def model_folder(spec: str, flag: str) -> str:
    """``spec`` itself when it is a path that exists or no Hub name; else the Hub cache's snapshot of that model (its
    config, safetensors and tokenizer, downloaded when online), checked to hold its config and every weight file."""
    match = MODEL_NAME.fullmatch(spec)
    if match is None or Path(spec).expanduser().exists():
        return spec
    _refuse_missing_folder(spec, flag)
    folder = _snapshot(spec, flag, match, "model", MODEL_FILES)
    missing = _missing_model_files(folder)
    if missing:
        names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        if hub_offline():
            raise OneLineError(f"{flag} {spec}: the Hub cache's snapshot {folder} lacks {names} (a download cut short, "
                               f"or only some files fetched) and HF_HUB_OFFLINE=1; download it where there is network with `{_command(match)}` and "
                               "copy the cache, or give a local folder")
        raise OneLineError(f"{flag} {spec}: the Hub repository has no {names}; lit_fsdp loads a transformers model "
                           "saved as safetensors (config.json, model.safetensors or its index): give another model")
    return str(folder)


def tokenizer_folder(spec: str, flag: str) -> str:
    """``spec`` itself when it is a path that exists or no Hub name; else the Hub cache's snapshot of that repository's
    tokenizer files (downloaded when online)."""
    match = MODEL_NAME.fullmatch(spec)
    if match is None or Path(spec).expanduser().exists():
        return spec
    _refuse_missing_folder(spec, flag)
    return str(_snapshot(spec, flag, match, "tokenizer", TOKENIZER_FILES))


def dataset_path(spec: str, flag: str) -> str:
    """``spec`` itself when it is a path that exists or no Hub data set name (``owner/name:subfolder``); else that
    subfolder (or glob) of the data set's snapshot in the Hub cache (downloaded when online), for ``open_corpus``."""
    match = DATASET_NAME.fullmatch(spec)
    if match is None or Path(spec).expanduser().exists():
        return spec
    subfolder = match["subfolder"].strip("/")
    patterns = (subfolder,) if glob.has_magic(subfolder) else (subfolder, f"{subfolder}/*")
    folder = _snapshot(spec, flag, match, "dataset", patterns)
    path = folder / subfolder
    if glob.glob(str(path)) if glob.has_magic(subfolder) else path.exists():
        return str(path)
    if hub_offline():
        raise OneLineError(f"{flag} {spec}: the Hub cache's snapshot {folder} has no {subfolder} and HF_HUB_OFFLINE=1; "
                           f"download it where there is network with `{_command(match)}` and copy the cache")
    raise OneLineError(f"{flag} {spec}: the data set {match['repo']} has no {subfolder}; name one of its subfolders "
                       f"(https://huggingface.co/datasets/{match['repo']}/tree/{match['revision'] or 'main'})")


def _refuse_missing_folder(spec: str, flag: str) -> None:
    """A one-line error for a name that is shaped like ``owner/name`` but is a local path the user meant, missing, not
    a Hub name to look up: its ``owner`` is a local folder, or it is under ``runs/``, where lit_fsdp writes its runs
    and the configs' base folders are made (``runs/sft_base`` on a fresh clone, before ``runs/`` exists)."""
    path = Path(spec).expanduser()
    if not path.parent.is_dir() and path.parts[0] != RUNS:
        return
    raise OneLineError(f"{flag} {spec}: no such folder {path.absolute()} (a relative path is read from the folder the "
                       "command runs in); check the path, or make it first: a model folder with its tokenizer is "
                       f"what `python -m lit_fsdp export RUN/checkpoints/last.ckpt {spec}` writes of a run, as the "
                       "header of the config naming it says (configs/sft_full.yaml's: train configs/wikipedia.yaml's "
                       "run, then export it)")


def _no_local_folder(spec: str) -> str:
    """The part of a Hub error that says ``spec`` was first looked for as a folder, and where."""
    return f"no folder {Path(spec).expanduser().absolute()} (a relative path is read from the current folder), and"


def _snapshot(spec: str, flag: str, match: re.Match[str], what: str, patterns: tuple[str, ...]) -> Path:
    """The snapshot folder in the Hub cache of the repository ``match`` names (a model, tokenizer or dataset:
    ``what``), its files matching ``patterns`` downloaded first when online; any failure a one-line error naming
    ``flag``, ``spec`` and what to do."""
    cache, offline = hub_cache(), hub_offline()
    resolved = json.loads(os.environ.get(RESOLVED_ENV) or "{}")
    key = f"{what} {spec} in {cache}"
    if key in resolved and Path(resolved[key]).is_dir():
        return Path(resolved[key])
    kind = "dataset" if what == "dataset" else "model"
    repo, revision = match["repo"], match["revision"]
    command = _command(match)
    named = f"{repo}@{revision}" if revision else repo
    try:
        folder = Path(snapshot_download(repo, repo_type=kind, revision=revision, cache_dir=cache,
                                        local_files_only=offline, allow_patterns=list(patterns)))
    except GatedRepoError:
        raise OneLineError(f"{flag} {spec}: {repo} is gated; accept its terms on https://huggingface.co/"
                           f"{'datasets/' if kind == 'dataset' else ''}{repo} and log in (`hf auth login`, or set "
                           "HF_TOKEN), or give a local folder") from None
    except RepositoryNotFoundError:
        raise OneLineError(f"{flag} {spec}: {_no_local_folder(spec)} no {kind} on the Hub by that name (or it is private: "
                           "log in with `hf auth login` or set HF_TOKEN); check the path or the name") from None
    except RevisionNotFoundError:
        raise OneLineError(f"{flag} {spec}: {repo} has no revision {revision}; give one of its branches, tags or "
                           "commits after @, or none for main") from None
    except LocalEntryNotFoundError as error:
        if offline:
            raise OneLineError(f"{flag} {spec}: {named} is no local path and is not (wholly) in the Hub cache {cache} "
                               f"(HF_HUB_OFFLINE=1); download it on a machine with network with `{command}` and copy "
                               "the cache (HF_HUB_CACHE or HF_HOME names it here), or give a local folder") from None
        raise OneLineError(f"{flag} {spec}: {_no_local_folder(spec)} the Hub, where {named} would name a {kind}, cannot "
                           f"be reached ({_first_line(error)}) and the cache {cache} does not hold it; give an existing "
                           f"folder, or connect, or download it elsewhere with `{command}` and copy the cache") from None
    except HfHubHTTPError as error:
        raise OneLineError(f"{flag} {spec}: the Hub refused {named} ({_first_line(error)}); try again later, or "
                           f"download it with `{command}`") from None
    except ValueError as error:  # huggingface_hub's validation of the repository id or revision
        raise OneLineError(f"{flag} {spec}: not a Hub name the Hub accepts ({_first_line(error)}); give "
                           "owner/name[@revision], or a local folder") from None
    resolved[key] = str(folder)
    os.environ[RESOLVED_ENV] = json.dumps(resolved)
    rank_zero_info(f"{flag} {spec}: reading {folder}")
    return folder


def _missing_model_files(folder: Path) -> list[str]:
    """The files a model folder needs that ``folder`` lacks: config.json, its weights and every file their index
    names (a broken link in the cache, to a blob never downloaded, counts as missing)."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            return [*missing, f"a readable {index.name}"]
        return missing + [name for name in files if not (folder / name).is_file()]
    if not (folder / "model.safetensors").is_file():
        missing.append("model.safetensors (or model.safetensors.index.json and its shards)")
    return missing


def _command(match: re.Match[str]) -> str:
    """The ``hf download`` command that puts what ``match`` (a ``MODEL_NAME`` or ``DATASET_NAME``) names into the Hub
    cache."""
    revision = f" --revision {match['revision']}" if match["revision"] else ""
    if "subfolder" not in match.groupdict():
        return f"hf download {match['repo']}{revision}"
    subfolder = match["subfolder"].strip("/")
    include = subfolder if glob.has_magic(subfolder) else f"{subfolder}/*"
    return f"hf download --repo-type dataset {match['repo']}{revision} --include '{include}'"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
