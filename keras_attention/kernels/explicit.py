"""The explicit kernel: score -> mask -> normalize -> dropout -> weighted sum.

Shape legend: `...` any leading axes (batch, heads), `T` query length, `S` key
length, `Dq`/`Dk`/`Dv` query, key and value feature sizes.

The kernel that takes any scorer and any normalization, forms the weights
and drops them out; the fused kernels (`fused.py`, `blocked.py`) give the
same results for dot-product scores without forming the weights in memory.
Soft and hard attention differ only in the `normalize` function they pass.
Also here: the rules both kinds of kernel follow (`mask_fill_value`,
`sanitize_nonfinite`, `poison_outputs`), written once.
"""

import keras
import numpy as np
from keras import ops

from keras_attention import _validation
from keras_attention import backend
from keras_attention import masking

_HALF_DTYPES = ("float16", "bfloat16")


def softmax_dtype(dtype):
    """The dtype softmax runs in: float32 for half-precision inputs."""
    dtype = keras.backend.standardize_dtype(dtype)
    return "float32" if dtype in _HALF_DTYPES else dtype


def mask_fill_value(dtype):
    """A large negative, finite score for masked positions in `dtype`.

    Half of the dtype's largest magnitude: finite (so `x - max(x)` never meets
    `inf - inf`), and far below any real score.
    """
    dtype = keras.backend.standardize_dtype(dtype)
    largest = 3.3895e38 if dtype == "bfloat16" else float(np.finfo(dtype).max)
    return -0.5 * largest


def masked_softmax(scores, mask=None, axis=-1):
    """Softmax over `axis` that gives masked positions exactly zero weight.

    - masked positions get weight exactly 0, whatever their score (NaN and
      inf included: scores are replaced with `ops.where`, never added to);
    - a row whose positions are all masked gets weights exactly 0 (not the
      uniform distribution a plain softmax of equal fill values would give),
      and finite gradients;
    - float16 and bfloat16 scores are normalized in float32 and the weights
      cast back, so large scores cannot overflow.

    Args:
        scores: float tensor `(..., T, S)`.
        mask: optional boolean or integer mask broadcastable to `scores`,
            `True` (nonzero) = may attend.
        axis: the axis to normalize over. Defaults to the last.

    Returns:
        Weights of the shape and dtype of `scores`.

    Example:

    >>> import numpy as np
    >>> w = masked_softmax(np.zeros((2, 3), "float32"), np.array([[1, 1, 0], [0, 0, 0]]))
    >>> np.asarray(w)
    array([[0.5, 0.5, 0. ],
           [0. , 0. , 0. ]], dtype=float32)
    """
    scores = ops.convert_to_tensor(scores)
    out_dtype = keras.backend.standardize_dtype(scores.dtype)
    if "float" not in out_dtype:
        out_dtype = keras.backend.floatx()
    work_dtype = softmax_dtype(out_dtype)
    scores = ops.cast(scores, work_dtype)
    if mask is None:
        return ops.cast(_softmax(scores, axis), out_dtype)
    mask = masking.standardize_mask(mask, "mask", ranks=range(1, 9))
    fill = ops.convert_to_tensor(mask_fill_value(work_dtype), dtype=work_dtype)
    scores = ops.where(mask, scores, fill)
    weights = _softmax(scores, axis)
    weights = ops.where(mask, weights, ops.zeros_like(weights))
    return ops.cast(weights, out_dtype)


def _softmax(scores, axis):
    if scores.shape[axis] == 1:
        # A softmax over one position (one key: eagerly decoding the first
        # token reads one cache slot) is 1, or NaN for a non-finite score;
        # Keras's warns that it is likely a mistake.
        return ops.exp(ops.subtract(scores, scores))
    return ops.softmax(scores, axis=axis)


def nonfinite_positions(key, value):
    """`(..., S)`: True where the key or the value vector holds NaN or inf."""
    finite = ops.logical_and(
        ops.all(ops.isfinite(key), axis=-1), ops.all(ops.isfinite(value), axis=-1)
    )
    return ops.logical_not(finite)


