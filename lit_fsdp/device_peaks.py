"""Peak dense matmul throughput per GPU and dtype: the denominator of MFU.

TFLOPS (1e12 FLOP/s) per device, dense (NVIDIA's datasheets print tensor-core figures "with
sparsity", twice the dense rate; these are half of those). ``fp32`` is the CUDA-core rate that
float32 matmuls get at torch's default precision; ``tf32`` is what they get once TF32 is allowed.
Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM, PCIe and NVL columns), H200 datasheet (SXM
and NVL), GH200 Grace Hopper Superchip datasheet, A100 datasheet (SXM and PCIe share the dense peak).
"""

from __future__ import annotations

import torch

_H100_SXM = {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0}
_H100_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}

# First match wins (lower-case substrings of torch.cuda.get_device_name()): the more specific
# names come before the ones they contain ("gh200" and "h200 nvl" before "h200").
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("gh200", _H100_SXM),  # "NVIDIA GH200 480GB": the H100 SXM's tensor cores
    ("h200 nvl", _H100_NVL),
    ("h200", _H100_SXM),  # "NVIDIA H200": same compute as the H100 SXM, more and faster memory
    ("h100 nvl", _H100_NVL),
    ("h100 pcie", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0}),
    ("h100", _H100_SXM),  # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"
    ("a100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),  # no FP8 on Ampere
]

_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"}


def matmul_format(dtype: torch.dtype) -> str:
    """The table column a matmul in ``dtype`` runs at: bf16, fp16, fp8, tf32 or fp32."""
    if dtype == torch.float32:
        # torch.get_float32_matmul_precision() raises once the per-backend API has been used
        # (torch >= 2.9); the CUDA matmul setting reflects both APIs: "tf32" after
        # set_float32_matmul_precision("high"/"medium") or allow_tf32 = True, else IEEE fp32.
        return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else "fp32"
    if dtype not in _FORMATS:
        known = ", ".join(map(str, _FORMATS))
        raise ValueError(f"no peak FLOP/s column for dtype {dtype}; use torch.float32 or one of {known}")
    return _FORMATS[dtype]


def device_peaks(device_name: str) -> dict[str, float]:
    """The table's row for ``device_name``: dense peak TFLOPS by matmul format; empty if the table does not know it."""
    name = device_name.lower()
    return next((dict(peaks) for key, peaks in PEAK_TFLOPS if key in name), {})


def peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense peak TFLOPS of one ``device_name`` GPU for matmuls in ``dtype``; None if the table does not know it."""
    return device_peaks(device_name).get(matmul_format(dtype))
