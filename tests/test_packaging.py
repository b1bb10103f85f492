"""What a new user meets first: the distribution's name and metadata, the
README's install commands and its quick start, which must run where
TensorFlow cannot be imported (a JAX or torch install)."""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import keras
import numpy as np

import keras_attention
from harness import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
README = (ROOT / "README.md").read_text(encoding="utf-8")
# `keras-attention` on the package index is an unrelated project that also
# installs a `keras_attention` module.
TAKEN = "keras-attention"
NAME = "keras3-attention"


def _python_blocks(markdown, heading):
    section = markdown.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_distribution_name_is_not_the_taken_one():
    assert PYPROJECT["project"]["name"] == NAME
    # The extra that pulls the others names the distribution itself.
    assert all(r.startswith(f"{NAME}[") for r in PYPROJECT["project"]["optional-dependencies"]["all"])
    installs = re.findall(r"pip install (\S+)", README)
    assert f'"{NAME}[jax]"' in installs and f'"{NAME}[torch]"' in installs
    assert not any(re.match(rf'"?{TAKEN}\b', i) for i in installs), installs
    assert f"pip uninstall {TAKEN}" in README


def test_metadata_license_version_and_build_requirement():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert project["license-files"] == ["LICENSE"]
    # The SPDX string form of `license` needs setuptools 77.
    (requirement,) = PYPROJECT["build-system"]["requires"]
    assert re.fullmatch(r"setuptools>=(\d+)", requirement) and int(requirement.split(">=")[1]) >= 77
    # One source for the version: the package's `_version.py`.
    assert project["dynamic"] == ["version"] and "version" not in project
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "keras_attention._version.__version__"
    assert keras_attention.__version__ == keras_attention._version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", keras_attention.__version__)
    assert (ROOT / "keras_attention" / "py.typed").exists()
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["keras_attention"] == ["py.typed"]
    assert project["urls"] and project["classifiers"]
    assert (ROOT / "CHANGELOG.md").read_text().count(keras_attention.__version__) >= 1
    # The docs' tools come with `.[all]`, so that CI builds the docs.
    assert "docs" in project["optional-dependencies"]["all"][0]


def test_quick_start_runs_where_tensorflow_cannot_be_imported():
    """A JAX (or torch) install has no TensorFlow: the import and the quick
    start must not need it, and the README must say to set the backend."""
    assert "export KERAS_BACKEND=jax" in README
    numpy_block, tf_block = _python_blocks(README, "## Quick start")
    assert "tensorflow" not in numpy_block and "import tensorflow as tf" in tf_block
    backend = "torch" if keras.backend.backend() == "torch" else "jax"
    program = (
        "import sys\n"
        "sys.modules['tensorflow'] = None  # `import tensorflow` raises ImportError\n"
        "import keras_attention\n"
        + numpy_block
        + "assert keras.backend.backend() == sys.argv[1]\n"
        "assert 'tensorflow' not in sys.modules or sys.modules['tensorflow'] is None\n"
        "print('loss', model.history.history['loss'][-1])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program, backend], cwd=ROOT, capture_output=True, text=True,
        env=dict(os.environ, KERAS_BACKEND=backend), timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loss = float(result.stdout.strip().splitlines()[-1].split()[1])
    # The toy task is learnable: below the loss of predicting the base rate.
    assert loss < 0.6


def test_quick_start_tf_data_form_runs_on_the_current_backend():
    numpy_block, tf_block = _python_blocks(README, "## Quick start")
    namespace = {}
    exec(compile(numpy_block.replace("epochs=5", "epochs=1"), "README.md", "exec"), namespace)
    weights = [np.array(w) for w in namespace["model"].get_weights()]
    exec(compile(tf_block.replace("epochs=5", "epochs=1"), "README.md", "exec"), namespace)
    after = namespace["model"].get_weights()
    assert any(not np.allclose(a, b) for a, b in zip(weights, after))
    assert np.isfinite(namespace["model"].history.history["loss"][-1])


def test_public_functions_carry_type_hints():
    import inspect

    from keras_attention import losses, masking, scoring, visualization
    from keras_attention.models import GPT, Seq2SeqTransformer

    for function in (
        masking.causal_mask, masking.padding_mask, masking.merge_masks, masking.standardize_mask,
        scoring.get, losses.reinforce_loss, visualization.capture_attention,
        GPT.from_preset, GPT.compile, Seq2SeqTransformer.translate,
    ):
        signature = inspect.signature(function)
        assert signature.return_annotation is not inspect.Signature.empty, function
        for name, parameter in signature.parameters.items():
            if name not in ("self", "cls"):
                assert parameter.annotation is not inspect.Parameter.empty, (function, name)


# The methods of the public classes whose arguments must carry hints, where a
# class defines them (Keras's own, e.g. an inherited `__init__`, are Keras's).
HINTED_METHODS = (
    "__init__", "call", "generate", "fill_mask", "translate", "from_keras_hub", "from_preset",
    "save_to_preset", "generate_preprocess", "generate_postprocess",
)


def _public_callables():
    """`(name, function)` of every public constructor, model method and
    function of `layers`, `models` and `scoring` written in this package."""
    import importlib
    import inspect

    package = pathlib.Path(keras_attention.__file__).parent
    found = []
    for module_name in ("layers", "models", "scoring"):
        module = importlib.import_module(f"keras_attention.{module_name}")
        for name in module.__all__:
            if name == "TranslationPreprocessor" and importlib.util.find_spec("keras_hub") is None:
                continue  # needs KerasHub
            value = getattr(module, name)
            functions = (
                [(f"{name}.{m}", getattr(value, m)) for m in HINTED_METHODS if hasattr(value, m)]
                if inspect.isclass(value) else [(name, value)]
            )
            for label, function in functions:
                function = inspect.unwrap(getattr(function, "__func__", function))
                source = inspect.getsourcefile(function)
                if source and pathlib.Path(source).resolve().is_relative_to(package.resolve()):
                    found.append((f"{module_name}.{label}", function))
    return found


def test_public_constructors_and_methods_carry_type_hints():
    import inspect
    import typing

    functions = _public_callables()
    labels = {label for label, _ in functions}
    # The walk reaches what it must (a class whose constructor is Keras's,
    # as LayerNormalization's, is skipped).
    assert {
        "layers.MultiHeadAttention.__init__", "layers.MultiHeadAttention.call",
        "layers.TransformerDecoderBlock.call", "models.GPT.generate", "models.GPT.from_preset",
        "models.BertMaskedLM.fill_mask", "models.Seq2SeqTransformer.translate",
        "models.Seq2SeqTransformer.from_keras_hub", "scoring.Additive.__init__", "scoring.get",
    } <= labels
    missing = []
    for label, function in functions:
        for name, parameter in inspect.signature(function).parameters.items():
            if name not in ("self", "cls") and parameter.annotation is inspect.Parameter.empty:
                missing.append(f"{label}({name})")
        typing.get_type_hints(function)  # the hints name types that exist
    assert not missing, f"arguments without a type hint: {missing}"
