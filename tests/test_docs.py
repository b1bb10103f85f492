"""The documentation: the guide's and the text page's code blocks run, in
order, on the current backend, and the site builds with warnings as errors
(`mkdocs build --strict`, the API reference from the docstrings)."""

import importlib.util
import re
import subprocess
import sys

import pytest

from harness import ROOT

DOCS = ROOT / "docs"


def _python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.DOTALL)


def _run_blocks(path):
    namespace = {"__name__": "docs"}
    blocks = _python_blocks(path)
    assert blocks, path
    for index, block in enumerate(blocks):
        exec(compile(block, f"{path.name}, code block {index + 1}", "exec"), namespace)
    return namespace


def test_guide_code_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the guide saves a picture where it runs
    text = (DOCS / "guide.md").read_text(encoding="utf-8")
    # The concepts in the order the guide promises.
    headings = re.findall(r"^## \d+\. (.+)$", text, re.MULTILINE)
    assert headings == [
        "Scoring functions", "Soft attention", "Hard attention", "Self-attention",
        "Multi-head attention", "Masks", "Encoder and decoder blocks",
        "Models: BERT, GPT, translation",
    ]
    namespace = _run_blocks(DOCS / "guide.md")
    history = namespace["history"].history["loss"]
    assert history[-1] < history[0]
    # The GPT's one block's maps, drawn one panel per head (and the colour bar).
    # (The model's name is "gpt" in a fresh process, "gpt_<n>" after other GPTs.)
    gpt_name = namespace["gpt"].name
    assert [name for name, _ in namespace["maps"]] == [f"{gpt_name}/decoder/block_0/self_attention"]
    assert len(namespace["figure"].axes) == 2 + 1
    assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_page_code_runs():
    pytest.importorskip("keras_hub")
    namespace = _run_blocks(DOCS / "text.md")
    assert namespace["text"].startswith("a b")
    # Two vocabularies: "un gato" is [7, 5] in the Spanish one.
    assert [int(i) for i in namespace["x"]["decoder_token_ids"][1][:5]] == [2, 7, 5, 3, 0]
    assert [int(i) for i in namespace["y"][1][:4]] == [7, 5, 3, 0]
    loaded = namespace["loaded"]
    assert loaded.preprocessor.get_config() == namespace["preprocessor"].get_config()


def test_docs_build_with_warnings_as_errors(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    models = (tmp_path / "site" / "api" / "models" / "index.html").read_text(encoding="utf-8")
    # The reference holds the docstrings, inherited text methods included.
    for anchor in ("keras_attention.models.GPT.generate", "keras_attention.models.GPT.from_preset",
                   "keras_attention.models.Seq2SeqTransformer.translate"):
        assert f'id="{anchor}"' in models, anchor
    layers = (tmp_path / "site" / "api" / "layers" / "index.html").read_text(encoding="utf-8")
    assert 'id="keras_attention.layers.MultiHeadAttention"' in layers
    # The docstrings' `>>>` examples render as code (docs/_doctest_blocks.py).
    assert '<span class="gp">&gt;&gt;&gt; </span>' in layers and "<blockquote>" not in layers
    # The docstrings' shared pieces (keras_attention/_docs.py) are filled in.
    assert "{position_call_arguments}" not in layers and "{position_table_call_arguments}" not in layers
    assert "Overrides <code>start_index</code>" in layers
    assert (tmp_path / "site" / "guide" / "index.html").exists()
