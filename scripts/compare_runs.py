"""Compare runs: a table of quality, speed and communication per method and world size, and plots: the command of
``lit_fsdp.commands.compare_runs``.

    python scripts/compare_runs.py runs/sweep                   # -> runs/sweep/comparison/
    python scripts/compare_runs.py --help
"""

from __future__ import annotations

from lit_fsdp.commands.compare_runs import main

if __name__ == "__main__":
    main()
