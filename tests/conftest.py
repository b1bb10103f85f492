"""Test configuration: one backend per run, chosen by `KERAS_BACKEND`."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import pytest  # noqa: E402


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {keras.backend.backend()}"


@pytest.fixture(autouse=True)
def _reset_dtype_policy():
    """Each test starts and ends with the float32 policy."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
