"""The `>>>` examples of the package's docstrings run on the running backend
and print what they show: an example a user copies works as written."""

import doctest
import importlib
import pathlib

import pytest

import keras_attention

PACKAGE = pathlib.Path(keras_attention.__file__).parent


def _examples():
    """A `pytest.param` of the doctest of every docstring with `>>>` lines,
    named after it; only modules whose text has examples are imported (the
    backend modules of other backends are not)."""
    finder = doctest.DocTestFinder()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>> " not in path.read_text(encoding="utf-8"):
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        try:
            module = importlib.import_module(name)
        except ImportError as error:  # an optional dependency (KerasHub) not installed
            skip = pytest.mark.skip(reason=str(error))
            found.append(pytest.param(None, marks=skip, id=name.removeprefix("keras_attention.")))
            continue
        for test in finder.find(module):
            if test.examples:
                found.append(pytest.param(test, id=test.name.removeprefix("keras_attention.")))
    return found


EXAMPLES = _examples()


def test_the_package_has_examples_to_run():
    # A change in how they are found cannot leave this module with nothing.
    assert len(EXAMPLES) >= 40
    assert "visualization.capture_attention" in [example.id for example in EXAMPLES]


@pytest.mark.parametrize("test", EXAMPLES)
def test_docstring_example_runs_as_shown(test):
    output = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test, out=output.append, clear_globs=True)
    assert result.failed == 0, "".join(output)
