"""SlideFSDP's native CPU AdamW (offload/adamw_kernel.c): torch's AdamW arithmetic in one pass, its fallback, its GIL,
its one build per host and the cache folder it loads from."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

from compress.layout import UnitLayout
from lit_fsdp.errors import OneLineError
from offload import adamw_kernel, cpu_adam

LR, BETAS = 1e-2, (0.9, 0.95)

needs_compiler = pytest.mark.skipif(adamw_kernel.compiler() is None, reason="no C compiler to build the kernel with")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
REPO = Path(__file__).resolve().parents[1]


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


def _counting_compiler(folder: Path, real: str | None) -> tuple[Path, Path]:
    """A compiler script that appends a line to its log file for every build (a call with ``-o``) and then builds with
    ``real`` after a second (so that builds racing to start overlap), or fails where ``real`` is None: its path, the log."""
    log, script = folder / "builds.log", folder / "counting-cc"
    build = f'sleep 1; exec {real} "$@"' if real else "exit 1"
    script.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo build >> {log}; {build};; esac\necho counting-cc 1.0\n')
    script.chmod(0o755)
    return script, log


_PREPARE_ON_GO = """
import sys, time
from pathlib import Path
from offload import adamw_kernel
Path(sys.argv[1]).touch()
while not Path(sys.argv[2]).exists():
    time.sleep(0.01)
print(adamw_kernel.prepare(rank=int(sys.argv[3])), adamw_kernel.library() is not None)
"""


@needs_compiler
def test_two_processes_preparing_at_once_into_an_empty_cache_build_once_and_both_load_that_build(tmp_path):
    """Two processes (two ranks of a host) call prepare together on an empty cache: one compiles while the other waits
    on the lock file, then both load the one library; the lock file and the partial build are gone."""
    cache = tmp_path / "kernels"
    script, log = _counting_compiler(tmp_path, adamw_kernel.compiler())
    env = {**os.environ, "LIT_FSDP_CC": str(script), "LIT_FSDP_KERNEL_CACHE": str(cache)}
    go, ready = tmp_path / "go", [tmp_path / f"ready{rank}" for rank in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", _PREPARE_ON_GO, str(ready[rank]), str(go), str(rank)], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        deadline = time.monotonic() + 300
        while not all(path.exists() for path in ready):  # both imported torch: start them together
            assert time.monotonic() < deadline and all(rank.poll() is None for rank in ranks), "a process did not start"
            time.sleep(0.05)
        go.touch()
        outputs = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], [err for _, err in outputs]
    assert [out.strip() for out, _ in outputs] == ["None True", "None True"], [err for _, err in outputs]
    assert log.read_text().splitlines() == ["build"], "each process compiled the kernel"
    assert [path.name for path in cache.iterdir()] == [adamw_kernel.library_path(str(script)).name]


@needs_compiler
def test_after_prepare_the_first_update_builds_nothing_and_runs_the_native_kernel(tmp_path, monkeypatch, fresh_kernel):
    monkeypatch.setenv("LIT_FSDP_KERNEL_CACHE", str(tmp_path))
    assert adamw_kernel.prepare(rank=0) is None
    monkeypatch.setattr(adamw_kernel, "build", lambda cc: pytest.fail("an update built the kernel"))
    monkeypatch.setattr(cpu_adam, "_fused_step_in_chunks", lambda *args: pytest.fail("an update ran torch's kernel"))
    adam, layout, _, _ = _adam(torch.float32)
    adam.update(0, layout.local_views(torch.randn(layout.shard_numel)))
    adam.close()


def _refused(monkeypatch, cache: Path, script: Path) -> str:
    """The error prepare raises with the kernel cache at ``cache`` and compiler ``script``: one line, raised again by the
    next call (nothing was loaded in its place)."""
    monkeypatch.setenv("LIT_FSDP_CC", str(script))
    monkeypatch.setenv("LIT_FSDP_KERNEL_CACHE", str(cache))
    for _ in range(2):
        with pytest.raises(adamw_kernel.CacheFolderError) as refused:
            adamw_kernel.prepare(rank=0)
    message = str(refused.value)
    assert isinstance(refused.value, OneLineError) and "\n" not in message
    return message


@pytest.mark.parametrize(("owner", "mode"), [pytest.param(65534, 0o700, marks=needs_root, id="another_users"),
                                             pytest.param(None, 0o770, id="group_writable"),
                                             pytest.param(None, 0o757, id="world_writable")])
def test_a_cache_folder_not_this_users_alone_is_refused_in_one_line_before_anything_is_built(tmp_path, monkeypatch,
                                                                                         fresh_kernel, owner, mode):
    cache = tmp_path / "kernels"
    cache.mkdir()
    cache.chmod(mode)
    if owner is not None:
        os.chown(cache, owner, owner)
    script, log = _counting_compiler(tmp_path, None)
    message = _refused(monkeypatch, cache, script)
    assert f"cache folder {cache} is " in message and f"mode {mode:o}" in message
    assert "LIT_FSDP_KERNEL_CACHE" in message and f"chmod go-w {cache}" in message
    assert (f"uid {owner}" in message) if owner is not None else ("writable by its group or others" in message)
    assert not log.exists(), "the kernel was built in a folder others can write"


@pytest.mark.parametrize(("owner", "mode"), [pytest.param(65534, 0o755, marks=needs_root, id="another_users"),
                                             pytest.param(None, 0o775, id="group_writable")])
def test_a_library_in_the_cache_not_this_users_alone_is_refused_before_it_is_loaded(tmp_path, monkeypatch,
                                                                                     fresh_kernel, owner, mode):
    """A file at the library's name that is not a library: loading it would fail (and fall back with a warning), so
    the refusal shows the check came first."""
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    script, _ = _counting_compiler(tmp_path, None)
    monkeypatch.setenv("LIT_FSDP_KERNEL_CACHE", str(cache))
    planted = adamw_kernel.library_path(str(script))
    planted.write_text("not a library")
    planted.chmod(mode)
    if owner is not None:
        os.chown(planted, owner, owner)
    message = _refused(monkeypatch, cache, script)
    assert f"library {planted} is " in message and f"rm {planted}" in message


def test_a_rank_that_falls_back_to_torchs_kernel_says_so_itself_naming_its_rank(tmp_path, monkeypatch, fresh_kernel):
    """Every rank warns of its own fallback (not rank 0 only): given its rank, or Lightning's rank of the process."""
    monkeypatch.setenv("LIT_FSDP_CC", "/nonexistent/cc")
    for given, lightnings in ((5, 0), (None, 3)):
        adamw_kernel.reset()
        monkeypatch.setattr(rank_zero_only, "rank", lightnings)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reason = adamw_kernel.prepare(rank=given)
            assert adamw_kernel.prepare(rank=given) == reason  # once: later calls give the outcome again, silently
        rank = lightnings if given is None else given
        assert reason == "LIT_FSDP_CC=/nonexistent/cc is not an executable"
        assert [str(w.message).split(":")[0] for w in caught] == [f"SlideFSDP rank {rank} on {socket.gethostname()}"]
        assert adamw_kernel.library() is None


def test_a_probe_matching_none_of_torchs_roundings_says_so_naming_its_rank(monkeypatch):
    monkeypatch.setattr(adamw_kernel, "_call", lambda *args, **kwargs: None)  # a kernel that computes nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert adamw_kernel._probe_tail(None, rank=2) == (8, 0)
    assert len(caught) == 1 and str(caught[0].message).startswith("SlideFSDP rank 2 on ")
    assert "matched none of torch's fused kernel's roundings" in str(caught[0].message)
