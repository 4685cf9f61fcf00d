"""SlideFSDP's native CPU AdamW (offload/adamw_kernel.c): torch's AdamW arithmetic in one pass, its fallback, its GIL."""

from __future__ import annotations

import ctypes
import threading
import warnings

import pytest
import torch

from compress.layout import UnitLayout
from offload import adamw_kernel, cpu_adam

LR, BETAS = 1e-2, (0.9, 0.95)

needs_compiler = pytest.mark.skipif(adamw_kernel.compiler() is None, reason="no C compiler to build the kernel with")


@pytest.fixture
def fresh_kernel():
    """The kernel as the environment the test sets up finds it; the usual one again afterwards."""
    adamw_kernel.reset()
    yield
    adamw_kernel.reset()


def _groups(weights: list) -> list[dict]:  # weight decay on the matrix, none on the vector
    return [{"params": [weights[0]], "weight_decay": 0.1}, {"params": [weights[1]], "weight_decay": 0.0}]


def _adam(state_dtype: torch.dtype, shapes=((37, 101), (1003,))) -> tuple[cpu_adam.CpuAdam, UnitLayout, torch.Tensor, list]:
    """A CpuAdam over one unit of ``shapes`` (odd sizes: torch's fused kernel has a scalar loop over the last
    elements) on one shard, the master holding the parameters' values."""
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    layout = UnitLayout.build("unit", [((f"p{i}",), p) for i, p in enumerate(params)], shards=1, shard_rank=0)
    master = torch.zeros(layout.shard_numel)
    for rows, param in zip(layout.local_views(master), params):
        rows.copy_(param.detach())
    adam = cpu_adam.CpuAdam([layout], [master], torch.optim.AdamW(_groups(params), lr=LR, betas=BETAS),
                            state_dtype=state_dtype)
    return adam, layout, master, params


def _update_in_ranges(adam: cpu_adam.CpuAdam, layout: UnitLayout, gradient: torch.Tensor, staging: torch.Tensor,
                      cuts: list[int], grad_scale: float) -> None:
    """One step of the unit through ``update_rows`` in the ranges between ``cuts`` (spans across and inside pieces)."""
    bounds = [0, *cuts, layout.shard_numel]
    for start, stop in zip(bounds, bounds[1:]):
        adam.update_rows(0, gradient[start:stop], start, stop, layout.local_views(staging), grad_scale=grad_scale)


def _reference_steps(params: list, gradients: list[torch.Tensor], grad_scale: float, fused: bool,
                     round_moments: bool) -> tuple[list[torch.Tensor], list[dict]]:
    """torch.optim.AdamW on float32 copies of ``params``, one step per gradient (multiplied by ``grad_scale``); with
    ``round_moments`` the moments are rounded to bfloat16 after each step, as bfloat16 moments store them."""
    weights = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = torch.optim.AdamW(_groups(weights), lr=LR, betas=BETAS, **({"fused": True} if fused else {"foreach": False}))
    for gradient in gradients:
        for weight, rows in zip(weights, gradient.float().split([w.numel() for w in weights])):
            weight.grad = rows.view_as(weight) * torch.tensor(grad_scale)  # the product in float32, as the kernel forms it
        optimizer.step()
        for state in optimizer.state.values() if round_moments else ():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].bfloat16())
    return [w.detach() for w in weights], [optimizer.state[w] for w in weights]


