"""The GPU check: one command that turns a short window on one GPU into measured figures, each beside its estimate.

    python scripts/gpu_check.py --out gpu_out                     # the default plan, within --budget seconds
    python scripts/gpu_check.py --out gpu_out --steps slide_fsdp  # other steps, or continue where a window stopped
    python scripts/gpu_check.py --out gpu_out --steps first_window --budget 540  # each path no GPU has run, once
    python scripts/gpu_check.py --device cpu --out /tmp/check     # tiny sizes, every step's code path (CI)

Each step runs in its own process group under its own deadline (the smaller of the step's and what is left of
the budget): a step that runs out of time is reported as ``timeout`` with what it recorded so far, and the
next one runs. The CPU mode runs every step in the runner's own process instead, under the budget alone, so that
the libraries a step imports (9 s on 2 cores) are imported once, not once per step. Every rate leaves out the first ``--warmup-steps`` optimizer steps of its run, and the records and
the tables say how many. Before every training run, ``estimate``'s JSON for its configs is written with the
probe's ``hardware.json``. Written under ``--out``, few files so a device window can bring them back:
``summary.json`` (every step's record), ``check.log`` (every step's output), ``hardware.json`` (the probe's
measured rates in the ``--tune.hardware`` format), ``estimate.json`` (every run's estimate, by run name), and two
short tables printed last: the training runs' rates, then the steps.

This file is the command line and the runner. The steps are rows of ``STEPS`` in ``gpu_steps.py``, the probe is
``gpu_probe.py``, a fit run and its record ``gpu_fit.py``, the files and tables ``gpu_report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

import gpu_fit
from gpu_fit import HOST_MEMORY_VARIABLE, ROOT, WARMUP_STEPS, WARMUP_VARIABLE, Record
from gpu_probe import versions
from gpu_report import bring_back, runs, runs_table, steps_table
from gpu_steps import PLAN, PLAN_BUDGET, PLANS, STEPS


def run_step(name: str, deadline: float, device: str, work: Path, log: Any) -> dict[str, Any]:
    """The step in a child process group, killed at ``deadline`` seconds; its record with status and time."""
    record_path = work / f"{name}.json"
    record_path.unlink(missing_ok=True)
    log.write(f"\n===== {name} (deadline {deadline:.0f} s) =====\n")
    log.flush()
    begin = time.perf_counter()
    child = subprocess.Popen([sys.executable, __file__, "--child", name, "--device", device, "--work", str(work)],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        rc = child.wait(timeout=deadline)
        status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        rc, status = None, "timeout"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    return {"step": name, "status": status, "rc": rc, "seconds": round(time.perf_counter() - begin, 1), **record}


def run_in_process(name: str, device: str, work: Path, log: Any) -> dict[str, Any]:
    """The step in this process (the CPU mode), its output in ``log``; its record with status and time."""
    (work / f"{name}.json").unlink(missing_ok=True)
    log.write(f"\n===== {name} (in the runner's process) =====\n")
    log.flush()
    begin = time.perf_counter()
    here = os.getcwd()
    os.chdir(ROOT)  # where a child runs: the configs' relative paths
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            rc = child_main(name, device, work)
        except Exception:  # the record keeps the reason, the log the traceback
            traceback.print_exc(file=log)
            rc = 1
        finally:
            os.chdir(here)
    log.flush()
    record = json.loads((work / f"{name}.json").read_text()) if (work / f"{name}.json").is_file() else {}
    return {"step": name, "status": "ok" if rc == 0 else "failed", "rc": rc,
            "seconds": round(time.perf_counter() - begin, 1), **record}


def child_main(name: str, device: str, work: Path) -> int:
    """One step in this process (``--child``): the checkout importable, its record kept whatever it raises."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    record = Record(work / f"{name}.json")
    try:
        STEPS[name].run(record, device, work)
    except Exception as error:  # the record keeps the reason; the runner goes on with the next step
        record.put(error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        raise
    return 0


def steps_help() -> str:
    """``--help``'s list of the steps: deadline, whether the default plan runs it, what it runs and records."""
    lines = ["steps (deadline on one H100; * in the default plan):"]
    for step in STEPS.values():
        head = f"  {step.name + ('*' if step.default else ''):<19}{step.deadline:>4} s  "
        lines.append(textwrap.fill(step.records, 118, initial_indent=head, subsequent_indent=" " * len(head)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=steps_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder for summary.json, check.log, hardware.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: the real check; cpu: tiny sizes (CI)")
    parser.add_argument("--steps", default=",".join(PLAN),
                        help=f"comma-separated, in order (default: {', '.join(PLAN)}), or a plan's name "
                             f"({', '.join(PLANS)}); of {', '.join(STEPS)}")
    parser.add_argument("--budget", type=float, default=float(PLAN_BUDGET),
                        help="seconds for all steps together (default: the default plan's deadlines added up)")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                        help="optimizer steps at the start of every training run left out of every rate")
    parser.add_argument("--host-memory-gb", type=float, default=120.0,
                        help="host memory SlideFSDP's preflight may count on (its host_memory_gb); the lent VM has 128 GiB")
    parser.add_argument("--work", type=Path, help="folder for the runs' own files (default: <out>/work)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child, args.device, args.work)
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps {args.warmup_steps}: must be 0 or more (optimizer steps left out of every rate)")
    steps = [name for s in args.steps.split(",") if s.strip() for name in PLANS.get(s.strip(), (s.strip(),))]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown step {unknown[0]!r}; steps are {', '.join(STEPS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda but torch sees no CUDA device; use --device cpu for the CPU mode")
    os.environ[HOST_MEMORY_VARIABLE] = str(args.host_memory_gb)
    os.environ[WARMUP_VARIABLE] = str(args.warmup_steps)
    print("versions:", ", ".join(f"{k} {v or 'missing'}" for k, v in versions().items()), flush=True)
    args.out = args.out.resolve()  # the CPU mode's steps run from the checkout
    args.out.mkdir(parents=True, exist_ok=True)
    work = (args.work or args.out / "work").resolve()
    work.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + args.budget
    records = []
    with open(args.out / "check.log", "a") as log:
        for name in steps:
            left = end - time.monotonic()
            if left < 5:
                records.append({"step": name, "status": "no_time", "rc": None, "seconds": 0.0})
                continue
            needed = next((r for r in records if r["step"] == STEPS[name].requires), None)
            if needed is not None and needed["status"] != "ok":
                records.append({"step": name, "status": "skipped", "rc": None, "seconds": 0.0,
                                "error": f"{needed['step']} did not pass ({needed['status']})"})
                continue
            if args.device == "cpu":
                gpu_fit.IN_PROCESS = True
                records.append(run_in_process(name, args.device, work, log))
            else:
                records.append(run_step(name, min(STEPS[name].deadline, left), args.device, work, log))
            bring_back(records, work, args.out)
            print(f"{name}: {records[-1]['status']} in {records[-1]['seconds']} s", flush=True)
    bring_back(records, work, args.out)
    if any("figures" in run for _, run in runs(records)):
        print(f"Training runs; every rate leaves out the first {args.warmup_steps} optimizer steps of its run:")
        print(runs_table(records))
    print(steps_table(records))
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
