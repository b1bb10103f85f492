"""Translate English sentences to Spanish with a model trained by `train.py`.

Usage:

    python examples/translation/translate.py --output-dir translation_output \
        "In the beginning was the Word." "The Lord is my shepherd."
    python examples/translation/translate.py --sampling greedy "I am the light of the world."

Loads `model.keras` (safe mode) and the WordPiece vocabularies from the
training run's output directory and prints one translation a line, in the
order of the sentences, each source followed by its translation on the line below
(`  -> ...`; beam search with 4 beams by default).
"""

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for common
import common  # noqa: E402



def build_parser():
    """The command line (checked before the heavy imports)."""
    parser = common.OptionParser(description=__doc__.split("\n")[0])
    parser.add_argument("sentences", nargs="+", type=common.text_option, help="English sentences")
    parser.add_argument(
        "--output-dir", default="translation_output", help="the training run's folder"
    )
    parser.add_argument("--sampling", choices=["beam", "greedy"], default="beam")
    parser.add_argument("--num-beams", type=common.positive_int, default=4)
    parser.add_argument("--length-penalty", type=common.non_negative_float, default=0.6)
    common.backend_option(parser)
    return parser


# `--backend` must reach KERAS_BACKEND before keras loads; `--help` and bad
# options end the script before it.
common.select_backend(parser=build_parser() if __name__ == "__main__" else None)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import data  # noqa: E402


def translate(
    model, tokenizer, texts, sampling="beam", num_beams=4, length_penalty=0.6,
    batch_size=64, on_batch=None,
):
    """The translations of `texts` (a list of strings), in their order.

    Sources are batched by length (`data.source_batches`); each batch
    decodes up to the model's `max_target_length` with `model.generate`.

    Args:
        model: a trained `Seq2SeqTransformer`.
        tokenizer: its `data.PairTokenizer`.
        texts: source sentences.
        sampling: `"greedy"` or `"beam"`.
        num_beams: beams of the beam search.
        length_penalty: beam hypotheses rank by `log p / length ** penalty`.
        batch_size: sources per `generate` call.
        on_batch: optional `on_batch(done, total)`, called after each batch.

    Returns:
        A list of strings, the detokenized translations.
    """
    batches = data.source_batches(texts, tokenizer, model.max_source_length, batch_size)
    beam = dict(num_beams=num_beams, length_penalty=length_penalty)
    kwargs = beam if sampling == "beam" else {}
    outputs = [None] * len(texts)
    done = 0
    for indices, ids in batches:
        generated = model.generate(
            ids,
            model.max_target_length - 1,
            start_token_id=data.START_ID,
            end_token_id=data.END_ID,
            sampling=sampling,
            **kwargs,
        )  # (B, max_target_length)
        for row, i in zip(generated, indices):
            outputs[i] = tokenizer.detokenize(row)
        done += len(indices)
        if on_batch is not None:
            on_batch(done, len(texts))
    return outputs


def load(output_dir):
    """`(model, tokenizer)` saved by `train.py` in `output_dir`.

    The model holds the tokenizer's `TranslationPreprocessor` in
    `model.preprocessor`, packing to its lengths, so that
    `model.translate("text")` also works (with KerasHub's WordPiece
    detokenization, which spaces punctuation apart; `translate` here joins
    it as `data.join_tokens` does).
    """
    import keras

    import keras_attention  # noqa: F401  registers the classes for loading

    output = pathlib.Path(output_dir)
    model = keras.saving.load_model(output / "model.keras", compile=False)
    tokenizer = data.PairTokenizer.load(output)
    preprocessor = tokenizer.preprocessor
    preprocessor.encoder_sequence_length = model.max_source_length
    preprocessor.decoder_sequence_length = model.max_target_length
    model.preprocessor = preprocessor
    return model, tokenizer


def main(argv=None):
    args = build_parser().parse_args(argv)
    common.check_trained_model(
        args.output_dir, "Seq2SeqTransformer", "examples/translation/train.py"
    )

    start = time.perf_counter()
    model, tokenizer = load(args.output_dir)
    translations = translate(
        model, tokenizer, args.sentences, args.sampling, args.num_beams,
        args.length_penalty,
    )
    # Each source beside its translation; an empty translation (the model
    # ended it at once) is said as such rather than left a blank line.
    for source, translation in zip(args.sentences, translations):
        print(f"{source}\n  -> {translation or '(empty translation)'}")
    print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    common.run(main, build_parser(), resumable=None)
