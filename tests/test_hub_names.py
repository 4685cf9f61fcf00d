"""Models, tokenizers and data sets by their Hugging Face Hub names (``lit_fsdp.hub``), read from a Hub cache laid out
by hand as ``hf download`` leaves it (blobs, refs/main, snapshots/<commit> of links to the blobs), offline: nothing is
downloaded here. A download is stood in for where the online path is checked."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import constants
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lit_fsdp import hub
from lit_fsdp.data.sft import SFTDataModule
from lit_fsdp.errors import OneLineError
from lit_fsdp.model import CausalLM
from lit_fsdp.presets import build_config
from lit_fsdp.weights import load_by_shard
from tests.corpus import articles, datamodule, write_shards
from tests.helpers import SFT_SAMPLES, fit, save_sft_base

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def cache_repo(cache: Path, kind: str, repo: str, files: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """``files`` (a folder) as the snapshot ``commit`` of ``repo`` in the Hub cache ``cache``: each file a blob, linked
    from the snapshot as huggingface_hub links them; ``refs/<ref>`` names the commit. The snapshot folder."""
    storage = cache / f"{kind}s--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for file in sorted(path for path in files.rglob("*") if path.is_file()):
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """What the cached repositories hold: a tiny GPT-2 with its BPE, as save_pretrained writes them, and Wikipedia
    shards."""
    root = tmp_path_factory.mktemp("hub_sources")
    save_sft_base(root / "tiny")
    write_shards(root / "wiki" / "20231101.en", articles())
    return {"tiny": root / "tiny", "wiki": root / "wiki"}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache named by HF_HUB_CACHE, offline (the environment, and huggingface_hub's constant read when it
    was imported), with no snapshot resolved by an earlier test."""
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv(hub.RESOLVED_ENV, "{}")
    return folder


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_model_and_its_tokenizer_load_by_hub_name_from_the_cache(sources, cache, monkeypatch, variable):
    if variable == "HF_HOME":  # the cache is $HF_HOME/hub when HF_HUB_CACHE is not set
        monkeypatch.delenv("HF_HUB_CACHE")
        monkeypatch.setenv("HF_HOME", str(cache.parent / "home"))
        cache = cache.parent / "home" / "hub"
    snapshot = cache_repo(cache, "model", "owner/tiny", sources["tiny"])
    module = CausalLM(pretrained_path="owner/tiny")
    assert module.pretrained_folder == str(snapshot)
    assert module.hparams.pretrained_path == "owner/tiny"  # what checkpoints keep: the name, resolved on each machine
    config, expected_config = module.hf_config().to_dict(), AutoConfig.from_pretrained(sources["tiny"]).to_dict()
    assert config.pop("_name_or_path") == str(snapshot)
    expected_config.pop("_name_or_path")
    assert config == expected_config

    # the tokenizer taken from the model, and one named by --data.tokenizer_path
    data = SFTDataModule(train_path=str(SFT_SAMPLES / "train.jsonl"), seq_len=64)
    named = SFTDataModule(train_path=str(SFT_SAMPLES / "train.jsonl"), tokenizer_path="owner/tiny", seq_len=64)
    words = "reverse: sea sky"
    expected_ids = AutoTokenizer.from_pretrained(sources["tiny"])(words)["input_ids"]
    assert data._model_tokenizer(module)(words)["input_ids"] == expected_ids == named.tokenizer(words)["input_ids"]


def test_a_revision_resolves_by_commit_and_by_branch(sources, cache):
    main = cache_repo(cache, "model", "owner/tiny", sources["tiny"])
    pinned = cache_repo(cache, "model", "owner/tiny", sources["tiny"], commit=OTHER_COMMIT, ref=None)
    assert hub.model_folder("owner/tiny@main", "--model.pretrained_path") == str(main)
    assert hub.model_folder(f"owner/tiny@{OTHER_COMMIT}", "--model.pretrained_path") == str(pinned)
    assert CausalLM(pretrained_path=f"owner/tiny@{OTHER_COMMIT}").pretrained_folder == str(pinned)
    with pytest.raises(OneLineError, match=re.escape("`hf download owner/tiny --revision v2`")):
        hub.model_folder("owner/tiny@v2", "--model.pretrained_path")


