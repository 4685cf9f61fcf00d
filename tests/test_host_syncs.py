"""``callbacks.HostSyncs``: sync warnings counted per step by call site, other warnings untouched, the mode restored."""

from __future__ import annotations

import traceback
import warnings
from collections import Counter

import pytest
import torch

from callbacks.host_syncs import SYNC_MESSAGE, HostSyncs, call_site
from tests.helpers import REPO


@pytest.fixture
def modes(monkeypatch):
    """torch.cuda.set_sync_debug_mode's calls (a CPU build has no CUDA to set it on)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", calls.append)
    return calls


def _sync_here() -> None:
    warnings.warn(SYNC_MESSAGE, UserWarning)  # what CUDA raises in sync-debug mode, at the op that synchronises


def test_sync_warnings_are_counted_by_site_and_every_other_warning_is_shown_as_before(modes):
    syncs = HostSyncs(warmup_steps=0, steps=2)
    syncs.start()
    syncs._current = Counter()
    for _ in range(3):
        _sync_here()
    with pytest.warns(UserWarning, match="unrelated"):
        warnings.warn("unrelated", UserWarning)
    syncs.per_step.append(syncs._current)
    syncs._current = None
    syncs.stop()
    assert modes == ["warn", "default"]
    (site, count), = syncs.per_step[0].items()
    assert count == 3 and site.startswith("tests/test_host_syncs.py:") and site.endswith("(_sync_here)")
    summary = syncs.summary()
    assert summary["host_syncs_per_step"] == 3 and summary["host_syncs_steps"] == 1
    with warnings.catch_warnings(record=True) as shown:  # after stop, a sync warning is an ordinary warning again
        warnings.simplefilter("always")
        _sync_here()
    assert len(shown) == 1


def test_a_site_is_the_innermost_frame_of_lit_fsdp_code_else_the_innermost_other_frame():
    frame = lambda path, line, name: traceback.FrameSummary(str(path), line, name)  # noqa: E731
    torch_frame = frame("/usr/lib/python3/site-packages/torch/distributed/fsdp/_fully_shard.py", 10, "reduce")
    own = frame(REPO / "compress" / "communicator.py", 42, "screen")
    assert call_site([torch_frame, own]) == "compress/communicator.py:42 (screen)"
    assert call_site([own, torch_frame]) == ("compress/communicator.py:42 (screen) > "
                                             "torch/distributed/fsdp/_fully_shard.py:10 (reduce)")
    assert call_site([torch_frame]) == "torch/distributed/fsdp/_fully_shard.py:10 (reduce)"


def test_nothing_is_counted_on_a_cpu_run_and_bad_arguments_are_one_line(modes):
    syncs = HostSyncs(warmup_steps=0)
    module = torch.nn.Linear(1, 1)
    module.device = torch.device("cpu")
    syncs.on_train_batch_start(None, module, None, 0)
    assert modes == [] and syncs.summary() == {}
    with pytest.raises(ValueError, match=r"^HostSyncs warmup_steps=-1 must be >= 0 and steps=0 >= 1$"):
        HostSyncs(warmup_steps=-1, steps=0)
