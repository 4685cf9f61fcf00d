"""Methods x strategies x seeds x world sizes, one ``python -m lit_fsdp fit`` subprocess each: the command of ``lit_fsdp.commands.sweep``.

    python scripts/sweep.py --methods baseline int8 topk --seeds 1234 1235 --world-sizes 2 --trainer.max_steps 200
    python scripts/sweep.py --help
"""

from __future__ import annotations

import sys

from lit_fsdp.commands.sweep import main

if __name__ == "__main__":
    sys.exit(main())
