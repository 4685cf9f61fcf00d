"""The quantised parameter all-gather (ZeRO++'s qwZ) on 2 gloo processes: FSDP2 forward and a CLI run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from compress.communicator import CommStats
from compress.config import CompressionConfig
from compress.param_gather import QuantizedAllGather
from tests.distributed import run
from tests.helpers import fit


def sharded_forward(rank: int, world: int) -> dict:
    """Per gather (None: FSDP2's own, int8, fp8): a linear layer's output through FSDP2, the exact output, this rank's
    shard of the exact weight and of the sharded master after the forward, the counters, and the output's error bound."""
    results = {}
    for method in (None, "int8", "fp8"):
        torch.manual_seed(0)
        layer = torch.nn.Linear(300, 77)  # 77 rows: shards that do not divide evenly, padded by FSDP2
        exact_weight = layer.weight.detach().clone()
        inputs = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
        exact = layer(inputs).detach()
        fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
        stats = CommStats()
        if method is not None:
            codec = CompressionConfig(param_all_gather=method).param_codec()
            layer.set_custom_all_gather(QuantizedAllGather(codec, stats, "u"))
        out = layer(inputs).detach()
        layer.reshard()  # the root keeps its gathered weights after forward
        master = layer.weight.to_local().detach().clone()
        rows = math.ceil(77 / world)
        # each weight moves by at most half a step of its chunk's grid (int8: absmax / 127; e4m3: 2**-3 of its binade)
        per_weight = {"int8": 0.5 / 127, "fp8": 2**-4, None: 0.0}[method] * exact_weight.abs().max()
        bound = float(inputs.abs().sum(dim=1).max() * per_weight)
        results[method] = (out, exact, exact_weight[rank * rows : (rank + 1) * rows], master, stats.take(), bound)
    return results


def test_forward_with_quantised_weights_is_within_the_bound_and_the_master_stays_exact(tmp_path):
    for per_method in run(sharded_forward, tmp_path):
        out, exact, *_ = per_method[None]
        torch.testing.assert_close(out, exact)
        for method in ("int8", "fp8"):
            out, exact, shard, master, stats, bound = per_method[method]
            torch.testing.assert_close(master, shard, rtol=0, atol=0)  # the optimizer's weights are untouched
            assert 0 < (out - exact).abs().max() <= bound  # quantised, and within the bound
            assert stats["gather_bytes_raw"] > 3.5 * stats["gather_bytes_sent"] > 0  # about 4x fewer bytes than fp32
            assert stats["gather_bytes_raw"] == 39 * (300 + 1) * 4  # the other rank's padded shards (weight, bias) in fp32


def test_training_with_an_int8_parameter_gather_learns_and_reports_its_ratio(tmp_path):
    metrics = fit(tmp_path, "--trainer.strategy.init_args.compression", json.dumps({"param_all_gather": "int8"}),
                  callbacks=[{"class_path": "callbacks.CompressionStats"}], steps=6)
    losses = metrics["train/loss"]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert metrics["compress/param_gather_ratio"][-1] > 3.5
    assert "compress/ratio_vs_fp32" not in metrics  # the gradients took FSDP2's own reduce-scatter


def test_an_unknown_param_all_gather_method_is_refused():
    with pytest.raises(ValueError, match="param_all_gather: 'topk' is not one of int8, fp8"):
        CompressionConfig(param_all_gather="topk").param_codec()
