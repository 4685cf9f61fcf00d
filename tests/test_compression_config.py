"""Compression settings: every method builds, bad settings fail with one line, the listing is complete."""

from __future__ import annotations

import pytest
import torch

from compress.config import METHODS, CompressionConfig, describe_methods
from compress.dgc import DeepGradientCompression
from compress.error_feedback import ErrorFeedback
from compress.powersgd import PowerSGD
from compress.quantize import QSGD, IntQuant
from compress.sparsify import RandomK, Sparsified, TopK
from tests.helpers import cli_in_process, run_cli


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_builds_with_its_defaults(method):
    compressor = CompressionConfig(method=method).build(rank=1)
    assert (compressor is None) == (method == "none")


def test_composite_and_error_feedback_wrap_the_compressor_with_the_settings_given():
    built = CompressionConfig(method="topk", ratio=0.05, quantize="int8", error_feedback=True).build(0)
    assert type(built) is ErrorFeedback and built.residual_dtype == torch.float32
    assert type(built.inner) is Sparsified and type(built.inner.sparsifier) is TopK
    assert (built.inner.sparsifier.ratio, built.inner.sparsifier.k) == (0.05, None)
    assert built.inner.quantizer == IntQuant(num_bits=8, chunk_size=1024)  # the quantiser at its method's defaults

    # k instead of the default ratio; QSGD's private randomness salted by the rank; residuals in bfloat16
    built = CompressionConfig(method="topk", k=64, quantize="qsgd", error_feedback=True,
                              residual_dtype="bfloat16").build(rank=3)
    assert type(built) is ErrorFeedback and built.residual_dtype == torch.bfloat16
    assert (built.inner.sparsifier.ratio, built.inner.sparsifier.k) == (None, 64)
    assert built.inner.quantizer == QSGD(levels=16, chunk_size=1024, salt=3)

    built = CompressionConfig(method="int8", num_bits=4, chunk_size=256, error_feedback=True).build(0)
    assert type(built) is ErrorFeedback and built.inner == IntQuant(num_bits=4, chunk_size=256)

    built = CompressionConfig(method="randomk", k=10, rescale=False, error_feedback=True).build(0)
    assert type(built) is ErrorFeedback and type(built.inner) is RandomK
    assert (built.inner.ratio, built.inner.k, built.inner.rescale, built.inner.unbiased) == (None, 10, False, False)


def test_dgc_options_build_deep_gradient_compression_around_topk():
    built = CompressionConfig(method="topk", ratio=0.02, momentum=0.9, clip_norm=1.5, warmup_steps=4,
                              error_feedback=True, residual_dtype="bfloat16").build(0)
    assert type(built) is DeepGradientCompression and built.residual_dtype == torch.bfloat16
    assert (built.momentum, built.clip_norm, built.warmup_steps, built.target_ratio) == (0.9, 1.5, 4, 0.02)
    assert type(built.inner) is TopK and built.topk is built.inner
    quantised = CompressionConfig(method="topk", ratio=0.02, quantize="int8", momentum=0.5, error_feedback=True).build(0)
    assert type(quantised) is DeepGradientCompression and type(quantised.inner) is Sparsified
    assert quantised.topk is quantised.inner.sparsifier and (quantised.momentum, quantised.clip_norm) == (0.5, None)
    assert quantised.inner.quantizer == IntQuant(num_bits=8, chunk_size=1024)


def test_powersgd_builds_with_its_settings_and_defaults():
    built = CompressionConfig(method="powersgd", rank=2, start_step=3).build(0)
    assert type(built) is PowerSGD and (built.rank, built.start_step, built.min_compression) == (2, 3, 2.0)


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
    listing = cli_in_process("compressors", cwd=tmp_path).stdout
    assert listing.strip() == describe_methods().strip()
    for name, method in METHODS.items():
        assert name in listing and all(param in listing for param in method.defaults)


def test_unknown_method_in_yaml_fails_before_workers_start(tmp_path):
    # cli_in_process fails the test where a process group starts or training is reached
    result = cli_in_process("fit", "--trainer.strategy.init_args.compression.method", "zip",
                            "--trainer.accelerator", "cpu", "--trainer.devices", "2", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown compression method 'zip'" in result.stderr


def test_a_rank_larger_than_the_chunk_matrix_fails_before_the_first_step(tmp_path):
    result = run_cli("fit", "--trainer.strategy.init_args.compression", "{method: lowrank, rank: 5000}",
                     "--trainer.accelerator", "cpu", "--trainer.devices", "1", cwd=tmp_path, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert result.returncode != 0 and len(errors) == 1 and "lower rank" in errors[0], result.stderr[-1500:]
    assert "Epoch 0" not in result.stdout