def test_a_data_sets_shards_are_read_by_name_and_subfolder(sources, cache, tmp_path):
    cache_repo(cache, "dataset", "owner/wiki", sources["wiki"])
    expected = datamodule(sources["wiki"] / "20231101.en", tmp_path / "tokens")
    expected.setup("fit")
    for name in ("owner/wiki:20231101.en", "owner/wiki@main:20231101.en", f"owner/wiki@{COMMIT}:20231101.en/"):
        data = datamodule(name, tmp_path / "tokens")
        assert len(data.train_path.files) == 3 and data.dataset_name == "20231101.en"
        data.setup("fit")
        np.testing.assert_array_equal(data.train_set.tokens[:], expected.train_set.tokens[:])
    glob = datamodule("owner/wiki:20231101.en/train-0000[01]-*.parquet", tmp_path / "tokens")
    assert [file.name for file in glob.train_path.files] == ["train-00000-of-00003.parquet", "train-00001-of-00003.parquet"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: CausalLM(pretrained_path="owner/absent"),
         "--model.pretrained_path owner/absent: owner/absent is no local path and is not (wholly) in the Hub cache "
         "{cache} (HF_HUB_OFFLINE=1); download it on a machine with network with `hf download owner/absent`"),
        (lambda: datamodule("owner/absent:20231101.en", Path("unused")),
         "--data.train_path owner/absent:20231101.en: owner/absent is no local path and is not (wholly) in the Hub "
         "cache {cache} (HF_HUB_OFFLINE=1); download it on a machine with network with `hf download --repo-type "
         "dataset owner/absent --include '20231101.en/*'`"),
        (lambda: datamodule("owner/wiki:20220301.fr", Path("unused")),
         "--data.train_path owner/wiki:20220301.fr: the Hub cache's snapshot {snapshot} has no 20220301.fr and "
         "HF_HUB_OFFLINE=1; download it where there is network with `hf download --repo-type dataset owner/wiki "
         "--include '20220301.fr/*'`"),
        (lambda: SFTDataModule(train_path=str(SFT_SAMPLES / "train.jsonl"), tokenizer_path="owner/absent"),
         "--data.tokenizer_path owner/absent: owner/absent is no local path"),
    ],
    ids=["model", "data-set", "data-set-subfolder", "tokenizer"],
)
def test_a_name_missing_offline_is_one_line_naming_the_download(sources, cache, make, message):
    snapshot = cache_repo(cache, "dataset", "owner/wiki", sources["wiki"])
    with pytest.raises(OneLineError) as error:
        make()
    assert str(error.value).startswith(message.format(cache=cache, snapshot=snapshot)), str(error.value)
    assert "\n" not in str(error.value)


def test_a_snapshot_cut_short_names_the_missing_weights(sources, cache):
    snapshot = cache_repo(cache, "model", "owner/tiny", sources["tiny"])
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(OneLineError, match=r"lacks model\.safetensors .*`hf download owner/tiny`"):
        CausalLM(pretrained_path="owner/tiny")


@pytest.mark.parametrize("shard_size", ["5GB", "100KB"], ids=["one-file", "sharded"])
def test_weights_load_from_a_hub_snapshot(cache, tmp_path, shard_size):
    config = build_config("gpt2-tiny")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "saved", max_shard_size=shard_size)
    cache_repo(cache, "model", "owner/tiny", tmp_path / "saved")
    module = CausalLM(pretrained_path="owner/tiny")
    model = AutoModelForCausalLM.from_config(module.hf_config())
    load_by_shard(model, module.pretrained_folder)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())


def test_a_local_folder_wins_over_a_repository_of_the_same_name(sources, cache, tmp_path, monkeypatch):
    cache_repo(cache, "model", "owner/tiny", sources["tiny"])
    monkeypatch.chdir(tmp_path)
    build_config("gpt2-tiny", {"n_layer": 1}).save_pretrained(tmp_path / "owner" / "tiny")
    module = CausalLM(pretrained_path="owner/tiny")
    assert module.pretrained_folder == "owner/tiny" and module.hf_config().n_layer == 1
    # a missing path that is no Hub name keeps the error it always had
    with pytest.raises(FileNotFoundError, match=r"--model.pretrained_path \./owner/absent: no such folder "):
        CausalLM(pretrained_path="./owner/absent")


def test_a_repositorys_own_code_never_runs(sources, cache, monkeypatch, tmp_path):
    calls = []
    for auto in (AutoConfig, AutoTokenizer):
        def spy(path, *args, _real=auto.from_pretrained, **kwargs):
            calls.append(kwargs.get("trust_remote_code"))
            return _real(path, *args, **kwargs)
        monkeypatch.setattr(auto, "from_pretrained", spy)
    cache_repo(cache, "model", "owner/tiny", sources["tiny"])
    module = CausalLM(pretrained_path="owner/tiny")
    SFTDataModule(train_path=str(SFT_SAMPLES / "train.jsonl"), tokenizer_path="owner/tiny")
    module.hf_config()
    assert calls and all(value is False for value in calls), calls

    custom = tmp_path / "custom"
    shutil.copytree(sources["tiny"], custom)
    (custom / "config.json").write_text('{"model_type": "my_model", "auto_map": {"AutoConfig": "code.MyConfig"}}')
    (custom / "code.py").write_text("raise SystemExit('the repository code ran')\n")
    cache_repo(cache, "model", "owner/custom", custom)
    with pytest.raises(OneLineError, match="model_type 'my_model' is unknown to transformers .*lit_fsdp does not run a "
                                           "repository's own code"):
        CausalLM(pretrained_path="owner/custom")


