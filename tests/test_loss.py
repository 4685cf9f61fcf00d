"""The chunked next-token loss: the plain loss's value and gradients, without a step's whole logits ever existing."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from compress.torch_compat import allocation_events
from lit_fsdp import loss as loss_module
from lit_fsdp.loss import IGNORE_INDEX, LossHead, chunked_linear_cross_entropy, loss_bytes
from lit_fsdp.model import CausalLM

TOKENS, HIDDEN, VOCAB = 37, 16, 101  # a chunk of 8 leaves a short last chunk


def _inputs(dtype, bias):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3).to(dtype).requires_grad_()
    bias_tensor = (torch.randn(VOCAB, generator=generator) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[[3, 11, 30]] = IGNORE_INDEX
    return hidden, weight, bias_tensor, labels


def _grads(loss, tensors):
    return torch.autograd.grad(loss * 1.7, [t for t in tensors if t is not None])  # a scale through backward


@pytest.mark.parametrize("dtype,bias,tolerance", [(torch.float32, True, 1e-6), (torch.float32, False, 1e-6),
                                                  (torch.bfloat16, False, 1e-2)])
@pytest.mark.parametrize("chunk", [1, 8, TOKENS, 1000])
def test_the_chunked_loss_has_the_plain_losss_value_and_gradients(dtype, bias, tolerance, chunk):
    hidden, weight, bias_tensor, labels = _inputs(dtype, bias)
    plain = F.cross_entropy(F.linear(hidden, weight, bias_tensor).float(), labels)
    chunked = chunked_linear_cross_entropy(hidden, weight, bias_tensor, labels, chunk)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=tolerance, atol=tolerance)
    for got, want in zip(_grads(chunked, (hidden, weight, bias_tensor)), _grads(plain, (hidden, weight, bias_tensor))):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tolerance * 10, atol=tolerance)


def test_every_label_ignored_gives_zero_loss_and_gradient_like_a_sum_over_nothing():
    hidden, weight, _, labels = _inputs(torch.float32, False)
    labels[:] = IGNORE_INDEX
    loss = chunked_linear_cross_entropy(hidden, weight, None, labels, 8)
    assert loss.item() == 0.0
    assert all(g.abs().max() == 0 for g in _grads(loss, (hidden, weight)))


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an aten op returns (CPU too): the loss's peak logits."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_a_models_training_step_never_makes_the_whole_logits_and_matches_the_plain_loss():
    overrides = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 512, "n_positions": 64}
    batch = {"input_ids": torch.randint(0, 512, (2, 48)), "labels": torch.randint(0, 512, (2, 48))}
    results = {}
    for chunk in (0, 16):
        module = CausalLM(preset="gpt2-tiny", config_overrides=overrides, loss_chunk_tokens=chunk)
        module.configure_model()
        module.model.to_empty(device="cpu")
        module.model.tie_weights()  # to_empty gives each use of a tied parameter its own tensor
        torch.manual_seed(0)
        module.model.apply(module.model._init_weights)
        with LargestTensor() as seen:
            loss = module._loss(batch)[0]
            loss.backward()
        results[chunk] = loss.detach(), {n: p.grad for n, p in module.model.named_parameters()}, seen.largest
        assert type(module.model.get_output_embeddings()).__name__ == ("LossHead" if chunk else "Linear")
    (plain, plain_grads, plain_largest), (chunked, chunked_grads, chunked_largest) = results[0], results[16]
    torch.testing.assert_close(chunked, plain)
    assert plain_grads.keys() == chunked_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(chunked_grads[name], plain_grads[name], msg=name)
    assert plain_largest >= 96 * 512  # the plain loss makes a step's logits (96 tokens x 512)
    assert chunked_largest < 96 * 512  # the chunked one never does: the embeddings (512 x 32) ...
    assert chunked_largest >= 16 * 512  # ... and one chunk's logits are its largest tensors
    assert module.model.get_output_embeddings()(torch.zeros(1, 32)).shape == (1, 512)  # logits outside targets()


def test_a_head_that_is_not_linear_and_a_negative_chunk_are_refused_with_the_option_to_change():
    with pytest.raises(TypeError, match="loss_chunk_tokens 0"):
        LossHead.convert(torch.nn.Embedding(3, 3), 8)
    with pytest.raises(ValueError, match="loss_chunk_tokens is -1"):
        CausalLM(loss_chunk_tokens=-1)


def test_loss_bytes_at_8b_fall_from_19_6_gib_plain_to_about_3_gib_chunked():
    gib = 2**30
    plain = loss_bytes(16_384, 128_256, 4096, 2, 0)  # Llama-3.1-8B, 16k tokens, bfloat16
    assert plain == 16_384 * 128_256 * 10 and round(plain / gib, 1) == 19.6
    chunked = loss_bytes(16_384, 128_256, 4096, 2, 1024)  # the default chunk
    assert chunked == 1024 * 128_256 * 8 + 16_384 * 4096 * 2 + 128_256 * 4096 * 4 and round(chunked / gib, 1) == 3.1
    assert loss_bytes(100, 10, 4, 4, 4096) == 100 * 10 * 8 + 100 * 4 * 4 + 10 * 4 * 4  # one chunk: the whole step


def _peak_bytes(step) -> int:
    """Most bytes live at once while ``step()`` runs, less those still live after it (its outputs: the gradients).

    Counted from the CPU allocator's own events, so temporaries made inside an op are seen too; scratch that a matmul
    allocates and frees within itself (oneDNN's reorders for bfloat16 on CPU; cuBLAS keeps one workspace per process)
    is left out.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    events = allocation_events(profiler)
    made_in = {}  # ptr -> (index of its allocation, the op that made it)
    scratch = set()
    for index, (_, ptr, size, op) in enumerate(events):
        if size > 0:
            made_in[ptr] = (index, op)
        elif ptr in made_in:
            made, maker = made_in.pop(ptr)
            if maker is not None and maker[1] in ("aten::mm", "aten::addmm") and maker == op:
                scratch.update((made, index))
    survivors = {index for index, _ in made_in.values()}
    live = peak = 0
    for index, (_, _, size, _) in enumerate(events):
        if index not in scratch and index not in survivors:
            live += size
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [8, 16, 1000])  # below the hidden size (16) a V x H temporary outgrows the logits
def test_the_chunked_losss_peak_memory_in_forward_and_backward_is_what_loss_bytes_counts(dtype, bias, chunk):
    hidden, weight, bias_tensor, labels = _inputs(dtype, bias)

    def step():
        chunked_linear_cross_entropy(hidden, weight, bias_tensor, labels, chunk).backward()

    peak = _peak_bytes(step)
    counted = loss_bytes(TOKENS, VOCAB, HIDDEN, dtype.itemsize, chunk, bias=bias)
    # Uncounted: four 0-d float32 tensors (the running total, the label count, a chunk's sum and its weight).
    assert counted <= peak <= counted + 16


def test_a_device_that_refuses_a_float32_out_addmm_falls_back_to_vocabulary_slices_once(monkeypatch):
    monkeypatch.setitem(loss_module._ADDMM_TO_FLOAT32, "cpu", True)  # CPU has no kernel for it: a real refusal
    hidden, weight, _, labels = _inputs(torch.bfloat16, False)
    plain = F.cross_entropy(F.linear(hidden, weight).float(), labels)
    chunked = chunked_linear_cross_entropy(hidden, weight, None, labels, 8)
    assert loss_module._ADDMM_TO_FLOAT32["cpu"] is False
    for got, want in zip(_grads(chunked, (hidden, weight)), _grads(plain, (hidden, weight))):
        torch.testing.assert_close(got, want, rtol=0.1, atol=1e-2)
