"""Every example script checks its options before it imports Keras: a bad
value ends it at once, non-zero, with one line naming the option and the
value; `--help` answers without the heavy imports too.

The scripts run as `__main__` in a subprocess where `import keras` and
`import tensorflow` fail, so a check that came after the heavy imports would
show as an `ImportError` instead of the message.
"""

import json
import os
import subprocess
import sys
import zipfile

import keras
import pytest

import harness
from harness import ROOT

EXAMPLES = ROOT / "examples"

# The heavy modules are made unimportable, then the script runs as `__main__`.
RUNNER = (
    "import runpy, sys\n"
    "for name in ('keras', 'tensorflow', 'jax', 'torch', 'keras_hub'):\n"
    "    sys.modules[name] = None\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _python(code, *args, **environment):
    """Runs `python -c code args` from the repository root; `environment`
    overrides the variables (`None` removes one)."""
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    for name, value in environment.items():
        env.pop(name) if value is None else env.__setitem__(name, value)
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120,
    )


def _run_without_keras(script, *args):
    return _python(RUNNER, str(EXAMPLES / script), *args)


BAD = [
    ("demo/train.py", ["--tiny", "--steps", "0"], "--steps", "'0'"),
    ("demo/train.py", ["--tiny", "--steps", "-1"], "--steps", "'-1'"),
    ("demo/train.py", ["--steps", "many"], "--steps", "'many'"),
    ("demo/train.py", ["--backend", "foo"], "--backend", "'foo'"),
    ("gpt_lm/train.py", ["--tiny", "--steps", "-3"], "--steps", "'-3'"),
    ("gpt_lm/train.py", ["--eval-interval", "0"], "--eval-interval", "'0'"),
    ("gpt_lm/train.py", ["--learning-rate=-1e-3"], "--learning-rate", "'-1e-3'"),
    ("gpt_lm/train.py", ["--learning-rate", "nan"], "--learning-rate", "'nan'"),
    ("gpt_lm/train.py", ["--eval-batches", "0"], "--eval-batches", "'0'"),
    ("gpt_lm/train.py", ["--tokenizer", "words"], "--tokenizer", "'words'"),
    ("gpt_lm/train.py", ["--source", "no/such/file.txt"], "--source", "'no/such/file.txt'"),
    ("gpt_lm/train.py", ["--source", "examples"], "--source", "a folder"),
    ("gpt_lm/train.py", ["--mixed-precision", "float8"], "--mixed-precision", "'float8'"),
    ("gpt_lm/train.py", ["--config", "tpu"], "--config", "'tpu'"),
    ("gpt_lm/train.py", ["--distribute", "pipeline"], "--distribute", "'pipeline'"),
    ("gpt_lm/train.py", ["--backend", "foo"], "--backend", "'foo'"),
    ("gpt_lm/sample.py", ["--length", "-5"], "--length", "'-5'"),
    ("gpt_lm/sample.py", ["--length", "0"], "--length", "'0'"),
    ("gpt_lm/sample.py", ["--temperature", "0"], "--temperature", "'0'"),
    ("gpt_lm/sample.py", ["--top-k", "-1"], "--top-k", "'-1'"),
    ("gpt_lm/sample.py", ["--prompt", ""], "--prompt", "''"),
    ("gpt_lm/sample.py", ["--seed", "x"], "--seed", "'x'"),
    ("bert_mlm/train.py", ["--tiny", "--steps", "-3"], "--steps", "'-3'"),
    ("bert_mlm/train.py", ["--backend", "foo"], "--backend", "'foo'"),
    ("translation/train.py", ["--layout", "csv"], "--layout", "'csv'"),
    ("translation/train.py", ["--steps", "-3"], "--steps", "'-3'"),
    ("translation/translate.py", ["--num-beams", "0", "Hi."], "--num-beams", "'0'"),
    ("translation/translate.py", ["--length-penalty", "-1", "Hi."], "--length-penalty", "'-1'"),
    ("translation/translate.py", ["--sampling", "top_k", "Hi."], "--sampling", "'top_k'"),
    ("translation/translate.py", [""], "sentences", "''"),
    ("translation/translate.py", [], "sentences", "required"),
    ("bert_mlm/fill_mask.py", ["the cat sat"], "sentences", "'the cat sat'"),
    ("bert_mlm/fill_mask.py", ["--top-k", "0", "the [MASK] sat"], "--top-k", "'0'"),
    ("hard_attention/train.py", ["--steps", "-5"], "--steps", "'-5'"),
    ("hard_attention/train.py", ["--method", "argmax"], "--method", "'argmax'"),
]