def test_online_names_download_only_what_a_run_needs_and_once(sources, cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    model = cache_repo(cache, "model", "owner/tiny", sources["tiny"])
    data = cache_repo(cache, "dataset", "owner/wiki", sources["wiki"])
    calls = []

    def download(repo_id, **kwargs):  # stands in for the Hub: the files are already where it would put them
        calls.append((repo_id, kwargs))
        return str(data if kwargs["repo_type"] == "dataset" else model)

    monkeypatch.setattr(hub, "snapshot_download", download)
    for _ in range(2):  # a second build (a started process) finds the snapshot resolved: no second request
        CausalLM(pretrained_path="owner/tiny@main")
        datamodule("owner/wiki:20231101.en", Path("unused"))
    (model_repo, model_call), (data_repo, data_call) = calls
    assert model_repo == "owner/tiny" and data_repo == "owner/wiki"
    assert model_call["local_files_only"] is False and model_call["revision"] == "main"
    assert model_call["cache_dir"] == cache and model_call["repo_type"] == "model"
    patterns = model_call["allow_patterns"]
    needed = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
              "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    unneeded = ["pytorch_model.bin", "consolidated.safetensors", "original/consolidated.00.pth", "model.gguf",
                "modeling_custom.py"]
    assert all(any(fnmatch(file, pattern) for pattern in patterns) for file in needed), patterns
    assert not any(fnmatch(file, pattern) for pattern in patterns for file in unneeded), patterns
    assert data_call["repo_type"] == "dataset" and data_call["allow_patterns"] == ["20231101.en", "20231101.en/*"]


def test_fit_trains_a_hub_model_on_a_hub_data_set_offline_in_two_processes(sources, cache, tmp_path):
    cache_repo(cache, "model", "owner/tiny", sources["tiny"])
    cache_repo(cache, "dataset", "owner/wiki", sources["wiki"])
    metrics = fit(tmp_path / "run", "--model.pretrained_path", "owner/tiny",
                  "--data", "lit_fsdp.data.wikipedia.WikipediaDataModule", "--data.train_path", "owner/wiki:20231101.en",
                  "--data.tokenizer_path", "owner/tiny", "--data.seq_len", "32", "--data.cache_dir", str(tmp_path / "tokens"),
                  steps=2)
    assert len(metrics["train/loss"]) == 2 and all(np.isfinite(metrics["train/loss"]))


def test_the_wikipedia_configs_wikitext2_is_read_by_its_hub_name_from_the_cache_offline(cache, tmp_path):
    """configs/wikipedia.yaml names WikiText-2 on the Hub (Salesforce/wikitext's Parquet files, one line a row, empty
    lines and headings included); laid out in the cache as ``hf download`` leaves it, its train and validation files
    are found offline and each gives blocks."""
    import yaml

    from lit_fsdp.data.wikipedia import WikipediaDataModule
    from tests.corpus import write_parquet
    from tests.helpers import REPO

    init_args = yaml.safe_load((REPO / "configs" / "wikipedia.yaml").read_text())["data"]["init_args"]
    files = tmp_path / "wikitext"
    (files / "wikitext-2-v1").mkdir(parents=True)
    for split, count in (("train", 12), ("validation", 4), ("test", 1)):
        lines = [line for record in articles(count) for line in ("", f" = {record['title']} = ", "", record["text"])]
        write_parquet(files / "wikitext-2-v1" / f"{split}-00000-of-00001.parquet", [{"text": line} for line in lines])
    cache_repo(cache, "dataset", "Salesforce/wikitext", files)
    data = WikipediaDataModule(**{**init_args, "vocab_size": 300, "seq_len": 16, "batch_size": 2,
                                  "cache_dir": str(tmp_path / "tokens")})
    assert [file.name for file in data.train_path.files] == ["train-00000-of-00001.parquet"]
    assert [file.name for file in data.val_path.files] == ["validation-00000-of-00001.parquet"]
    data.setup("fit")
    assert len(data.train_set) > 4 * len(data.val_set) > 0  # 12 articles to train on, 4 to validate
