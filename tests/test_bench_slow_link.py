"""scripts/bench_slow_link.py and its modules (slow_link, slow_link_runs, slow_link_table): the root check, the
teardown, how the two ranks are launched, and the table.

Tests that create real network namespaces run only as root with LIT_FSDP_NETNS_TESTS=1; the others
put fake ``ip`` and ``tc`` commands first on PATH, which log their arguments.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, cli_in_process

SCRIPT = REPO / "scripts" / "bench_slow_link.py"
sys.path.insert(0, str(SCRIPT.parent))  # the scripts import each other, as when run from their folder
import bench_slow_link as bench  # noqa: E402
import slow_link  # noqa: E402
import slow_link_runs  # noqa: E402
import slow_link_table  # noqa: E402
from repeats import in_turns  # noqa: E402

needs_netns = pytest.mark.skipif(
    not (os.geteuid() == 0 and os.environ.get("LIT_FSDP_NETNS_TESTS") == "1"),
    reason="creates network namespaces: needs root and LIT_FSDP_NETNS_TESTS=1",
)


def fake_iproute2(tmp_path: Path, fail_on: str | None = None, error: str = "Operation not permitted") -> Path:
    """``ip`` and ``tc`` that append their arguments to the returned log; ``fail_on`` makes a call fail."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    failing = f'case "$*" in "{fail_on}"*) echo "{error}" >&2; exit 1;; esac\n' if fail_on else ""
    for name in ("ip", "tc"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n{failing}exit 0\n')
        (bin_dir / name).chmod(0o755)
    log.touch()
    return log


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines()


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


def test_without_root_the_script_exits_with_one_line_naming_what_it_tried(tmp_path):
    log = fake_iproute2(tmp_path, fail_on="netns add")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rates", "1gbit", "--methods", "none", "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "needs root (CAP_NET_ADMIN" in lines[0] and "`ip netns add lit_fsdp-" in lines[0]
    assert "Operation not permitted" in lines[0]
    assert [c.split()[:3] for c in calls(log)] == [["ip", "netns", "add"]]  # nothing made, nothing to remove
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_a_leftover_namespace_is_named_and_not_deleted(tmp_path, monkeypatch):
    log = fake_iproute2(tmp_path, fail_on="netns add", error='Cannot create namespace file: File exists')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(slow_link.LinkError, match="lit_fsdp-t0-0 already exists .* `ip netns del lit_fsdp-t0-0`"):
        with slow_link.SlowLink("1gbit", tag="t0"):
            pass
    assert calls(log) == ["ip netns add lit_fsdp-t0-0"]


def test_a_failed_setup_removes_the_namespaces_it_had_created(tmp_path, monkeypatch):
    log = fake_iproute2(tmp_path, fail_on="link add")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(slow_link.LinkError, match="ip link add lfat1 type veth"):
        with slow_link.SlowLink("1gbit", tag="t1"):
            pass
    assert calls(log) == [
        "ip netns add lit_fsdp-t1-0", "ip netns add lit_fsdp-t1-1", "ip link add lfat1 type veth peer name lfbt1",
        "ip netns del lit_fsdp-t1-1", "ip netns del lit_fsdp-t1-0",
    ]


def test_teardown_runs_once_when_the_body_raises_and_shapes_both_ends(tmp_path, monkeypatch):
    log = fake_iproute2(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    link = slow_link.SlowLink("10gbit", tag="t2")
    with pytest.raises(RuntimeError, match="body"):
        with link:
            raise RuntimeError("body")
    link.close()  # a second teardown deletes nothing more
    made = calls(log)
    assert made[-2:] == ["ip netns del lit_fsdp-t2-1", "ip netns del lit_fsdp-t2-0"]
    assert sum("del" in c for c in made) == 2  # the veth goes with its namespace
    shaped = [c for c in made if c.startswith("tc ")]
    assert [c.split()[2] for c in shaped] == ["lit_fsdp-t2-0", "lit_fsdp-t2-1"]
    # 10 Gbit/s: the bucket holds a 250 Hz tick of traffic (5 MB), not the 128 KiB floor
    assert all("tbf rate 10gbit burst 5000000 latency 50ms" in c for c in shaped)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is restored


def launches(monkeypatch, cores: list[int], *extra: str) -> list[tuple[list[str], dict[str, str]]]:
    for inherited in ("RANK", "WORLD_SIZE", "SLURM_NTASKS"):  # e.g. a shell inside a cluster job
        monkeypatch.setenv(inherited, "8")
    link = slow_link.SlowLink("1gbit", tag="t3")
    args = bench.build_parser().parse_args(["--methods", "int8", *extra])
    fit_args = slow_link_runs.fit_arguments(args, "int8", Path("/tmp/callbacks.json"), Path("/tmp/run"))
    return [slow_link_runs.rank_launch(link, node, fit_args, 29501, cores) for node in (0, 1)]


def test_each_rank_runs_in_its_namespace_with_lightnings_multi_node_environment(monkeypatch):
    for node, (argv, env) in enumerate(launches(monkeypatch, [0, 1])):
        assert argv[:7] == ["ip", "netns", "exec", f"lit_fsdp-t3-{node}", "taskset", "-c", str(node)]
        assert argv[7:11] == [sys.executable, "-m", "lit_fsdp", "fit"]
        options = dict(zip(argv[11::2], argv[12::2]))
        assert options["--trainer.num_nodes"] == "2" and options["--trainer.devices"] == "1"
        assert options["--trainer.strategy.init_args.sharding"] == "NO_SHARD"
        assert str(REPO / "configs" / "int8.yaml") in argv
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["LOCAL_RANK"]) == ("10.210.0.1", "29501", "0")
        assert env["NODE_RANK"] == str(node) and env["GLOO_SOCKET_IFNAME"] == ("lfat3", "lfbt3")[node]
        assert env["OMP_NUM_THREADS"] == "1"
        assert not {"RANK", "WORLD_SIZE", "SLURM_NTASKS"} & set(env)


def test_ranks_get_disjoint_cores_and_as_many_threads(monkeypatch):
    (argv0, env0), (argv1, env1) = launches(monkeypatch, [0, 1, 2, 3], "--threads", "2")
    assert (argv0[6], argv1[6]) == ("0,1", "2,3")
    assert env0["OMP_NUM_THREADS"] == env1["OMP_NUM_THREADS"] == "2"


def test_the_cli_accepts_the_rank_arguments(tmp_path):
    args = bench.build_parser().parse_args(["--methods", "topk"])
    callbacks = slow_link_runs.write_callbacks(tmp_path / "callbacks.json", args.warmup, args.steps, profiler=True)
    fit_args = slow_link_runs.fit_arguments(args, "topk", callbacks, tmp_path / "run")
    printed = cli_in_process(*fit_args[2:], "--print_config", cwd=tmp_path).stdout
    assert "sharding: NO_SHARD" in printed and "num_nodes: 2" in printed and "method: topk" in printed
    assert "warmup_steps: 5" in printed and "class_path: callbacks.CommProfiler" in printed


def test_when_one_rank_fails_the_other_is_killed_at_once(tmp_path):
    pid_file = tmp_path / "pid"
    sleeper = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"]
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    start = time.monotonic()
    failing = (["sh", "-c", "sleep 1; echo boom; exit 3"], dict(os.environ))
    failure = slow_link_runs.run_ranks([failing, (sleeper, dict(os.environ))], logs, 60)
    assert failure == "rank0 exited 3: boom"
    assert time.monotonic() - start < 30
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_a_run_past_its_timeout_is_killed_and_reported(tmp_path):
    sleeper = (["sleep", "120"], dict(os.environ))
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    assert slow_link_runs.run_ranks([sleeper, sleeper], logs, 1) == "timed out after 1 s"


def test_the_profiler_records_exactly_the_timed_steps(tmp_path):
    written = slow_link_runs.write_callbacks(tmp_path / "callbacks.json", warmup=5, steps=14, profiler=True)
    callbacks = {c["class_path"]: c.get("init_args") for c in json.loads(written.read_text())["trainer"]["callbacks"]}
    assert callbacks["callbacks.Throughput"] == {"warmup_steps": 5}  # steps 5..13 are timed
    # steps 0-3 skipped, step 4 the profiler's own start-up, steps 5..13 recorded
    assert callbacks["callbacks.CommProfiler"] == {"wait": 4, "warmup": 1, "active": 9}


def test_rows_run_in_turns_one_repeat_after_another():
    rows = [("1gbit", "none"), ("1gbit", "int8")]
    assert in_turns(rows, 2) == [(0, rows[0]), (0, rows[1]), (1, rows[0]), (1, rows[1])]


def run(method: str, repeat: int, p50: float | None = None, **figures) -> dict:
    record = {"rate": "1gbit", "method": method, "repeat": repeat}
    return {**record, "failed": figures["failed"]} if "failed" in figures else {**record, "step_time_ms_p50": p50, **figures}


def test_the_table_gives_medians_ranges_and_speedup_from_the_medians():
    records = [
        run("none", 0, 1000.0, comm_time_ms_total=700.0, comm_ratio=0.70, compression_ratio=1.0),
        run("int8", 0, 400.0, comm_time_ms_total=None, comm_ratio=None, compression_ratio=3.98),
        run("topk", 0, failed="rank1 exited 1: boom | bang"),
        run("none", 1, 900.0, comm_time_ms_total=600.0, comm_ratio=0.66, compression_ratio=1.0),
        run("int8", 1, 500.0, comm_time_ms_total=200.0, comm_ratio=0.40, compression_ratio=3.98),
        run("topk", 1, failed="rank0 exited 1: later"),
        run("none", 2, 1200.0, comm_time_ms_total=650.0, comm_ratio=0.60, compression_ratio=1.0),
        run("int8", 2, 450.0, comm_time_ms_total=250.0, comm_ratio=0.50, compression_ratio=3.98),
        {"rate": "10gbit", "method": "none", "repeat": 0, "step_time_ms_p50": 500.0},
    ]
    header, _, *rows = slow_link_table.table(records, "1gbit").splitlines()
    assert header.count("|") == 9
    assert rows[0] == "| none | 3 of 3 | 1000 (900-1200) | 1.00x | 650 (600-700) | 66% (60%-70%) | 1.0x | n/a |"
    # 1000 / 450 from the medians; per repeat 1000/400, 900/500, 1200/450
    assert rows[1] == "| int8 | 3 of 3 | 450 (400-500) | 2.22x (1.80x-2.67x) | 225 (200-250) | 45% (40%-50%) | 4.0x | n/a |"
    assert rows[2] == "| topk | 0 of 2; failed: rank0 exited 1: later | n/a | n/a | n/a | n/a | n/a | n/a |"
    assert len(rows) == 3  # the other rate's run is not in this table


def test_a_single_repeat_prints_plain_figures_and_a_method_without_none_has_no_speedup():
    records = [run("int8", 0, 400.0, comm_time_ms_total=300.0, comm_ratio=0.5, compression_ratio=4.0)]
    row = slow_link_table.table(records, "1gbit").splitlines()[2]
    assert row == "| int8 | 1 of 1 | 400 | n/a | 300 | 50% | 4.0x | n/a |"


@needs_netns
def test_real_namespaces_are_removed_even_when_the_body_raises():
    link = slow_link.SlowLink("100mbit", tag=f"{os.getpid()}t")
    with pytest.raises(RuntimeError):
        with link:
            assert set(link.namespaces) <= namespaces()
            raise RuntimeError("body")
    assert not set(link.namespaces) & namespaces()
    assert subprocess.run(["ip", "link", "show", link.veths[0]], capture_output=True).returncode != 0


@needs_netns
def test_sigterm_removes_the_namespaces():
    tag = f"{os.getpid()}s"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; sys.path.insert(0, {str(SCRIPT.parent)!r}); import slow_link\n"
         f"with slow_link.SlowLink('1gbit', tag={tag!r}):\n    print('up', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "up"
    assert f"lit_fsdp-{tag}-0" in namespaces()
    holder.send_signal(signal.SIGTERM)
    assert holder.wait(timeout=30) == 128 + signal.SIGTERM
    assert not {f"lit_fsdp-{tag}-0", f"lit_fsdp-{tag}-1"} & namespaces()


@needs_netns
def test_the_link_runs_at_its_rate():
    with slow_link.SlowLink("200mbit", tag=f"{os.getpid()}r") as link:
        measured = slow_link.measure_rate(link, seconds=0.5)
    assert 0.15 < measured["measured_gbit_s"] < 0.21


def test_a_semi_synchronous_row_is_timed_by_its_mean_step_and_shows_the_hidden_share_of_its_exchange():
    records = [run("none", 0, 900.0, step_time_ms_mean=1000.0, compression_ratio=1.0),
               run("diloco_streaming", 0, 100.0, step_time_ms_mean=125.0, compression_ratio=250.0, outer_syncs=6,
                   outer_hidden_share=0.9)]
    rows = slow_link_table.table(records, "1gbit", "mean").splitlines()
    assert rows[0].startswith("| method | runs | step ms mean |")
    assert rows[3] == "| diloco_streaming | 1 of 1 | 125 | 8.00x | n/a | n/a | 250.0x | 90% |"
