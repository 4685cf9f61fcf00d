"""SlideFSDP's activation plan: each block's activations kept on the device, saved in host memory or recomputed, in
any mix, train bit for bit as full recompute does in float32 on the CPU; counts that cannot work are refused in one
line; ``auto`` picks the fastest mix that fits; the host side of a plan is counted and refused before launch."""

from __future__ import annotations

import json

import pytest
import torch

from offload.activation_plan import ActivationPlan, BlockCosts, choose, cost
from tests.helpers import fit_arguments, read_metrics

SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy", "--trainer.strategy.init_args.param_dtype",
         "float32", "--model.config_overrides", '{"n_layer": 4}', "--trainer.strategy.init_args.param_transfer", "full"]


def test_counts_lay_the_blocks_out_host_first_then_recompute_then_keep_and_bad_counts_are_one_line():
    assert ActivationPlan.of_counts({"host": 1, "recompute": 2}, 4).modes == ("host", "recompute", "recompute", "keep")
    assert ActivationPlan.of_counts({"keep": 2, "recompute": 2}, 4).blocks("keep") == [2, 3]
    assert ActivationPlan.every(5, 2).modes == ("recompute", "keep", "recompute", "keep", "recompute")
    assert ActivationPlan.every(3, 0).counts() == {"host": 0, "recompute": 0, "keep": 3}
    assert ActivationPlan.of_counts({"host": 1, "recompute": 2}, 4).describe() == \
        "1 on the host, 2 recomputed, 1 kept on the device"
    with pytest.raises(ValueError, match=r"^SlideFSDP activation_plan \{'host': 3, 'recompute': 3\}: the counts add up "
                                         r"to 6 blocks but the model has 4; make them add up to 4, or use auto$"):
        ActivationPlan.of_counts({"host": 3, "recompute": 3}, 4)
    with pytest.raises(ValueError, match=r"per mode of host, recompute, keep"):
        ActivationPlan.of_counts({"offload": 4}, 4)


def costs(**changes) -> BlockCosts:
    """An 8B-like block at 64k tokens on an H100: 10.9 GB saved, 0.5 GB input, 0.44 GB of weights, 80 ms forward."""
    base = dict(saved_bytes=10_900_000_000, input_bytes=537_000_000, weight_bytes=436_000_000, forward_s=0.08,
                device_free=40_000_000_000, host_free=30_000_000_000, link_bytes_per_s=50e9)
    return BlockCosts(**{**base, **changes})


def test_auto_keeps_what_the_device_holds_sends_the_link_can_carry_to_the_host_and_recomputes_the_rest():
    """An 8B-like block at 64k tokens: 60 GB free on the device keep 3 blocks (beside the recomputed ones' inputs and
    a recompute's block); a host with 100 GB and a 50 GB/s link take 9 blocks, whose copies the compute hides, with 2
    of them on the device at a time (the one computing, the one coming back), so 1 stays; a slow link or a full host
    take none; a device with room for all keeps all; nothing fitting recomputes every block."""
    roomy = costs(device_free=60_000_000_000, host_free=100_000_000_000)
    plan = choose(32, roomy).plan
    assert plan.counts() == {"host": 9, "recompute": 22, "keep": 1}
    assert choose(32, costs(device_free=60_000_000_000)).plan.counts() == {"host": 0, "recompute": 29, "keep": 3}
    slow = costs(device_free=60_000_000_000, host_free=100_000_000_000, link_bytes_per_s=1e9)
    assert choose(32, slow).plan.count("host") == 0
    assert choose(4, costs(device_free=10**12)).plan.counts() == {"host": 0, "recompute": 0, "keep": 4}
    assert choose(4, costs(device_free=0, host_free=0)).plan.counts() == {"host": 0, "recompute": 4, "keep": 0}
    fastest = cost(plan, roomy)
    assert fastest.step_s < cost(ActivationPlan.every(32, 1), roomy).step_s
    assert fastest.device_bytes <= roomy.device_free and fastest.host_bytes <= roomy.host_free


