"""The package version, read by `pyproject.toml` (setuptools' dynamic version)
and exported as `keras_attention.__version__`: its one source."""

__version__ = "0.1.0"