@pytest.mark.parametrize(
    "script, args, option, value", BAD, ids=[f"{s}{' '.join(a)}" for s, a, _, _ in BAD]
)
def test_a_bad_option_is_one_line_naming_it_before_keras_loads(script, args, option, value):
    result = _run_without_keras(script, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    message = result.stderr.strip()
    assert "\n" not in message, message  # one line, no usage block, no traceback
    assert option in message and value in message, message
    assert message.startswith(f"{(EXAMPLES / script).name}: error: ")


@pytest.mark.parametrize(
    "script",
    ["demo/train.py", "gpt_lm/train.py", "gpt_lm/sample.py", "bert_mlm/train.py",
     "translation/train.py", "translation/translate.py", "hard_attention/train.py",
     "bert_mlm/fill_mask.py"],
)
def test_help_answers_before_keras_loads(script):
    result = _run_without_keras(script, "--help")
    assert result.returncode == 0, result.stderr
    assert "--backend" in result.stdout and result.stdout.startswith("usage:")


def _model_file(path, class_name):
    """A `.keras` archive whose config names `class_name` (all the scripts read
    before loading)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("config.json", json.dumps({"class_name": class_name, "config": {}}))


@pytest.mark.parametrize(
    "script, args, kind, expected",
    [
        ("translation/translate.py", ["Hi."], "GPT", "holds a GPT model, not a Seq2SeqTransformer"),
        ("gpt_lm/sample.py", [], "Seq2SeqTransformer", "holds a Seq2SeqTransformer model, not a GPT"),
        ("gpt_lm/sample.py", [], None, "holds no trained model (no model.keras)"),
        ("gpt_lm/sample.py", [], "corrupt", "is not a readable Keras model file"),
        ("translation/translate.py", ["Hi."], "missing", "does not exist"),
        ("bert_mlm/fill_mask.py", ["the [MASK]"], "GPT", "holds a GPT model, not a BertMaskedLM"),
    ],
)
def test_a_model_folder_of_the_wrong_kind_is_named(tmp_path, script, args, kind, expected):
    folder = tmp_path / "run"
    if kind == "corrupt":
        folder.mkdir()
        (folder / "model.keras").write_bytes(b"not a zip file")
    elif kind == "missing":
        pass
    elif kind is None:
        folder.mkdir()
    else:
        _model_file(folder / "model.keras", kind)
    result = _run_without_keras(script, "--output-dir", str(folder), *args)
    assert result.returncode == 1, result.stdout + result.stderr
    message = result.stderr.strip()
    assert "\n" not in message and expected in message and str(folder) in message, message
    assert "--output-dir" in message and "train.py" in message


def test_steps_not_a_multiple_of_the_interval_is_named(capsys):
    # Checked against the preset once the script's config exists (after the
    # imports): still one line naming both options and the value.
    common = harness.load_module(EXAMPLES / "common.py", "examples_common")
    gpt_train = harness.load_module(EXAMPLES / "gpt_lm" / "train.py", "gpt_lm_train_options")
    parser = gpt_train.build_parser()
    args = parser.parse_args(["--tiny", "--steps", "7"])
    with pytest.raises(SystemExit) as exit_info:
        common.config_from_args(parser, args, gpt_train.PRESETS, gpt_train.Config)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "error: argument --steps: must be a multiple of the evaluation interval "
        "(3, --eval-interval). Received: 7 (see --help)"
    )
    config = common.config_from_args(
        parser, parser.parse_args(["--tiny", "--steps", "9"]), gpt_train.PRESETS, gpt_train.Config
    )
    assert (config.steps, config.eval_interval) == (9, 3)


def test_backend_option_reaches_keras_and_tensorflow_says_nothing():
    """`--backend jax` picks JAX although TensorFlow (imported first, for
    the pipelines) imports Keras; TensorFlow's C++ start-up lines, written
    before its log level is read, do not reach the terminal."""
    code = (
        "import sys; sys.path.insert(0, 'examples'); import common\n"
        "parser = common.OptionParser(); common.backend_option(parser)\n"
        "common.select_backend(['--backend', 'jax'], parser=parser)\n"
        "import keras; print(keras.backend.backend(), 'tensorflow' in sys.modules)\n"
    )
    result = _python(code, KERAS_BACKEND=None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["jax", "True"]
    assert result.stderr == ""


def _fake_checkpoint(folder, step):
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "state.json").write_text(json.dumps({"step": step, "config": {}}))


def test_ctrl_c_says_how_to_resume_and_data_errors_are_one_line(tmp_path, monkeypatch, capsys):
    common = harness.load_module(EXAMPLES / "common.py", "examples_common_run")
    parser = common.training_parser("test", str(tmp_path / "run"))
    monkeypatch.setattr(sys, "argv", ["train.py", "--output-dir", str(tmp_path / "run")])

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        common.run(interrupted, parser, resumable=True)
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == (
        f"train.py: interrupted; no checkpoint in {tmp_path / 'run'} yet: run the same "
        "command to start again"
    )
    _fake_checkpoint(tmp_path / "run", 250)
    with pytest.raises(SystemExit):
        common.run(interrupted, parser, resumable=True)
    assert capsys.readouterr().err.strip() == (
        f"train.py: interrupted; the checkpoint in {tmp_path / 'run'} holds step 250: run "
        "the same command again to resume from it"
    )

    corrupt = tmp_path / "corpus.txt.gz"
    corrupt.write_bytes(b"\x1f\x8b" + b"\x00" * 20)  # a gzip header, then nothing valid

    def reads_the_corpus():
        common.load_text(corrupt)

    monkeypatch.setattr(sys, "argv", ["train.py", "--source", str(tmp_path / "run" / "checkpoint" / "state.json")])
    monkeypatch.delenv("EXAMPLES_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        common.run(reads_the_corpus, parser, resumable=True)
    message = str(exit_info.value.code)
    assert "\n" not in message and message.startswith("train.py: error (--source ")
    assert "EXAMPLES_TRACEBACK=1" in message
