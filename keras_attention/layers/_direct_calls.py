"""Layer calls straight to `call`, where Keras's per-call wrapper would add
nothing.

Keras's `Layer.__call__` binds the arguments to the signature, converts and
casts the inputs, resolves the training flag and the masks, enters name and
autocast scopes and records the call. On a backend that runs a model
eagerly (torch) it does so at every call of every sublayer, and at the sizes
of a decoding step or of a small model's training step it costs about as
much as the sublayer's arithmetic (`benchmarks/gpt_step_floor.py`,
`benchmarks/gpt_speed.py`). On such a backend (`Preferences.direct_calls`)
a layer of this package (`DirectCalls` among its bases) is called through
its own `call`:

- inside `inference()`, which the generation core opens around an eager
  decoding loop;
- inside the `call` of a built layer of this package that was itself
  called through the wrapper with `training=True` or `training=False`
  (a stack or a block in `fit`, `evaluate`, `predict`, or `model(x,
  training=...)`): the wrapper has resolved the flag and its scopes, and
  the layers below are passed that flag by name;

and only when the wrapper would change nothing:

- the layer is built (no weights to create), its dtype policy is not mixed
  (no inputs to cast, no autocast scope), it records no activity loss and
  is not rematerialized, and it makes no Keras mask of its own
  (`mask_zero`);
- no argument is symbolic, a numpy array (to convert) or carries a Keras
  mask (none to propagate);
- a layer whose `call` takes `training` is passed the flag in force by
  name (`training=True` in training; `False` or none in inference), which
  is what the wrapper would resolve.

The code that runs is the layer's `call`, the one the wrapper would run: a
subclass's override takes effect either way. Anything else takes the
wrapper.

Layers may also keep values that depend on no input between the calls of
one `inference()` (`memo`): the loop calls them once a token, with the same
constants (the rotary embeddings' angles of the positions so far).
"""

import contextlib
import functools
import inspect
import threading

import keras
import numpy as np

from keras_attention import backend

_STATE = threading.local()


@contextlib.contextmanager
def _scope(training, memos):
    previous = _training(), getattr(_STATE, "memos", None)
    _STATE.training, _STATE.memos = training, memos
    try:
        yield
    finally:
        _STATE.training, _STATE.memos = previous


def inference():
    """Direct calls for the layers called inside, which run in inference,
    with `memo`s."""
    return _scope(False, {})


def memo(key):
    """A dict that the layers calling with `key` (hashable) may fill and
    read again until the innermost `inference()` ends; None outside
    `inference()`. Only eager code runs inside (`Preferences.direct_calls`),
    so the values are concrete."""
    memos = getattr(_STATE, "memos", None)
    if memos is None:
        return None
    return memos.setdefault(key, {})


def _training():
    """The flag of the direct calls in force; None outside them."""
    return getattr(_STATE, "training", None)


def _plain(value):
    return not (
        isinstance(value, (keras.KerasTensor, np.ndarray))
        or getattr(value, "_keras_mask", None) is not None
    )


@functools.cache
def _takes_training(call):
    return "training" in inspect.signature(call).parameters


class DirectCalls:
    """A mixin (first among a layer's bases) that calls `call` directly where
    Keras's wrapper would add nothing (the module's docstring says when)."""

    def __call__(self, *args, **kwargs):
        training = _training()
        if training is not None and self._wrapper_adds_nothing(args, kwargs, training):
            return self.call(*args, **kwargs)
        flag = kwargs.get("training")
        if (
            training is None
            and (flag is True or flag is False)
            and self.built
            and backend.preferences().direct_calls
        ):
            with _scope(flag, None):
                return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _wrapper_adds_nothing(self, args, kwargs, training):
        policy = self.dtype_policy
        if _takes_training(type(self).call):
            flag = kwargs.get("training")
            if not (flag is True if training else flag is None or flag is False):
                return False
        return (
            self.built
            and policy.compute_dtype == policy.variable_dtype
            and self.activity_regularizer is None
            and getattr(self, "_remat_mode", None) is None
            and not getattr(self, "mask_zero", False)
            and all(map(_plain, args))
            and all(map(_plain, kwargs.values()))
        )
