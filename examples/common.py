"""What the examples share: backend choice, the corpus, characters, windows.

- `select_backend`: reads `--backend` from the command line into
  `KERAS_BACKEND`, for scripts to call before they import keras.
- `load_text`: the shipped tiny-shakespeare (`examples/data/`), a local file,
  or a URL downloaded once into a cache directory.
- `CharTokenizer`: one id per distinct character (nanoGPT's
  `shakespeare_char`), with a JSON form that checkpoints store.
- `split_ids`: the first 90% of the ids train, the last 10% validate.
- `train_batches`: endless random training windows; batch `k` is a pure
  function of `(seed, k)`, so a resumed run sees the batches an uninterrupted
  run would.
- `consecutive_windows`: the validation split in consecutive windows.
- `Ticker`, `progress_callback`: a progress line at least every N seconds
  while `model.fit` runs, and one per interval with the validation metrics.
- `training_parser`, `config_from_args`: the command line every training
  script shares (preset, `--tiny`, steps, output folder, data source,
  `--mixed-precision`, `--jit`, `--distribute`) and the config it makes.
- `begin`, `fit_in_intervals`: a run's first steps (backend, precision,
  seed, output folder) and `model.fit` one evaluation interval an epoch,
  with progress, checkpoints and a CSV log.
- `save_checkpoint`, `load_checkpoint`, `checkpoint_callback`, `resume`: an
  atomic checkpoint (weights with the optimizer state, the step, the config,
  and whatever else an example writes beside them, such as its vocabulary)
  that a run resumes from.

How the examples import it: each script is run as
`python examples/<name>/train.py`, which puts `examples/<name>/` first on
`sys.path`, so its top adds the parent folder as well before `import common`
(as does `gpt_lm/data.py`, so that it imports alike when loaded on its own):

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import common

    common.select_backend()
    import keras

A plain path entry keeps the examples runnable from a checkout without making
`examples/` a package or installing anything. This module imports neither
keras nor TensorFlow at import time (`select_backend` must run before keras
is imported); the functions that need them import them when called.
"""

import argparse
import dataclasses
import gzip
import json
import os
import pathlib
import shutil
import signal
import sys
import time

import numpy as np

BACKENDS = ("tensorflow", "jax", "torch")

DEFAULT_CORPUS = (
    pathlib.Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt.gz"
)

# Downloads go to the subfolder `load_text` used when it lived in gpt_lm, so
# corpora downloaded then are still found in the cache.
CACHE_SUBDIR = "gpt_lm"


# Backend.