def test_every_plan_trains_bit_for_bit_as_full_recompute_in_float32(tmp_path, monkeypatch):
    """gpt2-tiny with 4 blocks, one process, copies emulated as asynchronous: all recomputed (the reference), all
    kept, all on the host, and a mix (host, recompute with its input on the host, keep) give the same losses and the
    same logits after training, to the bit."""
    from offload.transfers import EMULATED_DELAY_VARIABLE
    from tests.distributed import fit_in_process, run

    monkeypatch.setenv(EMULATED_DELAY_VARIABLE, "2")
    plans = {"recompute": ({"recompute": 4}, []), "keep": ({"keep": 4}, []), "host": ({"host": 4}, []),
             "mix": ({"host": 1, "recompute": 2}, ["--trainer.strategy.init_args.activation_offload", "cpu"])}
    runs = [fit_arguments(tmp_path / name, *SLIDE, "--trainer.strategy.init_args.activation_plan", json.dumps(plan),
                          *extra, devices=1, steps=4, callbacks=[{"class_path": "tests.probes.SaveLogits",
                                                                  "init_args": {"path": str(tmp_path / f"{name}.pt")}}])
            for name, (plan, extra) in plans.items()]
    run(fit_in_process, tmp_path, runs, world=1)

    def losses(name):
        return read_metrics(max((tmp_path / name).glob("lightning_logs/version_*/metrics.csv")))["train/loss"]

    want, logits = losses("recompute"), torch.load(tmp_path / "recompute.pt")["logits"]
    assert len(want) == 4
    for name in ("keep", "host", "mix"):
        assert losses(name) == want, name
        assert torch.equal(torch.load(tmp_path / f"{name}.pt")["logits"], logits), name


def test_a_host_block_copies_each_saved_tensor_once_and_leaves_its_weights_in_their_slot():
    """Two projections of one input under the hooks: the input (saved by both) and the first projection's output
    go to the host, once each; the weights, views of the device slot, are not copied; the backward gets the values."""
    from offload.saved_on_host import SavedOnHost
    from offload.transfers import Transfers

    class Buffers:
        def __init__(self):
            self.regions = {}

        def activation_buffer(self, key, numel, dtype, pin):
            self.regions[key] = torch.empty(numel, dtype=dtype)
            return self.regions[key]

        def activation_copy(self, key, copied):
            pass

    slot = torch.randn(2 * 16 * 16)
    first, second = (slot[i * 256:(i + 1) * 256].view(16, 16).requires_grad_(True) for i in range(2))
    buffers = Buffers()
    store = SavedOnHost(Transfers(torch.device("cpu")), buffers, False, [slot])
    x = torch.randn(4, 16, requires_grad=True)
    with store.hooks(0):
        out = (torch.tanh(x @ first) + x @ second).sum()
    assert [copy.span.numel() for copy in store.saved[0]] == [64, 64]  # x once, tanh's output once; no weight
    out.backward()
    reference_x = x.detach().clone().requires_grad_(True)
    (torch.tanh(reference_x @ first.detach()) + reference_x @ second.detach()).sum().backward()
    assert torch.equal(x.grad, reference_x.grad)


