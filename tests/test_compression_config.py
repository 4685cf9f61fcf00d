"""Compression settings: every method builds, bad settings fail with one line, the listing is complete."""

from __future__ import annotations

import pytest

from compress.config import METHODS, CompressionConfig, describe_methods
from compress.error_feedback import ErrorFeedback
from tests.helpers import run_cli


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_builds_with_its_defaults(method):
    compressor = CompressionConfig(method=method).build(rank=1)
    assert (compressor is None) == (method == "none")


def test_composite_and_error_feedback_wrap_the_compressor():
    compressor = CompressionConfig(method="topk", ratio=0.01, quantize="int8", error_feedback=True).build(0)
    assert isinstance(compressor, ErrorFeedback)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"method": "zip"}, "unknown compression method 'zip'"),
        ({"method": "topk", "ratio": 1.5}, "ratio"),
        ({"method": "topk", "ratio": 0.0}, "ratio"),
        ({"method": "int8", "num_bits": 9}, "num_bits"),
        ({"method": "int8", "num_bits": 1}, "num_bits"),
        ({"method": "lowrank", "rank": 0}, "rank"),
        ({"method": "qsgd", "error_feedback": True}, "error_feedback needs a biased method"),
        ({"method": "none", "error_feedback": True}, "error_feedback needs a biased method"),
        ({"method": "int8", "ratio": 0.1}, "ratio does not apply to method 'int8'"),
        ({"method": "int8", "quantize": "fp16"}, "composes a sparsifier"),
    ],
)
def test_bad_settings_raise_one_clear_error(settings, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(**settings).build(rank=0)


def test_the_command_lists_every_method_and_its_parameters(tmp_path):
    listing = run_cli("compressors", cwd=tmp_path).stdout
    assert listing.strip() == describe_methods().strip()
    for name, method in METHODS.items():
        assert name in listing and all(param in listing for param in method.defaults)


def test_unknown_method_in_yaml_fails_before_workers_start(tmp_path):
    result = run_cli("fit", "--trainer.strategy.init_args.compression.method", "zip",
                     "--trainer.accelerator", "cpu", "--trainer.devices", "2", cwd=tmp_path, check=False)
    assert result.returncode != 0 and "Initializing distributed" not in result.stderr
    assert "unknown compression method 'zip'" in result.stderr


def test_a_rank_larger_than_the_chunk_matrix_fails_before_the_first_step(tmp_path):
    result = run_cli("fit", "--trainer.strategy.init_args.compression", "{method: lowrank, rank: 5000}",
                     "--trainer.accelerator", "cpu", "--trainer.devices", "1", cwd=tmp_path, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert result.returncode != 0 and len(errors) == 1 and "lower rank" in errors[0], result.stderr[-1500:]
    assert "Epoch 0" not in result.stdout
