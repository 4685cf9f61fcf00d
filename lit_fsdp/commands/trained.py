"""A trained model and its tokenizer on one device, from a run folder, a checkpoint written by fit or a Hugging Face folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import yaml
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from lit_fsdp.data.chat import ChatRenderer, recorded_renderer
from lit_fsdp.data.tokenizer import load_tokenizer, tokenizer_from_files
from lit_fsdp.commands.export import model_from_checkpoint, read_metadata
from lit_fsdp.lightning_compat import METADATA_FILENAME as _METADATA_FILENAME

DType = Literal["float32", "bfloat16", "float16"]

#: Where fit's ModelCheckpoint keeps the last state of a run (``<default_root_dir>/checkpoints``, see ``cli.py``).
RUN_CHECKPOINT = Path("checkpoints") / "last.ckpt"
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class Trained:
    """What ``generate`` and ``evaluate`` read from a training run."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: Path  # the checkpoint or Hugging Face folder the weights came from
    run_folder: Path | None  # the run the checkpoint belongs to (it holds config.yaml), None for a Hugging Face folder
    seq_len: int | None  # the sequence length of training, when the checkpoint records it
    step: int | None  # the optimizer step of the checkpoint
    chat: ChatRenderer | None = None  # for a model fine-tuned on chat: how its training rendered a conversation

    @property
    def positions(self) -> int | None:
        """The longest sequence the model takes (``n_positions`` for GPT-2)."""
        return getattr(self.model.config, "max_position_embeddings", None)


def resolve_device(name: str) -> torch.device:
    """``auto`` is the GPU if there is one, else the CPU; any other name must be a device this machine has."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine has no CUDA device; use --device cpu")
    return device


def run_folder_of(checkpoint: Path) -> Path | None:
    """The run folder of a checkpoint fit saved in ``<run folder>/checkpoints/``, if it is one."""
    folder = checkpoint.absolute().parent
    if folder.name == RUN_CHECKPOINT.parent.name and (folder.parent / "config.yaml").is_file():
        return folder.parent
    return None


def load_trained(path: str, device: str = "auto", dtype: DType = "float32", tokenizer_path: str | None = None) -> Trained:
    """The model at ``path`` on ``device`` in ``dtype``, in eval mode, with the tokenizer it was trained with.

    ``path`` is a run folder (its ``checkpoints/last.ckpt`` is read), a checkpoint written by fit (a sharded
    folder is consolidated on load) or a Hugging Face folder. The tokenizer is ``tokenizer_path``, else the
    one the checkpoint records, else the one in the Hugging Face folder.
    """
    given = Path(path)
    if not given.exists():
        raise FileNotFoundError(f"{path} does not exist; give a run folder, a checkpoint written by fit or a Hugging Face folder")
    target = resolve_device(device)
    hugging_face = (given / "config.json").is_file()
    if hugging_face:
        source, run_folder, meta = given, None, {}
        recorded = str(given) if any((given / name).is_file() for name in _HF_TOKENIZER_FILES) else None
        missing = f"{given} holds no tokenizer files; export it with its tokenizer or pass --tokenizer_path"
    else:
        if (given / RUN_CHECKPOINT).exists():
            source, run_folder = given / RUN_CHECKPOINT, given
        elif given.is_file() or (given / _METADATA_FILENAME).is_file():
            source, run_folder = given, run_folder_of(given)
        else:
            raise ValueError(
                f"{path} is neither a run folder (with {RUN_CHECKPOINT}), a checkpoint written by fit (a .ckpt file, or "
                f"a folder with {_METADATA_FILENAME}) nor a Hugging Face folder (with config.json)"
            )
        meta = read_metadata(source)
        recorded = meta.get("tokenizer_path")  # an older checkpoint's: a folder on the machine that wrote it
        missing = (
            f"{source} was trained on token ids without a tokenizer (like the quickstart's synthetic data), so it cannot "
            "read or write text; train on text (--config configs/wikipedia.yaml) or pass --tokenizer_path"
        )
    if tokenizer_path is None and meta.get("tokenizer_files"):
        tokenizer = tokenizer_from_files(meta["tokenizer_files"], source)
    else:
        tokenizer = load_tokenizer(_tokenizer_folder(tokenizer_path or recorded, missing, source))
    # The weights are read last, once everything else is known to be there.
    if hugging_face:
        hf_logging.disable_progress_bar()  # its bar would interleave with the generated text; a local load is quick
        model = AutoModelForCausalLM.from_pretrained(given, local_files_only=True)
    else:
        model = model_from_checkpoint(source, meta)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model at {source} only {model.config.vocab_size}: "
            "they were not trained together; pass the run's tokenizer with --tokenizer_path"
        )
    model.config.use_cache = True  # training switches the key/value cache off; generation wants it
    model.to(device=target, dtype=getattr(torch, dtype)).eval()
    chat = _chat_renderer(tokenizer, meta, run_folder, hugging_face)
    return Trained(model, tokenizer, source, run_folder, meta.get("seq_len"), meta.get("global_step"), chat)


def _chat_renderer(tokenizer: PreTrainedTokenizerBase, meta: dict, run_folder: Path | None,
                   hugging_face: bool) -> ChatRenderer | None:
    """How training rendered chat, for a model fine-tuned on it: the template the checkpoint records; for a checkpoint
    written before checkpoints recorded it, the tokenizer's own or the plain template when its run's config.yaml
    names the fine-tuning data; for a Hugging Face folder, its tokenizer's template (an export carries its run's)."""
    if hugging_face:
        return ChatRenderer(tokenizer) if isinstance(getattr(tokenizer, "chat_template", None), str) else None
    template = meta.get("chat_template")
    if "chat_template" not in meta and run_folder is not None and _fine_tuned_on_chat(run_folder / "config.yaml"):
        template = ChatRenderer(tokenizer).template_identity
    return None if template is None else recorded_renderer(tokenizer, template)


def _fine_tuned_on_chat(config: Path) -> bool:
    data = (yaml.safe_load(config.read_text()) or {}).get("data")
    return isinstance(data, dict) and str(data.get("class_path", "")).endswith("SFTDataModule")


def _tokenizer_folder(folder: str | None, missing: str, source: Path) -> Path:
    if folder is None:
        raise ValueError(missing)
    if not Path(folder).is_dir():
        raise FileNotFoundError(
            f"tokenizer folder {folder} (for {source}) does not exist, e.g. a cleared token cache; pass --tokenizer_path"
        )
    return Path(folder)
