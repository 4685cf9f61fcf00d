"""Export a lit_fsdp checkpoint (sharded folder or full file) to a Hugging Face model folder.

A LoRA checkpoint holds only what trained (the adapters, and the modules trained whole beside them): they are merged
into the base they were trained on, or written alone in peft's format (``--adapter_only true``).
"""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from lit_fsdp import checkpoints, lora
from lit_fsdp.data.chat import jinja_template
from lit_fsdp.data.tokenizer import tokenizer_from_files
from lit_fsdp.errors import OneLineError
from lit_fsdp.lightning_compat import METADATA_FILENAME as _METADATA_FILENAME
from lit_fsdp.parallelize import find_blocks
from lit_fsdp.weights import init_by_unit, load_by_shard

_MODEL_PREFIX = "model."  # CausalLM keeps the network in `self.model`


def read_metadata(checkpoint: Path) -> dict[str, Any]:
    """Everything but the weights: loop state, hyperparameters, ``hf_config``, ``tokenizer_files``, ``seq_len``."""
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist; give a .ckpt file or folder written by fit")
    file = checkpoint / _METADATA_FILENAME if checkpoint.is_dir() else checkpoint
    if not file.is_file():
        raise FileNotFoundError(
            f"{checkpoint} is not a checkpoint: it holds no {_METADATA_FILENAME}; give a .ckpt file or folder written by fit"
        )
    try:
        # Memory-mapped: a full-file checkpoint's weights are not read just to get at its metadata.
        meta = checkpoints.load(file, map_location="cpu", mmap=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(f"{file} is not a checkpoint written by fit: torch.load failed ({reason})") from None
    if not isinstance(meta, dict) or "hf_config" not in meta:
        raise ValueError(f"{checkpoint} holds no hf_config: it was not written by lit_fsdp's CausalLM")
    meta.pop("state_dict", None)
    meta.pop("optimizer_states", None)
    return meta


def load_weights(checkpoint: Path, model: torch.nn.Module, only: Collection[str] | None = None) -> None:
    """Fill ``model`` (built on CPU) with the network weights of a checkpoint; ``only``: those parameters (what a LoRA
    run trained, the whole of an adapter checkpoint)."""
    wanted = {k: v for k, v in model.state_dict().items() if only is None or k in only}
    if checkpoint.is_dir():
        import torch.distributed.checkpoint as dcp

        # Only the model's keys are requested, so the optimizer shards are never read.
        state = {"state_dict": {_MODEL_PREFIX + k: v for k, v in wanted.items()}}
        with warnings.catch_warnings():  # loading in one process is the intent here, not a fallback
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
            try:
                dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
            except dcp.CheckpointException as error:  # a BaseException, whose text is every rank's traceback
                raise OneLineError(f"checkpoint {checkpoint} cannot be read: {_shard_failure(error)}; copy the whole "
                                   "folder again from where fit wrote it, or use another of the run's checkpoints") from error
        return
    saved = checkpoints.load(checkpoint, map_location="cpu", mmap=True)["state_dict"]
    saved = {k[len(_MODEL_PREFIX) :]: v for k, v in saved.items() if k.startswith(_MODEL_PREFIX)}
    if only is not None:
        missing = sorted(set(wanted) - set(saved))
        if missing:
            raise OneLineError(f"checkpoint {checkpoint} holds no {missing[0]} ({len(missing)} missing); use a "
                               "checkpoint of the same run")
        saved = {k: saved[k] for k in wanted}
    model.load_state_dict(saved, strict=only is None)


def _shard_failure(error: Any) -> str:
    """What went wrong in reading a sharded checkpoint: a file that is not there, or the first rank's error."""
    cause = next(iter(error.failures.values()))[0] if error.failures else error
    if isinstance(cause, FileNotFoundError) and cause.filename:
        return f"its file {Path(cause.filename).name} is missing"
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def model_from_checkpoint(checkpoint: Path, meta: dict[str, Any], base_path: str | None = None) -> PreTrainedModel:
    """The whole network of a checkpoint on CPU (a sharded folder is consolidated), given its ``read_metadata``; a LoRA
    checkpoint's adapters merged into its base (``base_path``, default the one it was trained on)."""
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**meta["hf_config"]))
    record = meta.get("lora")
    if record is None:
        load_weights(checkpoint, model)
        return model
    base = base_path or record["base"]
    if base_path is None and base.startswith("preset "):  # a random base: drawn again from the run's seed
        init_by_unit(model, find_blocks(model), model._init_weights, record["init_seed"])
    elif Path(base).is_dir():
        load_by_shard(model, base)
    else:
        raise FileNotFoundError(f"checkpoint {checkpoint} holds LoRA adapters for the base {base}, which is not a "
                                "folder here; give the base's folder with --base_path FOLDER")
    config = lora.LoraConfig(**record["lora"])
    lora.attach(model, config)
    # the record is of the base, before training: taken before the trained embeddings are read
    lora.check_same_base(record, lora.base_record(model, config, base, record["init_seed"]), checkpoint,
                         fix=f"give the base it was trained on, {record['base']}, with --base_path FOLDER")
    load_weights(checkpoint, model, only=lora.trained_names(model))
    lora.merge(model)
    return model