def test_a_plan_whose_host_blocks_do_not_fit_the_host_is_refused_before_launch_naming_the_knob():
    """The shipped 8B with 12 of its blocks' activations on the host (11.0 GiB each at 32 x 2048 tokens: 132 GiB, beside
    the 94 GiB the rest takes on a 128 GiB host), refused by the preflight's plan in one line that names activation_plan."""
    from offload.host_memory import GIB
    from tests.test_offload_host import _llama_8b_offload

    strategy, trainer, module, data = _llama_8b_offload()
    strategy.activation_plan = {"host": 12, "recompute": 20}
    units = strategy.model_units(module, data, trainer.num_devices)
    plan = strategy.plan(trainer)
    saved = plan.activation_bytes(units, module, data)
    assert saved == 12 * 32 * 2048 * (8 * 4096 + 4 * 14336) * 2
    with pytest.raises(ValueError, match=r"^SlideFSDP needs .* GiB .* but 128.0 GiB are available; put fewer blocks on "
                                         r"the host in activation_plan \(their activations take 132.0 GiB; recompute "
                                         r"them instead\), or use auto$"):
        plan.check_host(units, 128 * GIB, "available", activation_bytes=saved)


EIGHT_K = ["--config", "configs/llama_8b_offload_8k.yaml"]
#: the update held at delayed, so that the plan's own gain shows (auto's split takes the host room first)
DELAYED = ["--trainer.strategy.init_args.update", "delayed"]


