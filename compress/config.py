"""Choosing a compression method in YAML: ``compression: {method: int8, num_bits: 8, error_feedback: false}``.

``METHODS`` is the one table of methods: their parameters with defaults, how to build them, how their gradients cross
ranks (their communicator) and what state they keep.
``python -m lit_fsdp compressors`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from compress.communicators import COMPRESSED, LOWRANK, ONEBIT_ADAM, POWERSGD, SKETCHED, Communicator
from compress.dgc import DeepGradientCompression
from compress.error_feedback import ErrorFeedback
from compress.lowrank import LowRank
from compress.onebit_momentum import OneBitMomentum, zero_one_momentum
from compress.payload import Compressor
from compress.powersgd import PowerSGD
from compress.quantize import FP8, QSGD, CastBF16, CastFP16, IntQuant, NaturalCompression, OneBit, SignSGD
from compress.sketched_sgd import SketchedSGD
from compress.sparseloco import SparseLoCo
from compress.sparsify import RandomK, Sparsified, ThresholdV, TopK


@dataclass(frozen=True)
class Method:
    """One compression method: what it does, its parameters with defaults, its constructor and its communicator."""

    summary: str
    defaults: dict[str, Any]
    build: Callable[..., Compressor]
    #: a biased method whose dropped part error feedback can carry to the next step
    feedback: bool = True
    #: the hooks that move its gradients (None: FSDP2's own, for ``none``)
    communicator: Communicator | None = COMPRESSED
    #: ``fits(n, **parameters)`` raises if a gradient chunk of ``n`` elements is too small for the parameters
    #: (None: any size fits)
    fits: Callable[..., None] | None = None
    #: its built-in state (what ``state_bytes`` counts) and how to do without it; None: error feedback's, if any
    kept_state: tuple[str, str] | None = None


METHODS: dict[str, Method] = {
    "none": Method("no hook: FSDP2's own reduce-scatter", {}, lambda: None, feedback=False, communicator=None),  # type: ignore[arg-type,return-value]
    "fp16": Method("cast to float16 for transport (native reduce-scatter)", {}, CastFP16),
    "bf16": Method("cast to bfloat16 for transport (native reduce-scatter)", {}, CastBF16),
    "fp8": Method("float8 e4m3 with an fp32 scale per chunk", {"chunk_size": 1024}, FP8),
    "int8": Method("symmetric integer quantisation, an fp32 scale per chunk", {"num_bits": 8, "chunk_size": 1024}, IntQuant),
    "qsgd": Method("stochastic quantisation to `levels` per chunk norm (unbiased)", {"levels": 16, "chunk_size": 1024}, QSGD, feedback=False),
    "natural": Method("stochastic rounding to powers of two (unbiased)", {}, NaturalCompression, feedback=False),
    "topk": Method(
        "the k largest magnitudes, cheaper of int32 or bitmap indices; DGC with momentum/clip_norm/warmup_steps",
        {"ratio": 0.01, "k": None, "momentum": 0.0, "clip_norm": None, "warmup_steps": 0}, TopK,
    ),
    "randomk": Method(
        "k shared-seed random coordinates, values only (native reduce-scatter)",
        {"ratio": 0.01, "k": None, "rescale": True}, RandomK,
    ),
    "thresholdv": Method(
        "coordinates with magnitude >= threshold; or density=: each chunk's threshold set so about that share is sent",
        {"threshold": 1e-3, "density": None}, ThresholdV,
    ),
    "sketch": Method(
        "Sketched-SGD in two rounds: summed count sketches pick candidates, their exact values follow; error feedback built in",
        {"ratio": 0.1, "rows": 5, "heavy_ratio": 0.01}, SketchedSGD, feedback=False, communicator=SKETCHED,
        kept_state=("Sketched-SGD's residuals", "use a method without built-in error feedback (e.g. int8)"),
    ),
    "lowrank": Method(
        "per-rank rank-r power iteration of reshaped chunks, MoE experts matrix by matrix (each rank its own factors)",
        {"rank": 4, "cols": None}, LowRank, communicator=LOWRANK,
        fits=lambda n, **parameters: LowRank(**parameters).check_fits(n),
    ),
    "powersgd": Method(
        "PowerSGD: rank-r per matrix, a Q shared by all ranks, P and Q summed natively, error feedback built in",
        {"rank": 4, "start_step": 10, "min_compression": 2.0}, PowerSGD, feedback=False, communicator=POWERSGD,
        kept_state=("PowerSGD's residuals and warm-start Qs", "use a method without built-in error feedback (e.g. int8)"),
    ),
    "sparseloco": Method(
        "SparseLoCo: top-k of every chunk of a decayed error-feedback accumulator, num_bits per kept value, "
        "log2(chunk_size)-bit positions (built in: its own error feedback)",
        {"chunk_size": 4096, "k": 64, "decay": 0.95, "num_bits": 2}, SparseLoCo, feedback=False,
        kept_state=("SparseLoCo's accumulators", "use a method without built-in error feedback (e.g. int8)"),
    ),
    "signsgd": Method("signs and one scale (mean magnitude) per chunk", {"chunk_size": 1024}, SignSGD),
    "onebit": Method("1-bit SGD: signs and per-chunk means of each sign", {"chunk_size": 1024}, OneBit),
    "onebit_adam": Method(
        "1-bit Adam (replaces AdamW): AdamW for freeze_step steps, then local momenta as signs and a scale per chunk, "
        "error feedback built in, variance frozen",
        {"freeze_step": 100, "chunk_size": 128, "bound": 1.0}, OneBitMomentum, feedback=False, communicator=ONEBIT_ADAM,
    ),
    "zero_one_adam": Method(
        "0/1 Adam (replaces AdamW): variance updated by exact rounds at doubling intervals until var_freeze_step, 1-bit "
        "momentum in between; then local rounds that send nothing and a 1-bit sync every 2, 4, ... local_step_clipper",
        {"chunk_size": 128, "var_freeze_step": 64, "var_update_scaler": 1, "local_step_scaler": 25,
         "local_step_clipper": 16, "bound": 1.0}, zero_one_momentum, feedback=False, communicator=ONEBIT_ADAM,
    ),
}
SPARSIFIERS = ("topk", "randomk", "thresholdv")
QUANTIZERS = ("fp16", "bf16", "fp8", "int8", "qsgd", "natural")
#: quantisers the parameter all-gather takes (deterministic: every rank must decode the same weights)
PARAM_GATHER_METHODS = ("int8", "fp8", "bf16", "fp16")
#: topk's Deep Gradient Compression options and their "off" values: they wrap topk, they do not build it
DGC_OPTIONS = {"momentum": 0.0, "clip_norm": None, "warmup_steps": 0}
_RANDOMISED = {"qsgd", "natural"}  # draw private random numbers: salted with the rank
#: what error feedback (and DGC's velocities) may be kept in between steps; the arithmetic is float32 either way
RESIDUAL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: methods whose own state holds a float32 residual per gradient element (error feedback built in)
_BUILT_IN_RESIDUAL = ("powersgd", "sketch", "sparseloco")
#: methods with built-in error feedback whose state follows residual_dtype (a residual and a local momentum)
_OWN_STATE_DTYPE = ("onebit_adam", "zero_one_adam")


@dataclass
class CompressionConfig:
    """Gradient compression for FSDP2 communication; unset parameters take the method's default."""

    method: str = "none"
    """none, fp16, bf16, fp8, int8, qsgd, natural, topk, randomk, thresholdv, sketch, lowrank, powersgd, sparseloco,
    signsgd, onebit, onebit_adam, zero_one_adam"""
    error_feedback: bool = False
    """carry what compression dropped into the next step (biased methods only)"""
    quantize: str | None = None
    """composite: quantise the values a sparsifier keeps with this method (fp16, bf16, fp8, int8, qsgd, natural)"""
    ratio: float | None = None
    """topk, randomk: share of coordinates kept; sketch: table size as a share of the gradient"""
    k: int | None = None
    """topk, randomk: number of coordinates kept (instead of ratio); sparseloco: kept per chunk"""
    decay: float | None = None
    """sparseloco: the error-feedback accumulator's decay (beta) before each call's input is added"""
    num_bits: int | None = None
    """int8: bits per value, 2 to 8; sparseloco: bits per kept value, 1 to 8"""
    chunk_size: int | None = None
    """fp8, int8, qsgd, signsgd, onebit, onebit_adam, zero_one_adam: elements sharing one scale; sparseloco: elements
    of which k are kept (257 to 65536)"""
    freeze_step: int | None = None
    """onebit_adam: AdamW steps, with uncompressed gradients, before the variance is frozen and momenta go as signs"""
    bound: float | None = None
    """onebit_adam, zero_one_adam: each coordinate's momentum over its frozen sqrt(v) is clipped to +-bound before it
    is sent (what bounds a step once v no longer follows the gradients; 0: off)"""
    var_freeze_step: int | None = None
    """zero_one_adam: the step from which the variance stays frozen and rounds go local"""
    var_update_scaler: int | None = None
    """zero_one_adam: exact (variance) rounds at each interval before the interval doubles"""
    local_step_scaler: int | None = None
    """zero_one_adam: rounds at each local interval before it doubles"""
    local_step_clipper: int | None = None
    """zero_one_adam: the longest interval between syncs (1: every round syncs, as NO_SHARD and HYBRID_SHARD need)"""
    levels: int | None = None
    """qsgd: quantisation levels"""
    rescale: bool | None = None
    """randomk: scale kept values by n/k so the estimate is unbiased"""
    threshold: float | None = None
    """thresholdv: keep coordinates with magnitude at least this"""
    density: float | None = None
    """thresholdv: instead of a threshold, the share of each chunk to send (its threshold follows the gradients' scale)"""
    rows: int | None = None
    """sketch: hash rows"""
    heavy_ratio: float | None = None
    """sketch: share of coordinates recovered as heavy hitters"""
    rank: int | None = None
    """lowrank, powersgd: rank of the approximation"""
    start_step: int | None = None
    """powersgd: uncompressed steps before PowerSGD starts"""
    min_compression: float | None = None
    """powersgd: compress a matrix only if it sends at least this many times fewer values"""
    cols: int | None = None
    """lowrank: columns of the matrix a gradient chunk is reshaped into (default about sqrt(n))"""
    param_all_gather: str | None = None
    """quantise the weights FSDP2 all-gathers for forward and backward (int8, fp8, bf16, fp16; ZeRO++'s qwZ);
    the sharded weights the optimizer updates stay exact"""
    momentum: float | None = None
    """topk (DGC): momentum correction, accumulate velocities and clear them where sent (0: off)"""
    clip_norm: float | None = None
    """topk (DGC): clip each chunk's local gradient to this L2 norm before it is accumulated"""
    warmup_steps: int | None = None
    """topk (DGC): steps from dense to the target ratio, exponentially (0: the target from the start)"""
    residual_dtype: str = "float32"
    """error feedback: dtype the residuals (and DGC's velocities, 1-bit Adam's local momenta) are kept in between
    steps, float32 or bfloat16 (half their memory, a whole model's worth per GPU; the arithmetic stays float32)"""

    def parameters(self) -> dict[str, Any]:
        """The method's parameters: its defaults, overridden by what was set."""
        method = self._method(self.method, "method")
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name in method.defaults}
        values = {**method.defaults, **{key: value for key, value in given.items() if value is not None}}
        if "ratio" in values and given.get("k") is not None and given.get("ratio") is None:
            values["ratio"] = None
        if "density" in values and given.get("density") is not None and given.get("threshold") is None:
            values["threshold"] = None
        return values

    def build(self, rank: int) -> Compressor | None:
        """The compressor on ``rank`` (None for ``none``), with error feedback and a quantiser if asked."""
        method = self._method(self.method, "method")
        # a composite's quantiser takes its own parameters (num_bits, chunk_size, levels) where the sparsifier has none
        quantizer = METHODS[self.quantize].defaults if self.quantize in METHODS else {}
        foreign = [
            f.name for f in fields(self)
            if f.name not in ("method", "error_feedback", "quantize", "param_all_gather", "residual_dtype")
            and f.name not in method.defaults and f.name not in quantizer
            and getattr(self, f.name) is not None
        ]
        if foreign:
            raise ValueError(f"compression parameter {foreign[0]} does not apply to method {self.method!r}; "
                             f"it takes {', '.join(method.defaults) or 'no parameters'}")
        residual_dtype = RESIDUAL_DTYPES[self._residual_dtype()]
        parameters = self.parameters()
        dgc = {name: parameters.pop(name) for name in DGC_OPTIONS if name in parameters}
        if self.method in _OWN_STATE_DTYPE:
            parameters["state_dtype"] = residual_dtype
        compressor = _build(self.method, parameters, rank)
        if self.quantize is not None:
            if self.method not in SPARSIFIERS or self.quantize not in QUANTIZERS:
                raise ValueError(f"quantize: {self.quantize!r} composes a sparsifier ({', '.join(SPARSIFIERS)}) with a "
                                 f"quantiser ({', '.join(QUANTIZERS)}); got method {self.method!r}")
            given = {name: getattr(self, name) for name in quantizer
                     if name not in method.defaults and getattr(self, name) is not None}
            compressor = Sparsified(compressor, _build(self.quantize, {**quantizer, **given}, rank))
        if self.error_feedback:
            if not method.feedback or (self.method == "randomk" and self.parameters()["rescale"]):
                built_in = "built with its own error feedback"
                kind = {"none": "no compression", **{name: built_in for name in (*_BUILT_IN_RESIDUAL, *_OWN_STATE_DTYPE)}
                        }.get(self.method, "unbiased")
                raise ValueError(f"error_feedback needs a biased method; {self.method!r} is {kind}: set error_feedback false")
            dgc_on = {name: value for name, value in dgc.items() if value != DGC_OPTIONS[name]}
            compressor = (DeepGradientCompression(compressor, **dgc, residual_dtype=residual_dtype) if dgc_on
                          else ErrorFeedback(compressor, residual_dtype=residual_dtype))
        elif any(value != DGC_OPTIONS[name] for name, value in dgc.items()):
            raise ValueError("topk: momentum, clip_norm and warmup_steps (DGC) accumulate what is not sent: "
                             "set error_feedback true")
        return compressor

    def param_codec(self) -> Compressor | None:
        """The quantiser of the parameter all-gather (None: FSDP2's own), at its method's defaults."""
        if self.param_all_gather is None:
            return None
        if self.param_all_gather not in PARAM_GATHER_METHODS:
            raise ValueError(f"param_all_gather: {self.param_all_gather!r} is not one of {', '.join(PARAM_GATHER_METHODS)} "
                             "(deterministic quantisers, so every rank decodes the same weights)")
        return _build(self.param_all_gather, METHODS[self.param_all_gather].defaults, rank=0)

    def state_bytes_per_param(self, rows: int) -> float:
        """Bytes this rank's compressor keeps from one step to the next per element of a gradient it compresses.

        The one place the tuner's memory estimate and the strategy's preflight read it from. Error feedback: a
        residual per element, 4 bytes (2 with ``residual_dtype: bfloat16``); DGC with momentum: a velocity as
        well (8, or 4); PowerSGD: a float32 residual and its warm-start Q, ``cols x rank`` per ``rows x cols``
        matrix (4 + 4 rank / rows, ``rows`` the smallest gradient matrix's: e.g. the hidden size); Sketched-SGD:
        a float32 residual (4); 1-bit Adam: a residual, a local momentum and a frozen denominator (12, or 6 in
        bfloat16); 0/1 Adam: the same and a period's accumulator (16, or 8); anything without error feedback: 0. lowrank's per-chunk Q (about 4 rank / sqrt(n)
        per element) is left out.
        """
        if self.method == "powersgd":
            return 4 + 4 * self.parameters()["rank"] / rows
        if self.method in ("sketch", "sparseloco"):
            return 4
        if self.method in _OWN_STATE_DTYPE:  # a residual, a local momentum, a frozen denominator (and an accumulator)
            return self._own_state_tensors() * RESIDUAL_DTYPES[self._residual_dtype()].itemsize
        if not self.error_feedback:
            return 0
        residual = RESIDUAL_DTYPES[self._residual_dtype()].itemsize
        return residual * (2 if self.parameters().get("momentum") else 1)

    def state_bytes(self, parameters: int, shard: int, replicas: int, rows: int) -> int:
        """Bytes one rank's compressor keeps between steps for a model of ``parameters`` on a ``replicas`` x ``shard`` mesh.

        The reduce-scatter hook (``shard`` > 1) compresses each unit's whole unsharded gradient, the world x
        shard input of the collective: every rank holds state for all ``parameters``, however many ranks share
        them. The replicate all-reduce hook (``replicas`` > 1: NO_SHARD, HYBRID_SHARD) compresses this rank's
        reduced shard: ``parameters / shard`` more.
        """
        if self.method == "none":
            return 0
        if self.method in _OWN_STATE_DTYPE:  # local momenta, residuals and denominators where gradients enter, residuals after
            residual = RESIDUAL_DTYPES[self._residual_dtype()].itemsize
            return int(self._own_state_tensors() * residual * parameters
                       + residual * (parameters // shard) * (shard > 1 and replicas > 1))
        elements = parameters * (shard > 1) + parameters // shard * (replicas > 1)
        return int(self.state_bytes_per_param(rows) * elements)

    def state_advice(self, option: str) -> tuple[str, str]:
        """What the state ``state_bytes`` counts is, and how to shrink it, for an error message; ``option`` is where
        this config is set (e.g. ``--trainer.strategy.init_args.compression``), its fields ``option.<field>``."""
        built_in = self._method(self.method, "method").kept_state
        if built_in is not None:
            return built_in
        halve = f"{option}.residual_dtype bfloat16 (halves them) or " if self.residual_dtype == "float32" else ""
        if self.method in _OWN_STATE_DTYPE:  # error feedback is the method itself: there is no switch to turn it off
            what = "1-bit Adam's residuals, local momenta and frozen denominators" + (
                " and 0/1 Adam's accumulators" if self.method == "zero_one_adam" else "")
            shrink = f"set {halve.removesuffix(' or ')} or " if halve else ""
            return what, f"{shrink}use a method without an optimizer of its own (e.g. int8)"
        what = "error-feedback residuals" + (" and DGC velocities" if self.parameters().get("momentum") else "")
        return what, f"set {halve}{option}.error_feedback false"

    @property
    def communicator(self) -> Communicator | None:
        """The hooks that move this method's gradients (None: FSDP2's own)."""
        return self._method(self.method, "method").communicator

    def size_check(self) -> Callable[[int], None] | None:
        """What raises if a gradient chunk of ``n`` elements is too small for this config (lowrank's rank larger than
        the chunk's matrix), so that it fails before the first step; None: any size fits."""
        fits = self._method(self.method, "method").fits
        if fits is None:
            return None
        parameters = self.parameters()
        return lambda n: fits(n, **parameters)

    def check_replicas(self, replicas: int) -> None:
        """0/1 Adam's local rounds need one owner per shard: refused where ``replicas`` > 1 hold each shard."""
        if self.method == "zero_one_adam" and self.parameters()["local_step_clipper"] > 1 and replicas > 1:
            raise ValueError(f"zero_one_adam: local rounds need one owner per shard, but {replicas} replicas share each "
                             "shard (NO_SHARD or HYBRID_SHARD); set local_step_clipper: 1, or shard with FULL_SHARD")

    def _own_state_tensors(self) -> int:
        """Unsharded tensors per gradient element 1-bit Adam's hooks keep (0/1 Adam adds the period's accumulator)."""
        return 4 if self.method == "zero_one_adam" and self.parameters()["local_step_clipper"] > 1 else 3

    def warmup(self) -> int:
        """Optimizer steps before the method reaches its steady state: 1-bit Adam's freeze, PowerSGD's start,
        DGC's density warm-up (0: from the first step). Ratios are also reported from then on."""
        parameters = self.parameters()
        if self.method == "onebit_adam":
            return parameters["freeze_step"]
        if self.method == "zero_one_adam":  # its first rounds are all exact; later exact rounds count as compressed ones
            return min(parameters["var_update_scaler"], parameters["var_freeze_step"])
        if self.method == "powersgd":
            return parameters["start_step"]
        return parameters.get("warmup_steps") or 0

    def _residual_dtype(self) -> str:
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"compression residual_dtype {self.residual_dtype!r} is not one of {', '.join(RESIDUAL_DTYPES)}")
        if self.residual_dtype != "float32" and not self.error_feedback and self.method not in _OWN_STATE_DTYPE:
            built_in = self.method in _BUILT_IN_RESIDUAL
            why = f"{self.method!r} keeps its built-in residuals in float32" if built_in else "error_feedback is false"
            raise ValueError(f"compression residual_dtype {self.residual_dtype} stores error-feedback residuals, but {why}; "
                             "set residual_dtype float32")
        return self.residual_dtype

    @property
    def active(self) -> bool:
        """Whether anything is compressed: the gradients or the parameter all-gather."""
        return self.method != "none" or self.param_all_gather is not None

    @staticmethod
    def _method(name: str, where: str) -> Method:
        if name not in METHODS:
            raise ValueError(f"unknown compression {where} {name!r}; choose one of {', '.join(METHODS)}")
        return METHODS[name]


def _build(name: str, parameters: dict[str, Any], rank: int) -> Compressor:
    """Method ``name`` with ``parameters``; methods with private randomness draw it salted by ``rank``."""
    compressor = METHODS[name].build(**parameters)
    if name in _RANDOMISED:
        compressor.salt = rank
    return compressor


def describe_methods() -> str:
    """A table of the methods, their parameters and defaults, for ``python -m lit_fsdp compressors``."""
    lines = [f"{'method':<13} {'parameters (defaults)':<45} what"]
    for name, method in METHODS.items():
        params = ", ".join(f"{k}={v}" for k, v in method.defaults.items()) or "-"
        lines.append(f"{name:<13} {params:<45} {method.summary}")
    lines.append("")
    lines.append("error_feedback: true for every method but none, qsgd, natural and rescaled randomk (unbiased) and "
                 "powersgd, sketch, onebit_adam and zero_one_adam (built in)")
    lines.append("topk with error_feedback: true and momentum, clip_norm or warmup_steps: Deep Gradient Compression")
    lines.append("residual_dtype: float32 | bfloat16 keeps error-feedback residuals (and DGC velocities, 1-bit Adam's "
                 "local momenta) in half the memory")
    lines.append("onebit_adam and zero_one_adam replace the model's AdamW (same parameter groups and learning-rate schedule)")
    lines.append(f"param_all_gather: {' | '.join(PARAM_GATHER_METHODS)} quantises FSDP2's parameter all-gather")
    lines.append(f"composite: a sparsifier ({', '.join(SPARSIFIERS)}) with quantize: {' | '.join(QUANTIZERS)}")
    return "\n".join(lines)
