"""``python -m lit_fsdp tune``: the fastest strategy setting that fits, found by profiling real short trials.

``hardware`` (what the machine is), ``space`` (candidates and the knobs' values), ``memory`` (the
analytic filter), ``trials`` (a candidate as a ``fit`` subprocess), ``judge`` (bottlenecks from the
figures), ``coder`` (moves that address them), ``llm`` (an optional adviser), ``controller`` (budget,
no repeats, rejection), ``report`` (``best.yaml``, ``report.md``, the plot), ``command`` (the CLI).
"""
