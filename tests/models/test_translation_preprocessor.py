"""`TranslationPreprocessor`: two vocabularies, text to `Seq2SeqTransformer`
inputs and back, `fit`, `translate`, configs and preset folders.

The vocabularies are made here: WordPiece, the reserved tokens first
(`[PAD]` 0, `[UNK]` 1, `[START]` 2, `[END]` 3).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import keras
from keras_attention.models import Seq2SeqTransformer

keras_hub = pytest.importorskip("keras_hub")
from keras_attention.models import TranslationPreprocessor  # noqa: E402

RESERVED = ["[PAD]", "[UNK]", "[START]", "[END]"]
ENGLISH = RESERVED + ["the", "cat", "dog", "sees", "a", "bird", "."]
SPANISH = RESERVED + ["el", "gato", "perro", "ve", "un", "pájaro", "pa", "##jaro", "."]
PAIRS = [
    ("the cat sees a bird.", "el gato ve un pájaro."),
    ("the dog sees the cat.", "el perro ve el gato."),
    ("a bird sees the dog.", "un pájaro ve el perro."),
]
IDS = dict(start_token_id=2, end_token_id=3, pad_token_id=0)


def _wordpiece(vocabulary):
    return keras_hub.tokenizers.WordPieceTokenizer(vocabulary=vocabulary, oov_token="[UNK]")


def _preprocessor(**kwargs):
    arguments = dict(encoder_sequence_length=8, decoder_sequence_length=8, **IDS)
    arguments.update(kwargs)
    return TranslationPreprocessor(_wordpiece(ENGLISH), _wordpiece(SPANISH), **arguments)


def _numpy(structure):
    return keras.tree.map_structure(keras.ops.convert_to_numpy, structure)


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return Seq2SeqTransformer(
        len(ENGLISH), len(SPANISH), 8, 8, num_encoder_layers=1, num_decoder_layers=1,
        num_heads=2, hidden_dim=16, intermediate_dim=32, dropout=0.0, seed=seed,
    )


def test_training_inputs_labels_and_weights():
    preprocessor = _preprocessor(decoder_sequence_length=6)
    sources, targets = [p[0] for p in PAIRS[:2]], [p[1] for p in PAIRS[:2]]
    x, y, weights = _numpy(preprocessor((sources, targets)))
    np.testing.assert_array_equal(
        x["encoder_token_ids"], [[4, 5, 7, 8, 9, 10, 0, 0], [4, 6, 7, 4, 5, 10, 0, 0]]
    )
    np.testing.assert_array_equal(x["encoder_padding_mask"], x["encoder_token_ids"] != 0)
    # [START] target, and target [END]: the 6 tokens of each target leave 5
    # after the start, so the end token goes in the labels' last place.
    np.testing.assert_array_equal(x["decoder_token_ids"], [[2, 4, 5, 7, 8, 9], [2, 4, 6, 7, 4, 5]])
    np.testing.assert_array_equal(y, [[4, 5, 7, 8, 9, 3], [4, 6, 7, 4, 5, 3]])
    np.testing.assert_array_equal(x["decoder_padding_mask"], np.ones((2, 6), bool))
    np.testing.assert_array_equal(weights, np.ones((2, 6), bool))
    # A short target: padding after [END], weight 0 there.
    x, y, weights = _numpy(preprocessor(("the cat", "el gato")))
    np.testing.assert_array_equal(x["decoder_token_ids"], [2, 4, 5, 3, 0, 0])
    np.testing.assert_array_equal(y, [4, 5, 3, 0, 0, 0])
    np.testing.assert_array_equal(weights, [True, True, True, False, False, False])
    # KerasHub's dictionary and `preprocessor(sources, targets)` read the same.
    for other in (
        preprocessor({"encoder_text": "the cat", "decoder_text": "el gato"}),
        preprocessor("the cat", "el gato"),
    ):
        for a, b in zip(keras.tree.flatten(_numpy(other)), keras.tree.flatten((x, y, weights))):
            np.testing.assert_array_equal(a, b)


def test_round_trip_text_ids_text():
    preprocessor = _preprocessor()
    targets = [p[1] for p in PAIRS]
    x, y, weights = _numpy(preprocessor(([p[0] for p in PAIRS], targets)))
    # The labels are the target with [END]; back to text, the target.
    assert preprocessor.generate_postprocess({"decoder_token_ids": y}) == [
        "el gato ve un pájaro .", "el perro ve el gato .", "un pájaro ve el perro ."
    ]
    # WordPiece pieces join; the special ids go, [UNK] stays; a row gives a
    # string. (The rows `generate` returns hold padding after [END].)
    assert preprocessor.generate_postprocess(
        {"decoder_token_ids": np.array([2, 4, 10, 11, 1, 3, 0])}
    ) == "el pajaro [UNK]"
    assert preprocessor.generate_postprocess(
        {"decoder_token_ids": [[2, 4, 5, 0]], "decoder_padding_mask": [[True, True, False, False]]}
    ) == ["el"]
    packed = _numpy(preprocessor.generate_preprocess(["the bird", "a zebra"]))
    np.testing.assert_array_equal(packed["encoder_token_ids"][:, :3], [[4, 9, 0], [8, 1, 0]])
    np.testing.assert_array_equal(packed["decoder_token_ids"][:, :2], [[2, 0], [2, 0]])
    np.testing.assert_array_equal(packed["decoder_padding_mask"].sum(axis=1), [1, 1])


def test_source_start_and_end_and_tokenizer_ids():
    preprocessor = _preprocessor(source_start_token_id=2, source_end_token_id=3)
    x, _, _ = _numpy(preprocessor(("the cat", "el gato")))
    np.testing.assert_array_equal(x["encoder_token_ids"], [2, 4, 5, 3, 0, 0, 0, 0])
    # A KerasHub model tokenizer brings its own start, end and pad ids.
    vocabulary = {"<s>": 0, "<pad>": 1, "</s>": 2, "<mask>": 3, "Ġ": 4, "a": 5, "Ġa": 6}
    bart = keras_hub.models.BartTokenizer(vocabulary=vocabulary, merges=["Ġ a"])
    preprocessor = TranslationPreprocessor(_wordpiece(ENGLISH), bart)
    assert (preprocessor.start_token_id, preprocessor.end_token_id,
            preprocessor.pad_token_id) == (0, 2, 1)
    assert preprocessor.tokenizer is bart and preprocessor.target_tokenizer is bart


@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("tensorflow"), reason="tf.data needs TensorFlow"
)
def test_tf_data_map_gives_the_eager_batches():
    import tensorflow as tf

    preprocessor = _preprocessor()
    sources, targets = [p[0] for p in PAIRS], [p[1] for p in PAIRS]
    dataset = tf.data.Dataset.from_tensor_slices((sources, targets)).batch(3).map(preprocessor)
    (batch,) = list(dataset.as_numpy_iterator())
    eager = _numpy(preprocessor(sources, targets))
    for a, b in zip(keras.tree.flatten(batch), keras.tree.flatten(eager)):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def trained():
    """A tiny model fitted through the preprocessor, and the loss history."""
    preprocessor = _preprocessor()
    model = _model()
    model.preprocessor = preprocessor
    x, y, weights = _numpy(preprocessor(([p[0] for p in PAIRS], [p[1] for p in PAIRS])))
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    history = model.fit(
        x, y, sample_weight=weights.astype("float32"), epochs=40, batch_size=3, verbose=0
    )
    return model, history.history["loss"]


def test_fit_through_the_preprocessor_learns_the_pairs(trained):
    model, losses = trained
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.25 * losses[0]
    # Memorized: greedy translation gives the training targets back.
    assert model.translate([p[0] for p in PAIRS]) == [
        "el gato ve un pájaro .", "el perro ve el gato .", "un pájaro ve el perro ."
    ]


@pytest.mark.parametrize("sampling", ["greedy", "beam"])
def test_translate_decodes_what_generate_returns(trained, sampling):
    model, _ = trained
    preprocessor = model.preprocessor
    texts = ["the cat sees a bird.", "the dog", "a bird sees a bird."]
    packed = _numpy(preprocessor.generate_preprocess(texts))
    kwargs = {"num_beams": 2} if sampling == "beam" else {}
    ids = model.generate(
        packed["encoder_token_ids"], 7, start_token_id=2, end_token_id=3, sampling=sampling,
        encoder_padding_mask=packed["encoder_padding_mask"], **kwargs,
    )
    expected = []
    for row in ids:
        tokens = [SPANISH[i] for i in row[1:]]
        tokens = tokens[: tokens.index("[END]")] if "[END]" in tokens else tokens
        expected.append(" ".join(tokens).replace(" ##", ""))
    translations = model.translate(texts, sampling=sampling, **kwargs)
    assert translations == expected
    assert all(isinstance(t, str) for t in translations) and translations[0]
    single = model.translate(texts[0], sampling=sampling, **kwargs)
    assert single == expected[0]


def test_config_round_trip():
    preprocessor = _preprocessor(source_end_token_id=3, decoder_sequence_length=5)
    config = preprocessor.get_config()
    assert config["target_tokenizer"]["config"]["config_file"] == "tokenizer.json"
    assert config["source_tokenizer"]["config"]["config_file"] == "source_tokenizer.json"
    restored = TranslationPreprocessor.from_config(json.loads(json.dumps(config)))
    assert restored.get_config() == config
    assert (restored.start_token_id, restored.end_token_id, restored.pad_token_id,
            restored.source_end_token_id, restored.decoder_sequence_length) == (2, 3, 0, 3, 5)
    serialized = keras.saving.serialize_keras_object(preprocessor)
    assert serialized["registered_name"] == "keras_attention>TranslationPreprocessor"
    assert isinstance(keras.saving.deserialize_keras_object(serialized), TranslationPreprocessor)
    # One vocabulary for both: one tokenizer, saved once.
    shared = TranslationPreprocessor(_wordpiece(ENGLISH), None, **IDS)
    assert shared.target_tokenizer is shared.source_tokenizer
    assert shared.get_config()["target_tokenizer"] is None
    assert TranslationPreprocessor.from_config(shared.get_config()).shared


def test_preset_folder_save_and_load(tmp_path):
    preprocessor = _preprocessor(source_start_token_id=2)
    preprocessor.save_to_preset(tmp_path)
    assert (tmp_path / "assets" / "tokenizer" / "vocabulary.txt").read_text(
        encoding="utf-8").splitlines() == SPANISH
    assert (tmp_path / "assets" / "source_tokenizer" / "vocabulary.txt").read_text(
        encoding="utf-8").splitlines() == ENGLISH
    for name in ("preprocessor.json", "tokenizer.json", "source_tokenizer.json"):
        assert (tmp_path / name).is_file(), name
    loaded = TranslationPreprocessor.from_preset(tmp_path)
    assert loaded.get_config() == preprocessor.get_config()
    pairs = ([p[0] for p in PAIRS], [p[1] for p in PAIRS])
    for a, b in zip(keras.tree.flatten(_numpy(loaded(pairs))),
                    keras.tree.flatten(_numpy(preprocessor(pairs)))):
        np.testing.assert_array_equal(a, b)
    # Overrides of the config.
    assert TranslationPreprocessor.from_preset(
        str(tmp_path), decoder_sequence_length=4).decoder_sequence_length == 4
    # Shared: one tokenizer in the folder.
    shared = TranslationPreprocessor(_wordpiece(ENGLISH), **IDS)
    shared.save_to_preset(tmp_path / "shared")
    assert not (tmp_path / "shared" / "source_tokenizer.json").exists()
    loaded = TranslationPreprocessor.from_preset(tmp_path / "shared")
    assert loaded.shared and loaded.source_tokenizer.get_vocabulary() == ENGLISH


def test_model_preset_folder_translates_as_saved(trained, tmp_path):
    model, _ = trained
    model.save_to_preset(tmp_path)
    assert (tmp_path / "model.keras").is_file() and (tmp_path / "preprocessor.json").is_file()
    loaded = Seq2SeqTransformer.from_preset(tmp_path)
    assert isinstance(loaded.preprocessor, TranslationPreprocessor)
    texts = [p[0] for p in PAIRS] + ["the bird sees a dog."]
    assert loaded.translate(texts) == model.translate(texts)
    with pytest.raises(ValueError, match=r"constructor arguments apply to KerasHub presets.*dtype"):
        Seq2SeqTransformer.from_preset(tmp_path, dtype="float16")
    with pytest.raises(ValueError, match=r"holds 'encoder_text' and 'decoder_text'"):
        model.preprocessor({"source": "the"})


def test_wrong_arguments_name_the_argument_and_value(tmp_path):
    with pytest.raises(TypeError, match=r"`source_tokenizer` must be a keras_hub.tokenizers"
                                        r".Tokenizer.*source_tokenizer=\['the'\].*list"):
        TranslationPreprocessor(["the"], _wordpiece(SPANISH), **IDS)
    with pytest.raises(TypeError, match=r"`target_tokenizer` must be.*target_tokenizer='es'"):
        TranslationPreprocessor(_wordpiece(ENGLISH), "es", **IDS)
    with pytest.raises(ValueError, match=r"`start_token_id` must be given.*WordPieceTokenizer"
                                         r".*start_token_id=None"):
        TranslationPreprocessor(_wordpiece(ENGLISH), _wordpiece(SPANISH))
    with pytest.raises(ValueError, match=r"`end_token_id` must be an id of its tokenizer's "
                                         r"vocabulary of 13 tokens.*end_token_id=13"):
        _preprocessor(end_token_id=13)
    with pytest.raises(ValueError, match=r"`pad_token_id` must be a non-negative int.*=-1"):
        _preprocessor(pad_token_id=-1)
    with pytest.raises(ValueError, match=r"`source_end_token_id` must be a non-negative.*='3'"):
        _preprocessor(source_end_token_id="3")
    with pytest.raises(ValueError, match=r"encoder_sequence_length.*encoder_sequence_length=0"):
        _preprocessor(encoder_sequence_length=0)
    preprocessor = _preprocessor()
    with pytest.raises(ValueError, match=r"needs the targets.*y=None"):
        preprocessor(["the cat", "the dog"])
    with pytest.raises(ValueError, match=r"`sample_weight` must be None.*sample_weight=\[1"):
        preprocessor(("the cat", "el gato"), sample_weight=[1.0])
    with pytest.raises(ValueError, match=r"holds preprocessor.json.*preset='.*empty'"):
        TranslationPreprocessor.from_preset(tmp_path / "empty")
    # A folder holding another preprocessor is named as such.
    gpt2 = keras_hub.models.GPT2CausalLMPreprocessor(
        keras_hub.models.GPT2Tokenizer(
            vocabulary={"<|endoftext|>": 0, "Ġ": 1, "a": 2, "Ġa": 3}, merges=["Ġ a"]
        ),
        sequence_length=4,
    )
    gpt2.save_to_preset(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"holds a GPT2CausalLMPreprocessor, not a "
                                         r"TranslationPreprocessor"):
        TranslationPreprocessor.from_preset(tmp_path / "gpt2")


def test_models_import_without_keras_hub(tmp_path):
    """`keras_attention.models` imports no KerasHub; the preprocessor's name
    says how to install it where KerasHub is missing."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'keras_hub':\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import keras_attention.models as models\n"
        "assert 'keras_hub' not in sys.modules\n"
        "try:\n"
        "    models.TranslationPreprocessor\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "keras_attention.models.TranslationPreprocessor needs KerasHub" in result.stdout
    assert "pip install keras-hub" in result.stdout
