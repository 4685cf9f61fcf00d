"""The application: the commands of ``python -m lit_fsdp`` (fit and validate, tune, estimate, export, generate,
evaluate) and the tools the scripts share (launch, sweep, compare_runs). It is the one layer that imports every
package: the core of lit_fsdp, compress, offload and callbacks (docs/architecture.md)."""
