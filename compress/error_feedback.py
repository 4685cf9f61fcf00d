"""Error feedback: what compression dropped this step is added back to the next step's input."""

from __future__ import annotations

import torch

from compress.payload import Compressor, Payload


class Residuals:
    """What compression still owes the model, per chunk ``key``: its norm and memory are reported by CompressionStats."""

    residuals: dict[str, torch.Tensor]
    #: the dtype residuals are kept in between steps; they are added to and computed in float32
    residual_dtype: torch.dtype = torch.float32

    @property
    def residual_norm(self) -> float:
        """L2 norm of all residuals together (what is still owed to the model)."""
        if not self.residuals:
            return 0.0
        return float(torch.sqrt(sum(r.float().pow(2).sum() for r in self.residuals.values())))

    @property
    def memory_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's residuals, for checkpoints: a resumed run owes the model what the uninterrupted one would."""
        return {f"residual/{key}": value for key, value in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {key.removeprefix("residual/"): v.to(self.residual_dtype)
                          for key, v in state.items() if key.startswith("residual/")}


class ErrorFeedback(Residuals):
    """Wraps any compressor; keeps one residual per chunk ``key`` (Seide et al. 2014, Karimireddy et al. 2019).

    ``compress`` sends ``C(x + e)`` and keeps ``e' = x + e - D(C(x + e))``, so the residual plus what was
    sent always equals the corrected input. With ``residual_dtype=torch.bfloat16`` the residual is kept
    rounded to bfloat16 (half the memory: it is a whole model's gradient per rank); each step then loses at
    most its rounding, 2**-8 of the residual, elementwise.
    """

    def __init__(self, inner: Compressor, residual_dtype: torch.dtype = torch.float32):
        self.inner = inner
        self.residual_dtype = residual_dtype
        self.linear = inner.linear
        self.unbiased = False
        self.residuals: dict[str, torch.Tensor] = {}

    def compress(self, tensor: torch.Tensor, key: str, seed: int, kept: int | None = None) -> Payload:
        corrected = self._corrected(tensor, key)
        payload = self.inner.compress(corrected, key, seed, kept=kept) if kept is not None else self.inner.compress(corrected, key, seed)
        self.residuals[key] = (corrected - self.inner.decompress(payload)).to(self.residual_dtype)
        return payload

    def _corrected(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        residual = self.residuals.get(key)
        return tensor.float() if residual is None else tensor.float() + residual

    def decompress(self, payload: Payload) -> torch.Tensor:
        return self.inner.decompress(payload)

    @property
    def variable_size(self) -> bool:
        """Whether the inner compressor's payload size depends on the data (then so does this one's)."""
        return bool(getattr(self.inner, "variable_size", False))

    def kept_count(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """The inner compressor's count on the corrected input, the one ``compress`` will send."""
        return self.inner.kept_count(self._corrected(tensor, key), key)

    def layout(self, numel: int, kept: int):
        return self.inner.layout(numel, kept)

    def state_dict(self) -> dict[str, torch.Tensor]:
        inner = getattr(self.inner, "state_dict", None)
        return {**super().state_dict(), **({f"inner/{k}": v for k, v in inner().items()} if inner else {})}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        if hasattr(self.inner, "load_state_dict"):
            self.inner.load_state_dict({k.removeprefix("inner/"): v for k, v in state.items() if k.startswith("inner/")})
