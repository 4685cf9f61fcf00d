"""``scripts/bench_peers.py``'s peers, shapes and arithmetic: what each peer keeps on the host per parameter, the
refusal of a peer whose state cannot fit, the most blocks every peer fits, and the markdown table of the records.

Nothing here starts a process or touches a device: the tests pin it without DeepSpeed or a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB = 2**30
#: Host memory a peer needs beside its per-parameter state: the process itself (Python, torch, the CUDA context),
#: the model's float32 build before the peer takes it over, the batches, pinned staging buffers.
HOST_RESERVE_GIB = 8
#: ``--layers auto`` sizes the state with DeepSpeed's own estimators' ``additional_buffer_factor`` (1.5 in
#: ``estimate_zero2_model_states_mem_needs`` and its ZeRO-3 twin): a shape picked to fit, not one at the edge.
AUTO_FACTOR = 1.5


@dataclass(frozen=True)
class Peer:
    """A row of the bench: what it runs (``--help`` and docs/benchmarks.md) and what it keeps whatever the batch."""

    what: str
    host_bytes_per_param: int = 0  # 0: no fixed host state the bench checks (SlideFSDP's preflight checks its own)
    host_state: str = ""  # what those bytes are, for the refusal's line
    device_bytes_per_param: int = 0  # weights that stay on the device (ZeRO-2's bfloat16 copy)
    needs_deepspeed: bool = False
    app: bool = False  # run through ``python -m lit_fsdp fit``, else by scripts/peers_worker.py under torchrun
    strategy: dict[str, Any] = field(default_factory=dict)  # the app's strategy knobs laid over the shipped config

    def host_gib(self, parameters: int) -> float | None:
        return self.host_bytes_per_param * parameters / GIB if self.host_bytes_per_param else None


FP32_STATE = "float32 master weights, AdamW's two float32 moments and float32 gradients"
PEERS: dict[str, Peer] = {
    "deepspeed_zero3_offload": Peer(
        "DeepSpeed ZeRO-3 with offload_param and offload_optimizer to the CPU (DeepSpeedCPUAdam), bf16",
        18, FP32_STATE + ", and the bfloat16 parameters (offload_param)", needs_deepspeed=True),
    "deepspeed_zero2_offload": Peer(
        "DeepSpeed ZeRO-2 with offload_optimizer to the CPU (DeepSpeedCPUAdam), bf16 weights on the device",
        16, FP32_STATE, device_bytes_per_param=2, needs_deepspeed=True),
    "fsdp2_cpu_offload": Peer(
        "FSDP2 fully_shard per block and root, CPUOffloadPolicy, bf16 compute and fp32 reduce; torch AdamW on the host",
        16, FP32_STATE),
    "lightning_fsdp_cpu_offload": Peer(
        "Lightning's FSDPStrategy(cpu_offload=True) (FSDP1, a decoder block per unit) in a Trainer, bf16-mixed",
        16, FP32_STATE),
    "slide_fsdp": Peer(
        "SlideFSDP: python -m lit_fsdp fit with configs/llama_8b_offload.yaml as shipped (the exact update: auto, "
        "hidden behind the next forward; bfloat16 moments)", app=True),
    "slide_fsdp_exact": Peer(
        "SlideFSDP with the synchronous update and float32 moments: the peers' AdamW, exact",
        app=True, strategy={"update": "synchronous", "optimizer_state_dtype": "float32"}),
}


def parameters(config: Any) -> int:
    """A Llama config's parameters: embeddings, every block's matrices and two norms, the final norm, and the head
    where it is not tied to the embeddings."""
    from lit_fsdp.flops import matmul_shape

    shape = matmul_shape(config)
    hidden = config.hidden_size
    embeddings = config.vocab_size * hidden
    head = 0 if config.tie_word_embeddings else shape.head_weights
    return embeddings + shape.layers * (shape.block_weights + 2 * hidden) + hidden + head


@dataclass(frozen=True)
class Shape:
    """A preset of lit_fsdp/presets.py with ``layers`` of its blocks."""

    preset: str
    layers: int
    parameters: int
    vocab_size: int
    config: Any

    @classmethod
    def of(cls, preset: str, layers: int | None) -> "Shape":
        from lit_fsdp.presets import build_config

        config = build_config(preset, {"num_hidden_layers": layers} if layers else None)
        return cls(preset, config.num_hidden_layers, parameters(config), config.vocab_size, config)

    def dims(self) -> dict[str, int]:
        """The shape as the record states it: blocks, widths, heads, vocabulary."""
        c = self.config
        return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
                "kv_heads": c.num_key_value_heads, "intermediate": c.intermediate_size, "vocab": c.vocab_size}

    def flops_per_token(self, seq_len: int) -> int:
        from lit_fsdp.flops import flops_per_token

        return flops_per_token(self.config, seq_len)

    def peak_tflops(self, device_name: str | None) -> float | None:
        """The device's dense bfloat16 peak (lit_fsdp.device_peaks); None for a device the table does not know."""
        import torch

        from lit_fsdp.device_peaks import peak_tflops

        return peak_tflops(device_name, torch.bfloat16) if device_name else None