def sanitize_nonfinite(key, value):
    """Zeros key/value positions holding NaN or inf; returns them and where.

    A masked position can hold NaN or inf (uninitialized padding, a poisoned
    cache slot, a later token hidden by the causal mask). `0 * NaN` is NaN,
    so zero weights alone would not stop it from reaching the outputs and
    gradients of the queries that may not see it. The positions are zeroed
    before use, and `poison_outputs` gives NaN back to exactly the queries
    that may attend to one of them, whose outputs would have been NaN.

    Returns:
        `(key, value, bad)` with `bad` `(..., S)`.
    """
    bad = nonfinite_positions(key, value)  # (..., S)
    key = ops.where(bad[..., None], ops.zeros_like(key), key)
    value = ops.where(bad[..., None], ops.zeros_like(value), value)
    return key, value, bad


def poison_outputs(output, sees_bad):
    """NaN where `sees_bad` (broadcastable to `output`), else `output`."""
    nan = ops.cast(float("nan"), output.dtype)
    return ops.where(sees_bad, nan, output)


def attention(
    query, key, value, scorer, mask=None, dropout=0.0, training=False, seed=None,
    normalize=masked_softmax,
):
    """Attention as a function: `normalize(scorer(q, K), mask) @ V`.

    The pipeline shared by every layer of the package:

    1. score: `scores = scorer(query, key)`, `(..., T, S)`;
    2. mask and normalize: `weights = normalize(scores, mask)` (by default
       `masked_softmax`: masked positions get weight exactly 0, fully masked
       rows are all zeros);
    3. dropout on the weights when `training` (rows stay zero where they were);
    4. weighted sum: `output = weights @ value`, `(..., T, Dv)`.

    Key and value positions holding NaN or inf are zeroed first, and only the
    queries that may attend to one of them get NaN outputs: NaN or inf stored
    at a masked position (padding, an unwritten cache slot, a later token
    under the causal mask) never reaches another output or a gradient.

    Args:
        query: `(..., T, Dq)`.
        key: `(..., S, Dk)`.
        value: `(..., S, Dv)`.
        scorer: a callable `scorer(query, key) -> (..., T, S)`, usually a
            layer of `keras_attention.scoring`.
        mask: optional boolean mask broadcastable to `(..., T, S)`,
            `True` = may attend.
        dropout: float in [0, 1), the rate of dropout on the weights.
        training: bool, dropout is applied only when true.
        seed: an int or a `keras.random.SeedGenerator` for dropout.
        normalize: `normalize(scores, mask) -> weights`; hard attention
            passes its own.

    Returns:
        `(output, weights)`: output `(..., T, Dv)` in the dtype of `value`,
        weights `(..., T, S)`.

    Example:

    >>> import numpy as np
    >>> from keras_attention import scoring
    >>> q = np.ones((1, 2, 4), "float32")
    >>> kv = np.arange(12, dtype="float32").reshape(1, 3, 4)
    >>> out, w = attention(q, kv, kv, scoring.DotProduct())
    >>> tuple(out.shape), tuple(w.shape)
    ((1, 2, 4), (1, 2, 3))
    """
    _validation.check_rate("dropout", dropout)
    # Where the backend can tell eagerly that nothing is non-finite (torch),
    # the guards are skipped: they are most of the kernel's elementwise work.
    bad = None
    if not backend.all_finite(key, value):
        key, value, bad = sanitize_nonfinite(key, value)  # bad: (..., S)
    scores = scorer(query, key)  # (..., T, S)
    weights = normalize(scores, mask)  # (..., T, S)
    if training and dropout > 0.0:
        weights = backend.dropout(weights, dropout, seed)
    weights = ops.cast(weights, value.dtype)
    output = ops.matmul(weights, value)  # (..., T, Dv)
    if bad is not None:
        visible = (
            bad[..., None, :] if mask is None else ops.logical_and(mask, bad[..., None, :])
        )
        output = poison_outputs(output, ops.any(visible, axis=-1, keepdims=True))  # (..., T, 1)
    return output, weights