@needs_compiler
@pytest.mark.parametrize("gradient_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32_grad", "bf16_grad", "fp16_grad"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32_moments", "bf16_moments"])
def test_native_update_in_spans_with_a_grad_scale_is_torchs_adamw(state_dtype, gradient_dtype):
    """Four steps through update_rows in uneven ranges, gradient x 0.5: bit for bit what torch's fused AdamW gives on the
    float32 gradient times 0.5 (bfloat16 moments: with its moments rounded to bfloat16 after each step), and within
    float32 rounding of the non-fused reference; the staging rows are the master rounded to bfloat16."""
    torch.manual_seed(0)
    adam, layout, master, params = _adam(state_dtype)
    assert adamw_kernel.library() is not None, "a C compiler is on PATH but the kernel did not build"
    staging = torch.full((layout.shard_numel,), float("nan"), dtype=torch.bfloat16)
    gradients = [torch.randn(layout.shard_numel).to(gradient_dtype) for _ in range(4)]
    for step, gradient in enumerate(gradients):
        _update_in_ranges(adam, layout, gradient, staging, [1000 + step, 3737, 4000 - step], grad_scale=0.5)
    adam.close()
    rounded = state_dtype == torch.bfloat16
    fused, fused_state = _reference_steps(params, gradients, 0.5, fused=True, round_moments=rounded)
    plain, plain_state = _reference_steps(params, gradients, 0.5, fused=False, round_moments=rounded)
    assert torch.equal(staging, master.bfloat16())
    for piece, weight, state, near, near_state in zip(adam.pieces[0], fused, fused_state, plain, plain_state):
        ours = adam.optimizers[0].state[piece]
        assert ours["step"].item() == 4 and ours["exp_avg"].dtype == state_dtype
        assert torch.equal(piece.detach(), weight)
        assert all(torch.equal(ours[key].float(), state[key]) for key in ("exp_avg", "exp_avg_sq"))
        # the non-fused reference rounds lerp and addcdiv otherwise: a few float32 ulps apart after four steps. With
        # bfloat16 moments such a difference sometimes lands on the other side of a bfloat16 rounding boundary: a
        # moment one bfloat16 ulp (2**-8) apart moves the weight by up to about 2**-7 x lr a step
        if rounded:
            torch.testing.assert_close(piece.detach(), near, rtol=0, atol=4 * LR * 2**-7)
        else:
            torch.testing.assert_close(piece.detach(), near, rtol=1e-6, atol=1e-7)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours[key], near_state[key], rtol=1e-6, atol=1e-9)


@needs_compiler
@pytest.mark.parametrize("staging_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_native_threads_and_spans_give_the_bits_of_one_whole_pass_and_the_staging_is_the_master_rounded(staging_dtype):
    """Several threads on contiguous ranges, and the tensor cut into spans, change no bit: the split is only where
    each element is computed, and the rounding of torch's scalar loop applies to the tensor's last elements only."""
    numel, generator = 300_007, torch.Generator().manual_seed(3)
    start, gradient = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator).bfloat16()
    results = []
    for threads, cuts in ((1, []), (2, []), (3, [65_536 * 2 + 5, numel - 3])):
        state = [start.clone(), torch.zeros(numel), torch.zeros(numel), torch.empty(numel, dtype=staging_dtype)]
        for step in (1, 2):
            bounds = [0, *cuts, numel]
            for first, last in zip(bounds, bounds[1:]):
                tail, mode = adamw_kernel.scalar_tail(numel, first, last)
                p, m, v, staged = (t[first:last] for t in state)
                adamw_kernel.adamw_step(p, gradient[first:last], m, v, None, staged, step=step, lr=LR, beta1=BETAS[0],
                                        beta2=BETAS[1], eps=1e-8, weight_decay=0.1, tail=tail, tail_mode=mode,
                                        threads=threads)
        results.append(state)
    assert all(torch.equal(a, b) for result in results[1:] for a, b in zip(result, results[0]))
    assert torch.equal(results[0][3], results[0][0].to(staging_dtype))