def test_estimate_takes_a_plan_of_counts_as_the_config_gives_it(capsys):
    """``activation_plan: {host: 1, recompute: 31}`` (gpu_check's first window sets counts): estimate plans those
    blocks, not tune's search of null and auto, and moves the host blocks' tensors both ways over PCIe."""
    from lit_fsdp.commands.estimate import main
    from tests.helpers import REPO

    main(["--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(REPO / "configs" / "llama_8b_offload.yaml"),
          "--trainer.strategy.init_args.activation_plan", "{host: 1, recompute: 31}",
          "--tune.hardware", str(REPO / "configs" / "hardware" / "h100_128g.json"), "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert figures["activation_plan"] == {"host": 1, "recompute": 31, "keep": 0} and figures["fits"]
    host_blocks = 65_536 * (8 * 4096 + 4 * 14336) * 2
    assert figures["h2d_bytes"] == pytest.approx(29.58e9 + host_blocks, rel=1e-3)


@pytest.mark.parametrize(("extra", "counts", "mfu", "micro_batches"), [
    (DELAYED, {"host": 0, "recompute": 32, "keep": 0}, 0.414, 1),
    ([*DELAYED, "--trainer.strategy.init_args.activation_plan", "auto"], {"host": 0, "recompute": 30, "keep": 2}, 0.420, 1),
    ([*EIGHT_K, *DELAYED], {"host": 0, "recompute": 30, "keep": 2}, 0.420, 1),  # the 8k's shape: 1 micro-batch of 8
    ([*EIGHT_K, *DELAYED, "--data.init_args.batch_size", "2", "--trainer.accumulate_grad_batches", "4"],
     {"host": 8, "recompute": 18, "keep": 6}, 0.462, 4),
])
def test_estimate_takes_and_prints_the_plan_of_both_8b_configs_on_the_h100_file(capsys, extra, counts, mfu,
                                                                               micro_batches):
    """docs/offload.md's table, the update delayed: the 8B at 2,048 tokens as shipped and with auto, and at 8,192
    (auto) in one micro-batch of 8 (as shipped) and in 4 of 2 (the device's float32 sum of the gradients counted beside the plan's
    activations), on the H100 file: the plan, the whole recomputed blocks in the compute, the weights loaded per
    micro-batch and the host blocks' tensors both ways over PCIe, and a fit on both sides."""
    from lit_fsdp.commands.estimate import main
    from tests.helpers import REPO

    main(["--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(REPO / "configs" / "llama_8b_offload.yaml"),
          *[str(REPO / a) if a.startswith("configs/") else a for a in extra],
          "--tune.hardware", str(REPO / "configs" / "hardware" / "h100_128g.json"), "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert figures["activation_plan"] == counts and figures["fits"]
    assert figures["mfu"] == pytest.approx(mfu, abs=0.001)
    host_blocks = counts["host"] * 65_536 * (8 * 4096 + 4 * 14336) * 2  # a step's tokens, whatever its micro-batches
    weights = {1: 29.58e9, 4: 112.03e9}[micro_batches]  # the blocks loaded twice per micro-batch, the root once a step
    assert figures["h2d_bytes"] == pytest.approx(weights + host_blocks, rel=1e-3)
    accumulated = figures["device_by_component"]["model_states"]
    assert accumulated == (8_030_261_248 * 4 if micro_batches > 1 else 0)  # every parameter's float32 sum
    assert figures["host_by_buffer"].get("activations", 0) == host_blocks // micro_batches  # one micro-batch's


def test_a_tensor_freed_in_the_forward_does_not_stand_in_for_a_later_one_at_its_address():
    """Two reductions whose inputs autograd saves and frees one after the other (the second may get the first's
    address): each is copied to the host, and the gradients are the reference's; a saved tensor changed in place
    afterwards is refused in one line at the block's end."""
    from offload.saved_on_host import SavedOnHost
    from offload.transfers import Transfers

    class Buffers:
        def activation_buffer(self, key, numel, dtype, pin):
            return torch.empty(numel, dtype=dtype)

        def activation_copy(self, key, copied):
            pass

    store = SavedOnHost(Transfers(torch.device("cpu")), Buffers(), False, [])
    x = torch.randn(256, 256, requires_grad=True)
    with store.hooks(0):
        out = (torch.sigmoid(x * 2).sum(-1) + torch.sigmoid(x).sum(-1)).sum()
    store.end_forward(0)
    out.backward()
    reference = x.detach().clone().requires_grad_(True)
    (torch.sigmoid(reference * 2).sum(-1) + torch.sigmoid(reference).sum(-1)).sum().backward()
    assert torch.equal(x.grad, reference.grad)
    y = torch.randn(8, requires_grad=True)
    with store.hooks(1):
        kept = torch.exp(y)  # exp saves its output
        kept.add_(1.0)  # which autograd would refuse at the backward without hooks
    with pytest.raises(RuntimeError, match=r"^SlideFSDP block 1: a tensor its backward needs .* changed in place"):
        store.end_forward(1)


@pytest.mark.parametrize("pinned", [True, False])
def test_auto_counts_the_host_buffers_placed_before_memavailable_is_read_once(monkeypatch, pinned):
    """The shipped 8B, placed: MemAvailable (read after the master, the staging copy and, pinned, the gradient ring
    were written) already lacks them, so the host's room for activations is it less only what is still to come (the
    moments, an unpinned ring, the runtime); ``host_memory_gb`` is a budget for all the buffers, each counted once."""
    import types

    from offload import preflight
    from offload.host_memory import GIB, with_runtime
    from offload.plan import placed_costs
    from tests.test_offload_host import _llama_8b_offload

    strategy, trainer, module, data = _llama_8b_offload()
    strategy.activation_plan = "auto"
    units = strategy.model_units(module, data, trainer.num_devices)
    plan = strategy.plan(trainer)
    parts = with_runtime(plan.host_buffers(units), plan.run.processes_per_node)
    module_view = types.SimpleNamespace(trainer=types.SimpleNamespace(datamodule=data), hparams={},
                                        hf_config=module.hf_config)
    ring = types.SimpleNamespace(region=types.SimpleNamespace(pinned=pinned))
    window = types.SimpleNamespace(device=torch.device("cpu"), host=types.SimpleNamespace(incoming=ring))
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 60 * GIB)  # 128 GiB less what placement wrote
    costs = placed_costs(module_view, plan, window, units, None)
    to_come = parts["adam_moments"] + parts["runtime"] + (0 if pinned else parts["gradient_ring"])
    assert costs.host_free == 60 * GIB - 60 * GIB // 16 - to_come > 0  # the reserve kept; counted twice: 0 left
    budget = placed_costs(module_view, plan, window, units, 128.0)
    assert budget.host_free == 128 * GIB - 8 * GIB - sum(parts.values())  # less the reserve, 1/16