def select_backend(argv=None, parser=None):
    """Sets `KERAS_BACKEND` from a `--backend` argument, before keras loads.

    Keras reads `KERAS_BACKEND` once, when it is first imported, so a script
    calls this before `import keras`. Given the script's `parser`, it first
    parses the whole command line with it, so that `--help` and every bad
    option (a one-line error naming the option and the value) end the
    script at once, before the seconds that importing Keras and its backend
    take. Accepts `--backend X` and `--backend=X`; without the argument
    `KERAS_BACKEND` is left as it is (Keras then defaults to TensorFlow).
    Also quiets TensorFlow's C++ start-up logs unless `TF_CPP_MIN_LOG_LEVEL`
    is set, which likewise must happen before TensorFlow is imported.

    Args:
        argv: the command-line arguments, without the program name (default
            `sys.argv[1:]`).
        parser: the script's `argparse` parser, or `None` to read
            `--backend` alone (a script passes its parser only when it runs
            as `__main__`, not when a test imports it).

    Returns:
        The backend named by `--backend`, or `None` if there is none.

    Raises:
        ValueError: if the value of `--backend` is not one of `BACKENDS`.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if parser is not None:
        parser.parse_args(argv)  # exits on --help or a bad option
    backend = None
    for i, arg in enumerate(argv):
        if arg == "--backend" and i + 1 < len(argv):
            backend = argv[i + 1]
        elif arg.startswith("--backend="):
            backend = arg.split("=", 1)[1]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if backend is None:
        # A bare trailing `--backend` is left to argparse, which reports it.
        if parser is not None:
            import_tensorflow_quietly()
        return None
    if backend not in BACKENDS:
        # Checked here: an unknown KERAS_BACKEND would fail inside
        # `import keras`, before argparse could name the argument.
        raise ValueError(
            f"`--backend` must be one of {', '.join(BACKENDS)}. "
            f"Received: --backend={backend!r}"
        )
    os.environ["KERAS_BACKEND"] = backend
    if parser is not None:
        # After KERAS_BACKEND is set: importing TensorFlow imports Keras.
        import_tensorflow_quietly()
    return backend


# Corpus.


def local_path(source, cache_dir=None, cache_subdir=CACHE_SUBDIR, default_name="corpus.txt"):
    """`source` as a local `pathlib.Path`: a path as it is; an `http(s)://` or
    `file://` URL downloaded once into `cache_dir/cache_subdir` (with
    `keras.utils.get_file`) and found there afterwards."""
    source = str(source)
    if "://" not in source:
        return pathlib.Path(source)
    import keras

    name = source.rstrip("/").rsplit("/", 1)[-1] or default_name
    if cache_dir is not None:
        # get_file falls back to /tmp/.keras for a directory it cannot
        # write, which includes one that does not exist yet.
        pathlib.Path(cache_dir).mkdir(parents=True, exist_ok=True)
    return pathlib.Path(
        keras.utils.get_file(
            fname=name, origin=source, cache_dir=cache_dir, cache_subdir=cache_subdir
        )
    )


def load_text(source=None, cache_dir=None):
    """The corpus as one string.

    Args:
        source: `None` for the shipped tiny-shakespeare; a path (`.gz` is
            decompressed); or an `http(s)://` or `file://` URL, downloaded
            once into `cache_dir` (with `keras.utils.get_file`) and read from
            there afterwards.
        cache_dir: where downloads are kept (default `~/.keras/datasets`),
            in its subfolder `CACHE_SUBDIR`.

    Returns:
        The text, decoded as UTF-8.

    Raises:
        ValueError: if `source` is a path that does not exist.
    """
    path = local_path(DEFAULT_CORPUS if source is None else source, cache_dir)
    if not path.exists():
        raise ValueError(f"`source` does not exist. Received: source={str(path)!r}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


# Characters.


class CharTokenizer:
    """Characters <-> ids, one id per distinct character of the text, sorted.

    Args:
        characters: the vocabulary; character `characters[i]` has id `i`.
    """

    kind = "char"

    def __init__(self, characters):
        self.characters = list(characters)
        self._ids = {c: i for i, c in enumerate(self.characters)}

    @classmethod
    def fit(cls, text):
        """The tokenizer of the distinct characters of `text`, in sorted order."""
        return cls(sorted(set(text)))

    @property
    def vocabulary_size(self):
        return len(self.characters)

    def encode(self, text):
        """The ids of the characters of `text`, a 1-D int32 array.

        Raises:
            ValueError: if `text` has a character outside the vocabulary.
        """
        unknown = set(text) - self._ids.keys()
        if unknown:
            raise ValueError(
                "`text` has characters outside the vocabulary. Received: "
                f"{sorted(unknown)[:10]}"
            )
        return np.array([self._ids[c] for c in text], dtype="int32")

    def decode(self, ids):
        """The text of the ids `ids` (any 1-D sequence of integers)."""
        return "".join(self.characters[int(i)] for i in ids)

    def to_json(self):
        """A JSON-serializable dict: `{"kind": "char", "characters": [...]}`.

        Checkpoints store this form, so it must keep loading with
        `from_json`.
        """
        return {"kind": self.kind, "characters": self.characters}

    @classmethod
    def from_json(cls, data):
        """The tokenizer of a `to_json` dict.

        Raises:
            ValueError: if `data` describes another kind of tokenizer.
        """
        if data.get("kind") != cls.kind:
            raise ValueError(
                f"`data` is not a {cls.kind!r} tokenizer. Received: "
                f"kind={data.get('kind')!r}"
            )
        return cls(data["characters"])


# Splits and windows.


def split_ids(ids, train_fraction=0.9):
    """The first `train_fraction` of `ids` trains, the rest validates.

    Returns:
        `(train, validation)`, consecutive slices of `ids`.
    """
    boundary = int(train_fraction * len(ids))
    return ids[:boundary], ids[boundary:]


def window_starts(num_starts, batch_size, seed, step):
    """The starts of training batch `step`'s windows, `(B,)` int64: a pure
    function of `(seed, step)` (numpy's PCG64 seeded by the pair), which
    both pipelines draw from."""
    rng = np.random.default_rng((seed, int(step)))
    return rng.integers(0, num_starts, batch_size)


def _check_windows(ids, context_length):
    num_starts = len(ids) - context_length  # the last start still has T + 1 ids
    if num_starts <= 0:
        raise ValueError(
            f"The training text must be longer than the context of {context_length} tokens: "
            f"give a longer text with --source. Received: {len(ids)} training tokens"
        )
    return num_starts


def window_batch(ids, context_length, batch_size, seed, step):
    """Training batch `step`: `(inputs, targets)`, int32 `(B, T)` each.

    Every window is `T + 1` consecutive ids from a random start
    (`window_starts`); the targets are the inputs shifted left by one, so
    position `t` learns to predict id `t + 1` from ids `0 .. t`.
    """
    num_starts = _check_windows(ids, context_length)
    starts = window_starts(num_starts, batch_size, seed, step)  # (B,)
    window = np.asarray(ids, "int32")[starts[:, None] + np.arange(context_length + 1)]
    return window[:, :-1], window[:, 1:]  # (B, T), (B, T)


def train_batches(ids, context_length, batch_size, seed, start_step=0, pipeline="tf.data",
                  num_batches=None):
    """Endless `(inputs, targets)` batches `(B, T)` of random windows.

    Batch `k` (counting from 0 at the first step of training) is
    `window_batch(..., step=k)`, so the batches made with `start_step=k`
    continue exactly where a run stopped at step `k`, whichever pipeline
    serves them.

    Args:
        ids: 1-D int32 array, the training ids.
        context_length: `T`, the window length.
        batch_size: `B`, windows per batch.
        seed: integer; the same seed gives the same batches.
        start_step: the index of the first batch.
        pipeline: `"tf.data"` or `"arrays"` (`keras.utils.PyDataset`,
            no TensorFlow needed).
        num_batches: how many batches the arrays pipeline holds (the
            training steps left); `tf.data`'s stream is endless.

    Returns:
        A `tf.data.Dataset` or a `keras.utils.PyDataset` of int32
        `(inputs, targets)` pairs.

    Raises:
        ValueError: if `ids` has no more than `context_length` ids.
    """
    _check_windows(ids, context_length)
    ids = np.asarray(ids, "int32")

    def batch(step):
        return window_batch(ids, context_length, batch_size, seed, step)

    if check_pipeline(pipeline) == "arrays":
        return array_batches(lambda i: batch(start_step + i), num_batches)
    import tensorflow as tf

    def draw(step):
        inputs, targets = tf.numpy_function(batch, [step], ("int32", "int32"))
        shape = (batch_size, context_length)
        return tf.ensure_shape(inputs, shape), tf.ensure_shape(targets, shape)

    return without_autotuning(
        tf.data.Dataset.range(start_step, 2**62)
        .map(draw, num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )


def without_autotuning(dataset):
    """`dataset` with tf.data's autotuning turned off.

    The autotuner runs in a thread that sleeps between its rounds, longer
    and longer (up to a minute) while the pipeline is steady, and deleting
    an iterator waits for that sleep to end. `fit` deletes its iterator
    when it returns, so a run with an autotuned pipeline could stop for up
    to a minute after its last step: 15 to 58 seconds in about half of the
    GPT example's runs on JAX and torch on a 2-core machine, and in 2 of 4
    trials of an iterator read for 50 s beside a torch computation (none in
    4 trials without the autotuner). With it off, `tf.data.AUTOTUNE`
    parallelism falls back to one call per CPU core; the examples' steps
    take far longer than their batches, so nothing waits on the pipeline.
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def consecutive_windows(ids, context_length, batch_size, max_windows=None, pipeline="tf.data"):
    """Consecutive non-overlapping windows covering `ids`, in order.

    Window `i` holds ids `i T .. (i + 1) T - 1` and its targets are the next
    `T` ids, each shifted by one; the ids after the last whole window (fewer
    than `T + 1`) are left out.

    Args:
        ids: 1-D numpy array, the validation ids.
        context_length: `T`, the window length.
        batch_size: windows per batch (the last batch may be smaller).
        max_windows: at most this many windows, the first ones (default:
            all of `ids`).

        pipeline: `"tf.data"` or `"arrays"`.

    Returns:
        A `tf.data.Dataset` or `keras.utils.PyDataset` of `(inputs,
        targets)` batches `(B, T)`.
    """
    num_windows = (len(ids) - 1) // context_length
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    length = num_windows * context_length
    inputs = ids[:length].reshape(num_windows, context_length)  # (N, T)
    targets = ids[1 : length + 1].reshape(num_windows, context_length)  # (N, T)
    return batched_arrays((inputs, targets), batch_size, pipeline)


def batched_arrays(arrays, batch_size, pipeline="tf.data"):
    """A tuple of arrays with the same first axis, in consecutive batches of
    `batch_size` rows (the last may be smaller), through `pipeline`."""
    rows = len(arrays[0])
    if check_pipeline(pipeline) == "arrays":
        def batch(i):
            return tuple(a[i * batch_size : (i + 1) * batch_size] for a in arrays)

        return array_batches(batch, -(-rows // batch_size))
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(tuple(arrays)).batch(batch_size)
    return without_autotuning(dataset)


# The pipelines: tf.data, or numpy arrays through `keras.utils.PyDataset`.

PIPELINES = ("tf.data", "arrays")


def tensorflow_installed():
    """Whether `import tensorflow` succeeds here."""
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


def check_pipeline(pipeline):
    """`pipeline` if it is one of `PIPELINES` that can run here."""
    if pipeline not in PIPELINES:
        raise ValueError(f"`pipeline` must be one of {PIPELINES}. Received: pipeline={pipeline!r}")
    return pipeline


def choose_pipeline(requested=None):
    """The data pipeline of a run: `requested` (`--pipeline`), or by
    default `tf.data` where TensorFlow is installed and the arrays
    (`keras.utils.PyDataset`) where it is not."""
    if requested is None:
        return "tf.data" if tensorflow_installed() else "arrays"
    check_pipeline(requested)
    if requested == "tf.data" and not tensorflow_installed():
        raise ValueError(
            "The tf.data pipeline needs TensorFlow, which does not import here; "
            "`--pipeline arrays` needs only numpy. Received: pipeline='tf.data'"
        )
    return requested


def numpy_batches(dataset):
    """The batches of a finite dataset of either pipeline, as numpy."""
    if hasattr(dataset, "as_numpy_iterator"):
        yield from dataset.as_numpy_iterator()
        return
    for index in range(dataset.num_batches):
        yield dataset[index]


def array_batches(batch, num_batches):
    """A `keras.utils.PyDataset` whose item `i` is `batch(i)` (numpy
    arrays), `num_batches` long (None: endless). Read in order, in the
    calling thread: the examples' batches take far less time than a step."""
    import keras

    class _array_batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=1, use_multiprocessing=False, max_queue_size=10)

        @property
        def num_batches(self):
            return num_batches

        def __getitem__(self, index):
            if num_batches is not None and not 0 <= index < num_batches:
                raise IndexError(f"batch {index} of {num_batches}")
            return batch(index)

    return _array_batches()


# Prepared data: lists of id lists as plain files.


def save_id_lists(path, named):
    """Writes `named`, a dict of names to lists of id lists (the token ids
    of each text), to the `.npz` file `path`: per name the ids end to end
    (`NAME_ids`, int32) and where each list starts (`NAME_offsets`)."""
    arrays = {}
    for name, lists in named.items():
        arrays[f"{name}_ids"] = np.array([i for ids in lists for i in ids], "int32")
        arrays[f"{name}_offsets"] = np.cumsum([0] + [len(ids) for ids in lists])
    np.savez_compressed(path, **arrays)


def load_id_lists(path):
    """What `save_id_lists` wrote to `path`: a dict of names to lists of id
    lists."""
    arrays = np.load(path)
    names = [key[: -len("_ids")] for key in arrays.files if key.endswith("_ids")]
    named = {}
    for name in names:
        flat, offsets = arrays[f"{name}_ids"], arrays[f"{name}_offsets"]
        named[name] = [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    return named


def check_prepared(directory, names):
    """`directory` as a `pathlib.Path` if it holds the files `names`, else
    a `ValueError` naming the missing ones."""
    directory = pathlib.Path(directory)
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise ValueError(
            f"`--data` must be a folder that `--prepare` wrote; {missing} missing. "
            f"Received: data={str(directory)!r}"
        )
    return directory


def check_prepared_settings(settings, expected, directory):
    """Raises a `ValueError` naming the first option whose value in the
    prepared `settings` differs from the run's `expected` (JSON values)."""
    expected = json.loads(json.dumps(expected))  # tuples as lists
    for name, value in expected.items():
        if settings.get(name) != value:
            raise ValueError(
                f"The data in {directory} was prepared with {name}={settings.get(name)!r}; "
                f"this run has {name}={value!r}. Prepare it again with this run's options. "
                f"Received: data={str(directory)!r}"
            )


def require_tensorflow_or_prepared(prepared):
    """Refuses a run that would tokenize (KerasHub's WordPiece needs
    TensorFlow) where TensorFlow does not import and no `--data` is given."""
    if prepared is None and not tensorflow_installed():
        raise ValueError(
            "Without TensorFlow (KerasHub's WordPiece needs it), training reads data "
            "that `--prepare DIR` wrote where TensorFlow is installed: pass `--data DIR`. "
            "Received: data=None"
        )


def add_prepare_options(parser):
    """`--prepare DIR` and `--data DIR`, for an example that tokenizes with
    KerasHub's WordPiece."""
    parser.add_argument(
        "--prepare", metavar="DIR",
        help="write the splits, vocabularies and token ids into DIR and stop "
        "(needs TensorFlow and tensorflow-text, for KerasHub's WordPiece)",
    )
    parser.add_argument(
        "--data", metavar="DIR",
        help="train on the data --prepare wrote into DIR (no TensorFlow needed)",
    )


# Progress.


class Ticker:
    """Says when `seconds` have passed since it last said so (or a reset)."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.last = time.perf_counter()

    def due(self):
        now = time.perf_counter()
        if now - self.last >= self.seconds:
            self.last = now
            return True
        return False

    def reset(self):
        self.last = time.perf_counter()


def _step(model):
    import keras

    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


def _metrics(logs, names):
    return ", ".join(f"{name} {float(logs[name]):.4f}" for name in names if name in logs)


def progress_callback(seconds, metrics=("loss", "accuracy")):
    """A callback for `model.fit` (one epoch = one evaluation interval) that
    prints `step N: loss .., accuracy .., M ms/step` at least every
    `seconds` while training, and at each epoch end the step, `metrics` and
    their `val_` values with the seconds the epoch took."""
    import keras

    # The hooks read the model through `callback.model`: on JAX that
    # property first brings the model's variables up to date.

    ticker = Ticker(seconds)
    state = {}

    def on_epoch_begin(epoch, logs=None):
        state.update(start=time.perf_counter(), first=_step(callback.model))

    def on_train_batch_end(batch, logs=None):
        if ticker.due():
            step = _step(callback.model)
            ms = 1e3 * (time.perf_counter() - state["start"]) / max(step - state["first"], 1)
            print(f"step {step}: {_metrics(logs, metrics)}, {ms:.0f} ms/step", flush=True)

    def on_epoch_end(epoch, logs=None):
        seconds = time.perf_counter() - state["start"]
        names = list(metrics) + [f"val_{name}" for name in metrics]
        print(
            f"step {_step(callback.model)}: {_metrics(logs, names)} ({seconds:.0f} s)",
            flush=True,
        )
        ticker.reset()

    callback = keras.callbacks.LambdaCallback(
        on_epoch_begin=on_epoch_begin,
        on_train_batch_end=on_train_batch_end,
        on_epoch_end=on_epoch_end,
    )
    return callback


# The command line.


class OptionParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line,
    `<script>: error: argument --steps: must be an integer >= 1. Received:
    '-3' (see --help)`, without the usage block above it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _integer(text, minimum):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= {minimum}. Received: {text!r}"
        )
    return value


def positive_int(text):
    """An argparse `type`: an integer >= 1 (steps, lengths, counts)."""
    return _integer(text, 1)


def non_negative_int(text):
    """An argparse `type`: an integer >= 0."""
    return _integer(text, 0)


def _real(text, minimum, inclusive):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not np.isfinite(value) or value < minimum or (
        value == minimum and not inclusive
    ):
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}. Received: {text!r}")
    return value


def positive_float(text):
    """An argparse `type`: a finite number > 0 (a learning rate, a temperature)."""
    return _real(text, 0.0, inclusive=False)


def non_negative_float(text):
    """An argparse `type`: a finite number >= 0 (a length penalty)."""
    return _real(text, 0.0, inclusive=True)


def rate(text):
    """An argparse `type`: a number in [0, 1) (a dropout rate)."""
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1). Received: {text!r}")
    return value


def source_path(text):
    """An argparse `type`: a URL (`scheme://...`, fetched later) or a path
    to a file that exists, is not empty, and (`.gz`) decompresses."""
    if "://" in text:
        return text
    path = pathlib.Path(text)
    if not path.is_file():
        problem = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise argparse.ArgumentTypeError(f"{problem}. Received: {text!r}")
    if path.stat().st_size == 0:
        raise argparse.ArgumentTypeError(f"is an empty file. Received: {text!r}")
    if path.suffix == ".gz":
        try:
            with gzip.open(path, "rb") as f:
                empty = not f.read(1)
        except (OSError, EOFError) as error:
            raise argparse.ArgumentTypeError(
                f"is not a readable gzip file ({error}). Received: {text!r}"
            ) from None
        if empty:
            raise argparse.ArgumentTypeError(f"decompresses to nothing. Received: {text!r}")
    return text


def import_tensorflow_quietly():
    """Imports TensorFlow (if installed) with the process's standard error
    silenced: its C++ start-up lines (oneDNN, CUDA) are written before
    `TF_CPP_MIN_LOG_LEVEL` is read, twice, also on runs whose backend is
    JAX or torch (the examples' `tf.data` pipelines import it). A
    TensorFlow that cannot be imported is left for the pipeline choice to
    report (the arrays pipeline does without it)."""
    import importlib.util

    if "tensorflow" in sys.modules or importlib.util.find_spec("tensorflow") is None:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            import tensorflow  # noqa: F401
    except ImportError:
        pass  # the arrays pipeline serves; a `tf.data` one says it needs TensorFlow
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run(main, parser=None, resumable=None):
    """Runs a script's `main()`: Ctrl-C ends it with a line that says how
    to resume (`resumable=True`: from the checkpoint in `--output-dir`, read
    through `parser`; `False`: a training run without checkpoints), and an error reading the data or an invalid value in it with
    one line naming it (`EXAMPLES_TRACEBACK=1` shows the traceback)."""
    import zipfile
    import zlib

    program = pathlib.Path(sys.argv[0]).name
    try:
        return main()
    except KeyboardInterrupt:
        message = f"{program}: interrupted"
        if resumable and parser is not None:
            output = parser.parse_args().output_dir
            found = load_checkpoint(output)
            if found is not None:
                message += (
                    f"; the checkpoint in {output} holds step {found[0]}: run the same "
                    "command again to resume from it"
                )
            else:
                message += f"; no checkpoint in {output} yet: run the same command to start again"
        elif resumable is False:
            message += " (this example keeps no checkpoint: run it again to start over)"
        print(message, file=sys.stderr)
        sys.exit(130)
    except (OSError, EOFError, zlib.error, zipfile.BadZipFile, UnicodeDecodeError, ValueError) as error:
        if os.environ.get("EXAMPLES_TRACEBACK"):
            raise
        source = getattr(parser.parse_args(), "source", None) if parser is not None else None
        where = f" (--source {source})" if source else ""
        sys.exit(
            f"{program}: error{where}: {type(error).__name__}: {error} "
            "(EXAMPLES_TRACEBACK=1 shows where)"
        )


def backend_option(parser):
    """Adds `--backend` (the choices `BACKENDS`) to `parser`."""
    parser.add_argument(
        "--backend", choices=BACKENDS,
        help="Keras backend (default: KERAS_BACKEND, else tensorflow)",
    )


def text_option(text):
    """An argparse `type`: text with at least one character."""
    if not text:
        raise argparse.ArgumentTypeError(f"must not be empty. Received: {text!r}")
    return text


def check_trained_model(folder, class_name, train_script, option="--output-dir"):
    """Exits with one line unless `folder` holds a `model.keras` of the
    model class `class_name` (read from the file's config, without loading
    Keras), naming `option`, the folder and what it holds instead; the
    message says which `train_script` writes such a folder."""
    import zipfile

    folder = pathlib.Path(folder)
    path = folder / "model.keras"
    error = f"{pathlib.Path(sys.argv[0]).name}: error:"
    hint = f"train one with `python {train_script} {option} {folder}`"
    if not folder.is_dir():
        sys.exit(f"{error} {option} {str(folder)!r} does not exist; {hint}")
    if not path.is_file():
        sys.exit(
            f"{error} {option} {str(folder)!r} holds no trained model (no model.keras); "
            f"{hint}, or wait for the run there to finish"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            found = json.loads(archive.read("config.json")).get("class_name")
    except (zipfile.BadZipFile, KeyError, ValueError) as problem:
        sys.exit(f"{error} {path} is not a readable Keras model file ({problem}); {hint}")
    if found != class_name:
        sys.exit(
            f"{error} {option} {str(folder)!r} holds a {found} model, not a {class_name}: "
            f"it was written by another example; {hint}"
        )


def training_parser(description, output_dir, source_help="corpus path or URL (default: shipped)"):
    """An `argparse` parser with the options every training script takes;
    a script adds its own, then calls `config_from_args`."""
    parser = OptionParser(description=description)
    parser.add_argument("--config", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--tiny", action="store_true", help="seconds, for tests")
    backend_option(parser)
    parser.add_argument("--steps", type=positive_int, help="training steps")
    parser.add_argument(
        "--eval-interval", type=positive_int, help="steps between evaluations and checkpoints"
    )
    parser.add_argument("--output-dir", default=output_dir)
    parser.add_argument("--fresh", action="store_true", help="ignore a checkpoint")
    parser.add_argument("--source", type=source_path, help=source_help)
    parser.add_argument("--cache-dir", help="where a downloaded source is kept")
    parser.add_argument(
        "--mixed-precision", nargs="?", const="bfloat16", choices=["bfloat16", "float16"],
        help="bfloat16 (the default when given alone) or float16 with loss scaling",
    )
    parser.add_argument("--jit", action="store_true", help="jit_compile=True")
    parser.add_argument(
        "--attention-dropout", type=rate,
        help="dropout on the attention weights alone (default: the preset's)",
    )
    parser.add_argument(
        "--pipeline", choices=PIPELINES,
        help="tf.data (the default where TensorFlow is installed) or arrays "
        "(numpy batches through keras.utils.PyDataset, no TensorFlow)",
    )
    parser.add_argument(
        "--distribute", choices=("data", "model"),
        help="data or model parallel over every device (examples/distribute.py)",
    )
    return parser


def config_from_args(parser, args, presets, config_class, options=()):
    """The preset `args` name (`tiny` with `--tiny`) as a `config_class`,
    with the shared options and those in `options` (attribute names) that the
    command line gives; `--steps` must be a whole number of evaluation
    intervals."""
    config = config_class(**presets["tiny" if args.tiny else args.config])
    shared = (
        "steps", "eval_interval", "source", "cache_dir", "mixed_precision", "attention_dropout"
    )
    for name in (*shared, *options):
        if getattr(args, name) is not None:
            setattr(config, name, getattr(args, name))
    if config.steps % config.eval_interval:
        parser.error(
            f"argument --steps: must be a multiple of the evaluation interval "
            f"({config.eval_interval}, --eval-interval). Received: {config.steps}"
        )
    return config


# A training run.


def begin(args, config):
    """What a training script does first: says the backend, sets the
    mixed-precision policy (under float16 `compile` adds Keras's dynamic loss
    scaling) and the seed, and makes `--output-dir`, which it returns."""
    import keras

    print(f"backend: {keras.backend.backend()}")
    if config.mixed_precision:
        keras.config.set_dtype_policy(f"mixed_{config.mixed_precision}")
    keras.utils.set_random_seed(config.seed)
    output = pathlib.Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    return output


def fit_in_intervals(model, config, datasets, output, start_step, save_extra=None):
    """`model.fit` from `start_step` to `config.steps`, one epoch an
    evaluation interval (validated on `datasets["validation_batches"]`),
    with the progress line, a checkpoint (`save_extra(folder)` adds to it)
    and a row of `output/log.csv` after each; prints what it trained and
    returns the seconds."""
    import keras

    start = time.perf_counter()
    if start_step < config.steps:
        model.fit(
            datasets["train_batches"],
            initial_epoch=start_step // config.eval_interval,
            epochs=config.steps // config.eval_interval,
            steps_per_epoch=config.eval_interval,
            validation_data=datasets["validation_batches"],
            callbacks=[
                progress_callback(config.progress_seconds),
                checkpoint_callback(output, config, save_extra),
                # The metrics of every interval, appended across resumes.
                keras.callbacks.CSVLogger(output / "log.csv", append=True),
            ],
            shuffle=False,  # the stream is shuffled already
            verbose=0,
        )
    seconds = time.perf_counter() - start
    print(trained_line(config.steps - start_step, seconds, config.steps, output), flush=True)
    return seconds


# Checkpoints.


def save_checkpoint(directory, model, step, config, save_extra=None):
    """Writes `directory/checkpoint/`: `model.weights.h5` (with the optimizer's
    moments and step counter, so a schedule continues), `seed_states.npz`
    (the dropout layers' random states, which Keras leaves out of the weights
    file: without them a resumed run would drop other units), `state.json` (the
    step and the config, a dataclass) and what `save_extra(folder)` writes
    (e.g. a vocabulary).

    Atomic: everything goes to `checkpoint.tmp/` first, which then replaces
    the previous checkpoint by renames, so a run killed while saving leaves a
    whole checkpoint (`checkpoint/`, or `checkpoint.old/` between the two
    renames).
    """
    directory = pathlib.Path(directory)
    final, tmp, old = (directory / n for n in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_weights(tmp / "model.weights.h5")
    _save_seed_states(model, tmp / "seed_states.npz")
    fault_point("weights written")
    if save_extra is not None:
        save_extra(tmp)
    state = {"step": step, "config": dataclasses.asdict(config)}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    fault_point("between the renames")
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _seed_states(model):
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


def _save_seed_states(model, path):
    import keras

    states = [keras.ops.convert_to_numpy(v) for v in _seed_states(model)]
    with open(path, "wb") as f:
        np.savez(f, *states)


def load_weights(model, folder):
    """Loads the weights, optimizer state and dropout random states that
    `save_checkpoint` wrote in `folder` into `model` (built and compiled as
    when it was saved)."""
    model.load_weights(pathlib.Path(folder) / "model.weights.h5")
    with np.load(pathlib.Path(folder) / "seed_states.npz") as saved:
        states = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    variables = _seed_states(model)
    if len(states) != len(variables):
        raise ValueError(
            f"The checkpoint in {folder} holds {len(states)} random states, the "
            f"model has {len(variables)}: it was written by another model."
        )
    for variable, state in zip(variables, states):
        variable.assign(state)


def load_checkpoint(directory):
    """`(step, config dict, folder)` of the checkpoint `save_checkpoint`
    wrote in `directory` (the folder holds `model.weights.h5` and the extra
    files), or `None` if there is none."""
    for name in ("checkpoint", "checkpoint.old"):
        path = pathlib.Path(directory) / name
        if (path / "state.json").exists():
            state = json.loads((path / "state.json").read_text())
            return state["step"], state["config"], path
    return None


def checkpoint_callback(directory, config, save_extra=None):
    """A callback for `model.fit` that calls `save_checkpoint` at the end of
    every epoch (evaluation interval)."""
    import keras

    def on_epoch_end(epoch, logs=None):
        model = callback.model  # synced (see `progress_callback`)
        save_checkpoint(directory, model, _step(model), config, save_extra)

    callback = keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end)
    return callback


# Resuming.

FAULT_ENV = "EXAMPLES_FAULT_POINT"
_fault_counts = {}


def fault_point(name):
    """Kills the process (SIGKILL, as an out-of-memory killer or a lost
    machine would) at the `n`-th pass through the point `name` when the
    environment says `EXAMPLES_FAULT_POINT=name:n`: the fault tests use it to
    interrupt a checkpoint mid-write."""
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    point, _, count = wanted.rpartition(":")
    if point != name:
        return
    _fault_counts[name] = _fault_counts.get(name, 0) + 1
    if _fault_counts[name] == int(count):
        os.kill(os.getpid(), signal.SIGKILL)


def check_resumed_config(saved, config, directory, honoured=()):
    """Exits with a message naming every option of `config` (a dataclass)
    that differs from the checkpoint's `saved` dict, except those in
    `honoured` (which the resumed run takes as given): a resumed run
    continues the run it finds, so it cannot honour a changed model, data or
    schedule (the learning rate at each step depends on them)."""
    current = dataclasses.asdict(config)
    changed = [
        f"{name}: {saved.get(name)!r} in the checkpoint, {value!r} now"
        for name, value in current.items()
        if saved.get(name) != value and name not in honoured
    ]
    changed += [f"{name}: no longer an option" for name in saved if name not in current]
    if changed:
        sys.exit(
            f"The checkpoint in {directory} was written with other options:\n  "
            + "\n  ".join(changed)
            + "\nRun with the checkpoint's options to resume it, or start over "
            "with --fresh or another --output-dir."
        )


def trained_line(trained, seconds, steps, output):
    """The line a training run prints when `fit` returns: the steps and
    seconds, or, for a run that found its checkpoint already at its last
    step, that there was nothing to train and what would train more."""
    if trained:
        return f"trained {trained} steps in {seconds:.1f} s"
    return (
        f"nothing to train: the checkpoint in {output} is at step {steps}, the last of "
        f"--steps {steps} (a larger --steps trains further, --fresh starts over)"
    )


def resumed_step(model, saved_step):
    """The optimizer's own step counter after loading a checkpoint, checked
    against the step the checkpoint says it holds."""
    step = _step(model)
    if step != saved_step:
        raise RuntimeError(
            f"The checkpoint's weights hold optimizer step {step}, its state "
            f"says {saved_step}: the checkpoint is inconsistent."
        )
    return step


def resume(model, folder, saved_step):
    """Loads the checkpoint in `folder` (`load_weights`) into `model` and
    returns the step it continues from: the optimizer's own counter, which
    the weights file holds, checked against `saved_step`."""
    load_weights(model, folder)
    return resumed_step(model, saved_step)


# Pictures.


def save_head_panels(figure, heads, columns, path):
    """Saves a `visualization.plot_attention` figure of `heads` panels in
    `columns` columns as a PNG at `path`. The panels share their tokens, so
    the rows are labelled on the left column only and the columns on the
    bottom panels only: no labels overlap a panel."""
    columns = min(heads, columns)
    for index, axes in enumerate(figure.axes[:heads]):
        if index % columns:
            axes.tick_params(labelleft=False)
        if index + columns < heads:
            axes.tick_params(labelbottom=False)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight")