def _fallback_update(tmp_path, monkeypatch, compiler: str) -> list[warnings.WarningMessage]:
    """Two updates with ``LIT_FSDP_CC=compiler`` and an empty kernel cache; the warnings they gave. They must equal
    torch's fused AdamW stepping the same tensors."""
    monkeypatch.setenv("LIT_FSDP_CC", compiler)
    monkeypatch.setenv("LIT_FSDP_KERNEL_CACHE", str(tmp_path / "kernels"))
    torch.manual_seed(0)
    adam, layout, master, params = _adam(torch.float32)
    gradients = [torch.randn(layout.shard_numel) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for gradient in gradients:
            adam.update(0, layout.local_views(gradient))
    adam.close()
    weights, _ = _reference_steps(params, gradients, 1.0, fused=True, round_moments=False)
    assert all(torch.equal(piece.detach(), weight) for piece, weight in zip(adam.pieces[0], weights))
    assert not list((tmp_path / "kernels").glob("*.so"))
    return [w for w in caught if "native CPU AdamW" in str(w.message)]


def test_without_a_compiler_the_update_falls_back_to_torch_with_one_warning_line(tmp_path, monkeypatch, fresh_kernel):
    caught = _fallback_update(tmp_path, monkeypatch, "/nonexistent/cc")
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "\n" not in message and "LIT_FSDP_CC=/nonexistent/cc is not an executable" in message
    assert "install gcc" in message


def test_a_failing_build_falls_back_to_torch_with_one_warning_line_quoting_the_compiler(tmp_path, monkeypatch,
                                                                                       fresh_kernel):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'broken-cc 1.0'\necho 'adamw_kernel.c:1: error: no such thing' >&2\nexit 1\n")
    broken.chmod(0o755)
    caught = _fallback_update(tmp_path, monkeypatch, str(broken))
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "adamw_kernel.c:1: error: no such thing" in str(caught[0].message)
    assert not list((tmp_path / "kernels").glob("*.tmp")), "the failed build left its partial file behind"


@needs_compiler
def test_ranks_building_at_once_share_one_whole_library_keyed_by_compiler(tmp_path, monkeypatch):
    """Builds racing into an empty cache (as ranks do) each rename a whole file into place: one library, loadable,
    no partial files; a build with another compiler (here a wrapper script around it) gets a name of its own."""
    monkeypatch.setenv("LIT_FSDP_KERNEL_CACHE", str(tmp_path))
    compiler = adamw_kernel.compiler()
    built: list = []
    racers = [threading.Thread(target=lambda: built.append(adamw_kernel.build(compiler))) for _ in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert len(set(built)) == 1 and list(tmp_path.iterdir()) == [built[0]]
    assert adamw_kernel.build(compiler) == built[0]  # cached: no build
    wrapper = tmp_path / "other-cc"
    wrapper.write_text(f'#!/bin/sh\nexec {compiler} "$@"\n')
    wrapper.chmod(0o755)
    assert adamw_kernel.library_path(str(wrapper)) != built[0]
    assert ctypes.CDLL(str(built[0])).lit_adamw_supported(1, 1, 1) == 1


@needs_compiler
def test_the_native_update_releases_the_gil():
    """A Python thread runs while an update of 16M parameters runs on one thread of its own: it sees the first weight
    written and the last not yet, which a call holding the GIL would never let it see (the kernel writes in order)."""
    numel = 16 * 2**20
    gradient, exp_avg, exp_avg_sq = torch.ones(numel).bfloat16(), *torch.zeros(2, numel, dtype=torch.bfloat16)
    assert adamw_kernel.supported(torch.zeros(numel), gradient, [exp_avg, exp_avg_sq], None)
    seen_inside = threading.Event()
    done = threading.Event()

    def watch(weights: torch.Tensor) -> None:
        while not done.is_set() and not seen_inside.is_set():
            if weights[0].item() != 0 and weights[-1].item() == 0:  # read in this order: started, and not yet ended
                seen_inside.set()

    for _ in range(3):  # a loaded machine may not schedule the watcher within one update
        weights = torch.zeros(numel)
        watcher = threading.Thread(target=watch, args=(weights,))
        done.clear()
        watcher.start()
        adamw_kernel.adamw_step(weights, gradient, exp_avg, exp_avg_sq, None, None, step=1, lr=LR, beta1=BETAS[0],
                                beta2=BETAS[1], eps=1e-8, weight_decay=0.1, threads=1)
        done.set()
        watcher.join()
        assert weights[-1].item() != 0
        if seen_inside.is_set():
            break
    assert seen_inside.is_set(), "no Python thread ran during three native updates: the call holds the GIL"
