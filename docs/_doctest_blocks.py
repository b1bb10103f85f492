"""A griffe extension for the API reference: the docstrings' shared pieces
(`keras_attention/_docs.py`, which the classes fill in at import) are filled
in here too, as griffe reads the source; and the interpreter examples (`>>>`
lines and their output, as the package writes them under `Example:`) become
fenced `pycon` code blocks, instead of Markdown quotes."""

import importlib.util
import pathlib

import griffe

# Loaded from its file alone: importing the package would import Keras.
_DOCS_PATH = pathlib.Path(__file__).resolve().parents[1] / "keras_attention" / "_docs.py"
_spec = importlib.util.spec_from_file_location("_keras_attention_docs", _DOCS_PATH)
_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_docs)

PROMPTS = (">>>", "...")


def fence_examples(text):
    """`text` with each run of `>>>` lines (with their `...` continuations
    and output, up to a blank line) inside a fenced code block."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        block = []
        while i < len(lines) and lines[i].strip():
            block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].strip())
            i += 1
        out += [f"{indent}```pycon", *(f"{indent}{b}" for b in block), f"{indent}```"]
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fills the shared pieces of every docstring griffe loads and fences its
    examples."""

    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = _docs.fill(obj.docstring.value)
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_examples(obj.docstring.value)