def refusal(peer: Peer, parameters: int, host_gib: float, device_gib: float | None) -> str | None:
    """Why ``peer`` cannot hold ``parameters`` here, before it starts: its host state and ``HOST_RESERVE_GIB`` over
    ``host_gib``, or its device-resident weights over ``device_gib``; None where it may fit."""
    if peer.host_bytes_per_param:
        need = peer.host_bytes_per_param * parameters / GIB
        if need + HOST_RESERVE_GIB > host_gib:
            return (f"needs {need:.1f} GiB of host memory ({peer.host_bytes_per_param} B/param x {parameters / 1e9:.2f}e9 "
                    f"parameters: {peer.host_state}) and {HOST_RESERVE_GIB} GiB for the process, against "
                    f"{host_gib:.1f} GiB available; run fewer --layers or on a host with more memory")
    if peer.device_bytes_per_param and device_gib is not None:
        need = peer.device_bytes_per_param * parameters / GIB
        if need > device_gib:
            return (f"needs {need:.1f} GiB on the device ({peer.device_bytes_per_param} B/param x "
                    f"{parameters / 1e9:.2f}e9 bfloat16 weights) against its {device_gib:.1f} GiB; run fewer --layers")
    return None


def auto_layers(preset: str, peers: list[Peer], host_gib: float, device_gib: float | None) -> int | None:
    """The most blocks of ``preset`` whose state, sized ``AUTO_FACTOR`` over what each of ``peers`` keeps, every one
    of them fits; None where not even one block does."""
    full = Shape.of(preset, None).layers
    for layers in range(full, 0, -1):
        count = Shape.of(preset, layers).parameters
        if all(refusal(peer, int(count * AUTO_FACTOR), host_gib, device_gib) is None for peer in peers):
            return layers
    return None


def number(value: float | None, form: str) -> str:
    return "" if value is None else format(value, form)


def count(parameters: float) -> str:
    """``8.03B``, ``125k``: a parameter count for the table."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if parameters >= scale:
            return f"{parameters / scale:.3g}{unit}"
    return f"{parameters:.0f}"


def table(records: list[dict[str, Any]]) -> str:
    """A markdown row per record: status (the reason where it did not run), tokens/s and MFU after the warm-up,
    device peak, rank 0's host peak RSS, the steps measured and every step's time."""
    lines = ["| model | peer | status | tokens/s | MFU | device peak GiB | host peak RSS GiB | steps measured | "
             "every step's ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error') or ''}"
        times = r.get("step_times_ms") or []
        measured = (f"{r['steps_measured']} (first {r['warmup_steps_left_out']} left out)"
                    if r.get("steps_measured") is not None else "")
        cells = [f"{r['preset']} x{r['layers']} ({count(r['parameters'])})", r["peer"], status.replace("|", "/"),
                 number(r.get("tokens_per_s"), ",.0f"), number(r.get("mfu"), ".1%"),
                 number(r.get("device_peak_gib"), ".2f"), number(r.get("host_peak_rss_gib"), ".2f"), measured,
                 ", ".join(f"{t:.0f}" for t in times)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
