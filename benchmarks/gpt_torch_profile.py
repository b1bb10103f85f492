"""Where a training step of the GPT example goes on torch, against nanoGPT's loop.

Runs `--steps` training steps of each under `torch.profiler` (CPU):

- ours: `examples/gpt_lm/train.py`'s model, optimizer and batches (the `cpu`
  preset), trained with `model.fit` as the example trains it;
- nanoGPT's loop as `benchmarks/nanogpt_side_by_side.py` writes it out (one
  evaluation batch per split at step 0, then the steps).

For each it prints the wall time per step, the time per step spent inside
torch's operators (the profiler's self CPU time of every `aten::` operator,
summed, on the calling thread), the rest (Python: the layers' and
optimizers' code, Keras's dispatch, the data pipeline), and the operators
that take the most time. The profiler adds a few microseconds per operator,
so both runs are profiled the same way and the wall times read a little
high; read the split, not the totals.

    python benchmarks/gpt_torch_profile.py            # --steps 100 --top 12
"""

import argparse
import os
import pathlib
import sys
import tempfile
import time

os.environ["KERAS_BACKEND"] = "torch"

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "examples" / "gpt_lm"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import keras  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def _operators(prof):
    """`{name: (self CPU seconds, calls)}` of the profiled `aten::` operators."""
    result = {}
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            result[event.key] = (event.self_cpu_time_total / 1e6, event.count)
    return result


def profile_ours(steps):
    import train

    config = train.Config(**train.PRESETS["cpu"])
    keras.utils.set_random_seed(config.seed)
    tokenizer, batches, _, _, _ = train.make_data(config)
    model = train.build_model(config, tokenizer.vocabulary_size)
    train.compile_model(model, config)
    model.fit(batches.take(5), verbose=0)  # warm-up: the first calls build state
    data = batches.skip(5).take(steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        model.fit(data, verbose=0)
        wall = time.perf_counter() - start
    return wall, _operators(prof)


def profile_nanogpt(steps):
    import nanogpt_side_by_side

    with tempfile.TemporaryDirectory() as out_dir:
        nanogpt_side_by_side.nanogpt(5, 10**9, 1, out_dir)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = nanogpt_side_by_side.nanogpt(steps, 10**9, 1, out_dir)
    # Its loop runs `steps + 1` iterations (0 to `steps`, as nanoGPT's).
    return result["seconds"]["training"], _operators(prof), result["steps"]


def report(name, wall, operators, steps, top):
    inside = sum(seconds for seconds, _ in operators.values())
    calls = sum(count for _, count in operators.values())
    print(f"\n{name}: {1e3 * wall / steps:.1f} ms/step wall; inside torch operators "
          f"{1e3 * inside / steps:.1f} ms/step ({calls / steps:.0f} operator calls a "
          f"step); the rest {1e3 * (wall - inside) / steps:.1f} ms/step")
    ranked = sorted(operators.items(), key=lambda item: -item[1][0])[:top]
    for op, (seconds, count) in ranked:
        print(f"  {op:<48} {1e3 * seconds / steps:7.2f} ms/step  {count / steps:6.1f} calls")
    return inside


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"keras {keras.__version__}, {args.steps} steps each")
    wall, operators, steps = profile_nanogpt(args.steps)
    report("nanoGPT's loop", wall, operators, steps, args.top)
    wall, operators = profile_ours(args.steps)
    report("examples/gpt_lm (model.fit)", wall, operators, args.steps, args.top)


if __name__ == "__main__":
    main()
