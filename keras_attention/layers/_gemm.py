"""Projections as one GEMM with the bias inside it, where the backend has one.

Keras's `Dense` and `EinsumDense` compute `x @ kernel` and then add the bias
in a second pass; on torch, `torch.nn.functional.linear` adds it inside the
GEMM, and calling it directly also skips the layer-call machinery, which is
most of the cost of a small eager decoding step.
"""

import keras
from keras import ops


def linear(x, kernel, bias):
    """`x @ kernel + bias` in the input's dtype: `(..., D) x (D, N) -> (..., N)`."""
    kernel = ops.cast(kernel, x.dtype)
    bias = None if bias is None else ops.cast(bias, x.dtype)
    if keras.backend.backend() == "torch":
        import torch

        return torch.nn.functional.linear(x, kernel.T, bias)
    output = ops.matmul(x, kernel)
    return output if bias is None else ops.add(output, bias)


def takes_linear(dense):
    """Whether `dense` is better called as `linear`: on torch, with plain
    float kernels (no quantization, no LoRA)."""
    return (
        keras.backend.backend() == "torch"
        and dense.quantization_mode is None
        and not dense.lora_enabled
    )


def dense_call(dense, x):
    """`dense(x)` for a built `keras.layers.Dense` without activation; on
    torch one `linear` call."""
    if not takes_linear(dense):
        return dense(x)
    x = ops.convert_to_tensor(x, dense.compute_dtype)
    return linear(x, dense.kernel, dense.bias)
