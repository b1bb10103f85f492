"""A griffe extension for the API reference: the docstrings' interpreter
examples (`>>>` lines and their output, as the package writes them under
`Example:`) become fenced `pycon` code blocks, instead of Markdown quotes."""

import griffe

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
    """Fences the examples of every docstring griffe loads."""

    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_examples(obj.docstring.value)
