"""Training through every row of the kernel table under XLA.

TensorFlow with `jit_compile=True` (what `compile()`'s "auto" picks on a
GPU) aborted the whole process (a failed check in XLA's
dynamic_dimension_inference.cc) training a model whose fused attention had
a mask and fewer than 32 queries: the NaN guard's `cond` held the gradient
of Keras's kernel, whose `tf.einsum` gradient XLA's bridge could not compile
with the dynamic batch size of a `tf.data` iterator. An abort would take the
test worker with it, so the training runs in a process of its own
(`tests/_xla_training_worker.py`), one per backend: XLA on TensorFlow and
JAX, torch's step uncompiled. Each of its models trains one step through
the rows of one table setting, every mask form, query lengths 1 to 64, and
must move the weights as the explicit kernel does uncompiled.
"""

import os
import pathlib
import subprocess
import sys

import keras
import pytest

BACKEND = keras.backend.backend()
WORKER = pathlib.Path(__file__).parent.parent / "_xla_training_worker.py"
ROOT = WORKER.parent.parent


@pytest.mark.long_run
def test_every_row_trains_compiled_with_every_mask_form():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, str(WORKER), BACKEND], env=env, capture_output=True, text=True,
        timeout=900,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "done", result.stdout
    reported = {line.split(":")[0] for line in lines[:-1]}
    assert reported == {"fused", "blocked", "chunked", "dropout"}, result.stdout
