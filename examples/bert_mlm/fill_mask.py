"""Fill the `[MASK]`s of sentences with a BERT trained by `train.py`.

Usage:

    python examples/bert_mlm/fill_mask.py --output-dir bert_mlm_output \
        "In the beginning God created the [MASK] and the earth." --top-k 5

Loads `model.keras` (safe mode) and `vocabulary.txt` from the training run's
output directory and prints, for each `[MASK]` of each sentence, the most
likely tokens with their probabilities (`train.py` prints the same for one
sentence at the end of its run).
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
import common  # noqa: E402


def masked_sentence(text):
    """An argparse `type`: a sentence holding at least one `[MASK]`."""
    if "[MASK]" not in text:
        raise common.argparse.ArgumentTypeError(f"must hold [MASK]. Received: {text!r}")
    return text


def build_parser():
    """The command line (checked before the heavy imports)."""
    parser = common.OptionParser(description=__doc__.split("\n")[0])
    parser.add_argument("sentences", nargs="+", type=masked_sentence,
                        help="sentences, each with one or more [MASK]")
    parser.add_argument("--output-dir", default="bert_mlm_output", help="the training run's folder")
    parser.add_argument("--top-k", type=common.positive_int, default=5,
                        help="tokens shown per mask")
    common.backend_option(parser)
    return parser


# `--backend` must reach KERAS_BACKEND before keras loads; `--help` and bad
# options end the script before it.
common.select_backend(parser=build_parser() if __name__ == "__main__" else None)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def main(argv=None):
    args = build_parser().parse_args(argv)
    output = pathlib.Path(args.output_dir)
    common.check_trained_model(output, "BertMaskedLM", "examples/bert_mlm/train.py")

    import keras

    import data
    import keras_attention  # noqa: F401  registers the classes for loading
    from train import fill_mask

    model = keras.saving.load_model(output / "model.keras", compile=False)
    vocabulary = data.Vocabulary.load(output)
    return [fill_mask(model, vocabulary, sentence, args.top_k) for sentence in args.sentences]


if __name__ == "__main__":
    common.run(main, build_parser())