def export_adapters(checkpoint: Path, meta: dict[str, Any], out: Path) -> None:
    """Write a LoRA checkpoint's adapters, and the modules trained beside them, as peft saves them (the rest of the
    base is never built)."""
    record = meta.get("lora")
    if record is None:
        raise ValueError(f"checkpoint {checkpoint} holds a whole model, not LoRA adapters; export it without --adapter_only")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**meta["hf_config"]))
    config = lora.LoraConfig(**record["lora"])
    lora.attach(model, config, device="cpu")
    for path in lora.train_paths(model, config):
        model.get_submodule(path).to_empty(device="cpu")
    model.tie_weights()  # to_empty gave the embeddings new parameters: a tied head takes them again
    load_weights(checkpoint, model, only=lora.trained_names(model))
    base = None if record["base"].startswith("preset ") else record["base"]
    adapter_config, tensors = lora.peft_adapter(model, config, base)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def export_hf(checkpoint: str, output: str, tokenizer_path: str | None = None, adapter_only: bool = False,
              base_path: str | None = None) -> Path:
    """Write a Hugging Face folder (config.json + model.safetensors [+ tokenizer]) from a lit_fsdp checkpoint.

    Args:
        checkpoint: A checkpoint written by ``fit`` (a sharded folder or a single .ckpt file).
        output: Folder to write; ``AutoModelForCausalLM.from_pretrained(output)`` loads it.
        tokenizer_path: Tokenizer folder to copy along; default: the one the run trained with, if any.
        adapter_only: For a LoRA checkpoint, write only the adapters in peft's format (adapter_config.json,
            adapter_model.safetensors), which ``peft.PeftModel.from_pretrained(base, output)`` loads; default: the
            base with the adapters merged in.
        base_path: For a LoRA checkpoint, the base model's folder; default: the one it was trained on.
    """
    source = Path(checkpoint)
    meta = read_metadata(source)
    out = Path(output)
    if out.exists() and not out.is_dir():  # save_pretrained would only log that, and write nothing
        raise ValueError(f"{out} is a file; give the folder to write the Hugging Face model into (new or existing)")
    if adapter_only:
        export_adapters(source, meta, out)
        print(f"exported the LoRA adapters of {source} to {out}")
        return out
    if tokenizer_path is not None and not Path(tokenizer_path).is_dir():
        raise FileNotFoundError(f"--tokenizer_path {tokenizer_path}: no such folder; give a Hugging Face tokenizer "
                                "folder, or leave it unset to export the tokenizer the run trained with")
    model = model_from_checkpoint(source, meta, base_path)
    model.save_pretrained(out, safe_serialization=True)
    no_tokenizer = None
    if tokenizer_path is None and meta.get("tokenizer_files"):
        tokenizer = tokenizer_from_files(meta["tokenizer_files"], source)
        if meta.get("chat_template"):  # a chat fine-tune: apply_chat_template renders prompts as its training did
            tokenizer.chat_template = jinja_template(meta["chat_template"])
        tokenizer.save_pretrained(out)
    else:
        tokenizer_path = tokenizer_path or meta.get("tokenizer_path")  # an older checkpoint's tokenizer folder
        if tokenizer_path and Path(tokenizer_path).is_dir():
            AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True).save_pretrained(out)
        else:
            no_tokenizer = f"its tokenizer folder {tokenizer_path} is gone" if tokenizer_path else \
                "this run trained on token ids"
    print(f"exported {source} to {out}")
    if no_tokenizer:  # the folder loads as a model, but fine-tuning it, generate and evaluate read text
        print(f"no tokenizer: {no_tokenizer}, so {out} holds none; fine-tuning it, generate and evaluate need one: "
              "export a run that trained on text, such as configs/wikipedia.yaml's, or give --tokenizer_path FOLDER")
    return out
