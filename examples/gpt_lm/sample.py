"""Write text with a GPT trained by `train.py`.

Usage:

    python examples/gpt_lm/sample.py --output-dir gpt_lm_output --prompt "ROMEO:" \
        --length 500 --temperature 0.8 --top-k 40 --seed 1

Loads `model.keras` (safe mode) and the tokenizer from the training run's
output directory and continues the prompt. A model's context is its
`max_sequence_length`; longer texts slide: each `generate` call keeps the last
half context as its prompt and adds the other half, with the KV cache inside
each call; every call after the first has the same shapes, so the decoding loop
compiles once for them.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
import common  # noqa: E402



def build_parser():
    """The command line (checked before the heavy imports)."""
    parser = common.OptionParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="gpt_lm_output", help="the training run's folder")
    parser.add_argument("--prompt", default="\n", type=common.text_option)
    parser.add_argument("--length", type=common.positive_int, default=500, help="new tokens")
    parser.add_argument("--temperature", type=common.positive_float, default=0.8)
    parser.add_argument(
        "--top-k", type=common.non_negative_int, default=40, help="0: sample from every token"
    )
    parser.add_argument("--seed", type=int, default=None)
    common.backend_option(parser)
    return parser


# `--backend` must reach KERAS_BACKEND before keras loads; `--help` and bad
# options end the script before it.
common.select_backend(parser=build_parser() if __name__ == "__main__" else None)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402


def sample_text(model, prompt_ids, length, temperature=1.0, top_k=None, seed=None):
    """`length` new ids after `prompt_ids` (1-D), sliding past the context.

    Returns the new ids as a 1-D numpy array (the tokenizer decodes them).
    """
    context = model.max_sequence_length
    keep = max(context // 2, 1)
    ids = list(np.asarray(prompt_ids, "int32")[-keep:])
    produced = []
    step = 0
    while len(produced) < length:
        prompt = np.array([ids[-keep:]], "int32")  # (1, P)
        # Always up to the whole context, the extra tokens of the last call
        # dropped: every call has the same shapes, so it compiles once.
        sampling = "top_k" if top_k else "random"
        output = model.generate(
            prompt, context - prompt.shape[1], sampling=sampling,
            temperature=temperature, top_k=top_k,
            seed=None if seed is None else seed + step,
        )
        fresh = list(output[0, prompt.shape[1]:])[: length - len(produced)]
        produced += fresh
        ids += fresh
        step += 1
    return np.array(produced, "int32")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    output = pathlib.Path(args.output_dir)
    common.check_trained_model(output, "GPT", "examples/gpt_lm/train.py")

    import keras

    import data
    import keras_attention  # noqa: F401  registers the classes for loading

    model = keras.saving.load_model(output / "model.keras")
    tokenizer = data.load_tokenizer(output / "tokenizer.json")
    try:
        prompt = tokenizer.encode(args.prompt)
    except ValueError as error:
        parser.error(f"argument --prompt: {error}")
    new = sample_text(
        model, prompt, args.length, args.temperature, args.top_k or None, args.seed
    )
    print(args.prompt + tokenizer.decode(new))


if __name__ == "__main__":
    common.run(main, build_parser(), resumable=None)
