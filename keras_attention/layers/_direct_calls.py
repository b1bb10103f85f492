"""Layer calls straight to `call` while a model decodes, where Keras's
per-call wrapper would add nothing.

Keras's `Layer.__call__` binds the arguments to the signature, converts and
casts the inputs, resolves the training flag and the masks, enters name and
autocast scopes and records the call. On a backend that runs a model
eagerly (torch) it does so at every call of every sublayer, and at the sizes
of a decoding step it costs more than the sublayer's arithmetic
(`benchmarks/gpt_speed.py`). Inside `inference()`, which the generation
core opens around an eager decoding loop (`Preferences.direct_calls`), a
layer of this package (`DirectCalls` among its bases) is called through its
own `call` when the wrapper would change nothing:

- the layer is built (no weights to create), its dtype policy is not mixed
  (no inputs to cast, no autocast scope), it records no activity loss and
  is not rematerialized, and it makes no Keras mask of its own
  (`mask_zero`);
- no argument is symbolic, a numpy array (to convert) or carries a Keras
  mask (none to propagate).

The code that runs is the layer's `call`, the one the wrapper would run: a
subclass's override takes effect either way. Anything else takes the
wrapper, as does every call outside `inference()` (training included).

Layers may also keep values that depend on no input between the calls of
one `inference()` (`memo`): the loop calls them once a token, with the same
constants (the rotary embeddings' angles of the positions so far).
"""

import contextlib
import threading

import keras
import numpy as np

_STATE = threading.local()


@contextlib.contextmanager
def inference():
    """Direct calls for the layers called inside, which run in inference."""
    previous = getattr(_STATE, "active", False), getattr(_STATE, "memos", None)
    _STATE.active, _STATE.memos = True, {}
    try:
        yield
    finally:
        _STATE.active, _STATE.memos = previous


def memo(key):
    """A dict that the layers calling with `key` (hashable) may fill and
    read again until the innermost `inference()` ends; None outside
    `inference()`. Only eager code runs inside (`Preferences.direct_calls`),
    so the values are concrete."""
    memos = getattr(_STATE, "memos", None)
    if memos is None:
        return None
    return memos.setdefault(key, {})


def _plain(value):
    return not (
        isinstance(value, (keras.KerasTensor, np.ndarray))
        or getattr(value, "_keras_mask", None) is not None
    )


class DirectCalls:
    """A mixin (first among a layer's bases) that calls `call` directly inside
    `inference()` where Keras's wrapper would add nothing (the module's
    docstring says when)."""

    def __call__(self, *args, **kwargs):
        if getattr(_STATE, "active", False) and self._wrapper_adds_nothing(args, kwargs):
            return self.call(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _wrapper_adds_nothing(self, args, kwargs):
        policy = self.dtype_policy
        return (
            self.built
            and policy.compute_dtype == policy.variable_dtype
            and self.activity_regularizer is None
            and getattr(self, "_remat_mode", None) is None
            and not getattr(self, "mask_zero", False)
            and all(map(_plain, args))
            and all(map(_plain, kwargs.values()))
        )
