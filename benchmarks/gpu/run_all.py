"""One prepared GPU run: the examples' `gpu` presets against nanoGPT, one table.

Rows, each run in a process of its own, one after the other on the same GPU:

- `nanogpt`: nanoGPT's `shakespeare_char` loop written out in PyTorch
  (`benchmarks/nanogpt_side_by_side.nanogpt`: its `gpu` configuration,
  `torch.compile`, bfloat16 autocast, `scaled_dot_product_attention` with
  `dropout_p`, whose flash kernel takes dropout), 5,000 steps, evaluation
  every 250 on 200 batches of each split;
- `gpt-jax`, `gpt-torch`: examples/gpt_lm's `gpu` preset in bfloat16 with
  the same evaluation work (`--eval-interval 250 --eval-batches 200`),
  through the arrays pipeline (no TensorFlow); torch eagerly, or compiled
  with `--torch-jit` (README.md, "Torch: eager or compiled", says why eager
  is the default);
- `translation-jax`, `translation-torch`, `bert-jax`, `bert-torch`: the
  `gpu` presets of examples/translation and examples/bert_mlm in bfloat16
  for `--model-steps` steps on data that `--prepare` wrote (no TensorFlow,
  no tensorflow-text), then the step time of one full-length batch
  (`_measure.step_seconds`) and the attention kernel the backend launched
  (`_measure.attention_kernels`: torch's profiler, JAX's compiled program).

Columns: the wall time of the process (imports, compilation, evaluation
included), training ms/step and tokens/s (GPT rows: the training steps
alone; the other rows: the full-length batch), the MFU over `--peak-tflops`
(dense bf16), the attention kernel, the training loss of the last interval
and the validation loss (GPT rows: nanoGPT's estimate at the last step; its
published figure is 1.4697). FLOPs per token as nanoGPT counts them (PaLM,
appendix B): `6 N + 12 L D T`, with `N` the weights a token's matmuls read
(GPT rows: `12 L D^2 + V D`, the same for both models, which both have no
biases and a tied head); the translation rows count each weight once per
source and target position of a full batch, as
`benchmarks/gpu/train_translation_gpu.py` does.

Each row appends a JSON line to `--results` and the table printed at the
end holds every row found there, so the parts can run as separate commands
(each under the device's 10-minute limit):

    python3 benchmarks/gpu/run_all.py --part gpt
    python3 benchmarks/gpu/run_all.py --part models
    python3 benchmarks/gpu/run_all.py --dry-run          # everything on a CPU, seconds

`--dry-run` runs the same rows on the `tiny` presets (nanoGPT's loop on a
small configuration) on the CPU, preparing the tiny data first where
TensorFlow is installed (the test `tests/test_gpu_run_all.py` runs it); its
rows then run where `import tensorflow` fails, as on the device machine.
How to carry the keras wheel and the prepared data to the device machine:
`benchmarks/gpu/README.md`.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXAMPLES = ROOT / "examples"
PARTS = {
    "gpt": ("nanogpt", "gpt-jax", "gpt-torch"),
    "models": ("translation-jax", "translation-torch", "bert-jax", "bert-torch"),
}
PARTS["all"] = PARTS["gpt"] + PARTS["models"]
NANOGPT_VALIDATION_LOSS = 1.4697
COLUMNS = ("row", "steps", "wall s", "ms/step", "tokens/s", "MFU", "attention kernel",
           "loss", "val_loss")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=sorted(PARTS), default="all")
    parser.add_argument("--dry-run", action="store_true", help="tiny presets on the CPU")
    parser.add_argument("--gpt-steps", type=int, default=5000)
    parser.add_argument("--model-steps", type=int, default=200)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H100/H200 dense bf16")
    parser.add_argument("--data-dir", default=str(ROOT / "gpu_data"),
                        help="translation/ and bert_mlm/ as --prepare wrote them")
    parser.add_argument("--results", default=None,
                        help="JSON lines of the rows (default: DATA_DIR/results.jsonl)")
    parser.add_argument("--torch-jit", action="store_true",
                        help="torch trains compiled (torch.compile)")
    parser.add_argument("--rows", help="a comma-separated subset of the part's rows")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.results is None:
        args.results = str(pathlib.Path(args.data_dir) / "results.jsonl")
    return args


# The rows.


def gpt_weights(layers, width, vocabulary):
    """`12 L D^2 + V D`: the attention and MLP matrices, and the tied head."""
    return 12 * layers * width**2 + vocabulary * width


def mfu(tokens_per_second, flops_per_token, peak_tflops):
    return tokens_per_second * flops_per_token / (peak_tflops * 1e12)


def nanogpt_row(args, began):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import nanogpt_side_by_side as nanogpt

    config = dict(nanogpt.GPU_CONFIG)
    steps, interval, iters = args.gpt_steps, 250, 200
    device, compile_ = "cuda", True
    if args.dry_run:
        config.update(block_size=16, batch_size=4, n_layer=1, n_head=2, n_embd=16)
        steps, interval, iters, device, compile_ = 4, 2, 2, "cpu", False
    with tempfile.TemporaryDirectory() as out:
        result = nanogpt.nanogpt(steps, interval, iters, out, config, device, compile_)
    tokens = config["batch_size"] * config["block_size"] * result["steps"]
    seconds = result["seconds"]["training"]
    flops = 6 * gpt_weights(config["n_layer"], config["n_embd"], 65) + 12 * (
        config["n_layer"] * config["n_embd"] * config["block_size"]
    )
    return dict(
        steps=result["steps"], wall=time.perf_counter() - began,
        ms_per_step=1e3 * seconds / result["steps"], tokens_per_second=tokens / seconds,
        mfu=mfu(tokens / seconds, flops, args.peak_tflops),
        kernel="torch SDPA (flash: bf16, is_causal, dropout_p)",
        loss=None, val_loss=result["val_loss"],
    )


def _example(name, backend):
    os.environ["KERAS_BACKEND"] = backend
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(EXAMPLES / name))
    import train  # noqa: E402  (after KERAS_BACKEND)

    return train


def _last_losses(output):
    """The training and validation losses of the last interval (`log.csv`)."""
    import csv

    with open(pathlib.Path(output) / "log.csv") as f:
        rows = list(csv.DictReader(f))
    last = rows[-1]
    return (float(last["loss"]) if last.get("loss") else None,
            float(last["val_loss"]) if last.get("val_loss") else None)


def gpt_row(args, backend, began):
    train = _example("gpt_lm", backend)
    preset = ["--tiny", "--eval-batches", "2"] if args.dry_run else [
        "--config", "gpu", "--mixed-precision", "--steps", str(args.gpt_steps),
        "--eval-interval", "250", "--eval-batches", "200",
    ]
    jit = ["--jit"] if backend == "torch" and args.torch_jit else []
    with tempfile.TemporaryDirectory() as out:
        result = train.main([*preset, *jit, "--fresh", "--pipeline", "arrays",
                             "--output-dir", out])
        loss, _ = _last_losses(out)
    import _measure
    import numpy as np

    config = result["config"]
    tokens_per_second = float(np.median(result["train_tokens_per_second"]))
    tokens = config.batch_size * config.context_length
    flops = 6 * gpt_weights(config.num_layers, config.hidden_dim, 65) + 12 * (
        config.num_layers * config.hidden_dim * config.context_length
    )
    batch = np.zeros((config.batch_size, config.context_length), "int32")
    return dict(
        steps=config.steps, wall=time.perf_counter() - began,
        ms_per_step=1e3 * tokens / tokens_per_second, tokens_per_second=tokens_per_second,
        mfu=mfu(tokens_per_second, flops, args.peak_tflops),
        kernel=_measure.attention_kernels(result["model"], batch),
        loss=loss, val_loss=result["val_loss"],
    )


def _model_argv(args, name):
    data = pathlib.Path(args.data_dir) / name
    if args.dry_run:
        data = pathlib.Path(args.data_dir) / f"{name}_tiny"
        preset = ["--tiny"]
    else:
        steps = str(args.model_steps)
        preset = ["--config", "gpu", "--mixed-precision", "--steps", steps,
                  "--eval-interval", steps]
    return [*preset, "--fresh", "--pipeline", "arrays", "--data", str(data)]


def translation_row(args, backend, began):
    train = _example("translation", backend)
    import _measure

    jit = ["--jit"] if backend == "torch" and args.torch_jit else []
    with tempfile.TemporaryDirectory() as out:
        result = train.main([*_model_argv(args, "translation"), *jit, "--train-only",
                             "--output-dir", out])
        loss, val_loss = _last_losses(out)
    model, config = result["model"], result["config"]
    x, y, weights, tokens = _measure.translation_batch(config)
    seconds = _measure.step_seconds(model, x, y, weights)
    flops = _measure.translation_flops(model, config)
    return dict(
        steps=config.steps, wall=time.perf_counter() - began, ms_per_step=1e3 * seconds,
        tokens_per_second=tokens / seconds, mfu=flops / seconds / (args.peak_tflops * 1e12),
        kernel=_measure.attention_kernels(model, x), loss=loss, val_loss=val_loss,
    )


def bert_row(args, backend, began):
    train = _example("bert_mlm", backend)
    import _measure

    jit = ["--jit"] if backend == "torch" and args.torch_jit else []
    with tempfile.TemporaryDirectory() as out:
        result = train.main([*_model_argv(args, "bert_mlm"), *jit, "--pretrain-only",
                             "--output-dir", out])
        loss, val_loss = _last_losses(out)
    model, config = result["model"], result["config"]
    x, y, weights, tokens = _measure.bert_batch(model, config)
    seconds = _measure.step_seconds(model, x, y, weights)
    return dict(
        steps=config.steps, wall=time.perf_counter() - began, ms_per_step=1e3 * seconds,
        tokens_per_second=tokens / seconds,
        mfu=mfu(tokens / seconds, _measure.bert_flops_per_token(model, config), args.peak_tflops),
        kernel=_measure.attention_kernels(model, x), loss=loss, val_loss=val_loss,
    )


def run_row(args, row):
    began = time.perf_counter()
    if row == "nanogpt":
        return nanogpt_row(args, began)
    name, backend = row.rsplit("-", 1)
    maker = {"gpt": gpt_row, "translation": translation_row, "bert": bert_row}[name]
    return maker(args, backend, began)


# The driver.


def prepare_tiny_data(args, rows):
    """The dry run's prepared data (`--tiny --prepare`) for `rows`, made
    where it is missing: that needs TensorFlow, as preparing the real data
    does."""
    names = {"translation": "translation", "bert": "bert_mlm"}
    for name in sorted({names[r.split("-")[0]] for r in rows if r.split("-")[0] in names}):
        folder = pathlib.Path(args.data_dir) / f"{name}_tiny"
        if not (folder / "ids.npz").exists():
            subprocess.run(
                [sys.executable, str(EXAMPLES / name / "train.py"), "--tiny", "--prepare",
                 str(folder)],
                check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
            )


def without_tensorflow(env, folder):
    """`env` with a `tensorflow` package first on `PYTHONPATH` (made in
    `folder`) whose import raises ImportError, as on the device machine,
    which has no TensorFlow. A row that needed it would fail here, not
    there; and the rows skip its import (`keras.utils.set_random_seed`
    imports TensorFlow wherever it is installed)."""
    stub = pathlib.Path(folder) / "tensorflow"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text(
        'raise ImportError("the GPU run\'s device machine has no TensorFlow")\n'
    )
    return dict(env, PYTHONPATH=os.pathsep.join([str(folder), env["PYTHONPATH"]]))


def table(results):
    """The rows of `results` (dicts), as a Markdown table."""
    def number(value, form):
        return "-" if value is None else format(value, form)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in results:
        kernel = r["kernel"].replace("attention kernels (ours): ", "").replace("|", "/")
        lines.append("| " + " | ".join([
            r["row"], str(r["steps"]), number(r["wall"], ".0f"), number(r["ms_per_step"], ".1f"),
            number(r["tokens_per_second"], ",.0f"), number(100 * r["mfu"], ".1f") + "%",
            kernel, number(r["loss"], ".4f"), number(r["val_loss"], ".4f"),
        ]) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        row = dict(row=args.worker, **run_row(args, args.worker))
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row
    pathlib.Path(args.data_dir).mkdir(parents=True, exist_ok=True)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    ))
    rows = PARTS[args.part]
    if args.rows:
        unknown = sorted(set(args.rows.split(",")) - set(rows))
        if unknown:
            raise SystemExit(f"--rows must name rows of {rows}. Received: rows={args.rows!r}")
        rows = tuple(r for r in rows if r in args.rows.split(","))
    failed = []
    with tempfile.TemporaryDirectory() as stub:
        if args.dry_run:
            prepare_tiny_data(args, rows)
            env = without_tensorflow(env, stub)
        for row in rows:
            print(f"---- {row}", flush=True)
            command = [sys.executable, __file__, "--worker", row, *(argv or sys.argv[1:])]
            if subprocess.run(command, cwd=ROOT, env=env).returncode:
                failed.append(row)
    with open(args.results) as f:
        results = [json.loads(line) for line in f if line.strip()]
    print(f"\nnanoGPT's published validation loss: {NANOGPT_VALIDATION_LOSS}")
    print(table(results))
    if failed:
        raise SystemExit(f"rows that failed: {', '.join(failed)}")
    return results


if __name__ == "__main__":
    main()
