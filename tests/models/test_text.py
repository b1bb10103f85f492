"""Text in, text out, and KerasHub's conventions on the models.

Presets are saved locally (`save_to_preset`) from small randomly initialized
KerasHub tasks whose tokenizers hold a tiny vocabulary; `from_preset` loads
them into our models, and their text methods must give what KerasHub's own
task gives on the same weights (greedy decoding, softmax of the logits).
"""

import numpy as np
import pytest

import harness
import keras
from keras_attention.models import GPT
from keras_attention.models import BertMaskedLM
from keras_attention.models import Seq2SeqTransformer

keras_hub = pytest.importorskip("keras_hub")

# Byte-pair vocabularies: "Ġ" marks a leading space.
GPT2_VOCABULARY = {
    "<|endoftext|>": 0, "Ġ": 1, "a": 2, "b": 3, "c": 4, "Ġa": 5, "Ġb": 6, "Ġc": 7,
}
BART_VOCABULARY = {
    "<s>": 0, "<pad>": 1, "</s>": 2, "<mask>": 3, "Ġ": 4, "a": 5, "b": 6, "c": 7,
    "Ġa": 8, "Ġb": 9, "Ġc": 10,
}
MERGES = ["Ġ a", "Ġ b", "Ġ c"]
BERT_VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat"]


def _saved_preset(tmp_path_factory, name, seed, backbone, task_class, preprocessor, **sizes):
    """A small randomly initialized KerasHub task saved as a local preset:
    `(folder, task)`, a generating task compiled with greedy sampling."""
    keras.utils.set_random_seed(seed)
    backbone = backbone(num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
                        max_sequence_length=16, **sizes)
    task = task_class(backbone=backbone, preprocessor=preprocessor)
    folder = tmp_path_factory.mktemp(name)
    task.save_to_preset(folder)
    if hasattr(task, "generate"):
        task.compile(sampler="greedy")
    return folder, task


@pytest.fixture(scope="module")
def gpt_preset(tmp_path_factory):
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=GPT2_VOCABULARY, merges=MERGES)
    return _saved_preset(
        tmp_path_factory, "gpt2_preset", 3, keras_hub.models.GPT2Backbone,
        keras_hub.models.GPT2CausalLM,
        keras_hub.models.GPT2CausalLMPreprocessor(tokenizer=tokenizer, sequence_length=10),
        vocabulary_size=len(GPT2_VOCABULARY),
    )


def _keras_hub_greedy_text(task, prompts, max_length):
    """KerasHub's greedy continuation of each prompt to `max_length` ids,
    cut after the first end token it generates, detokenized. (KerasHub's own
    text path is not the reference: where the end token is also the padding
    token, as in GPT-2, its loop sees the padding as ended rows and adds no
    token to these prompts.)"""
    preprocessor = task.preprocessor
    tokenizer = preprocessor.tokenizer
    packed = preprocessor.generate_preprocess(prompts, sequence_length=max_length)
    packed = {k: keras.ops.convert_to_numpy(v) for k, v in packed.items()}
    task.preprocessor = None
    try:
        ids = keras.ops.convert_to_numpy(
            task.generate(packed, max_length=max_length, stop_token_ids=None)["token_ids"]
        )
    finally:
        task.preprocessor = preprocessor
    texts = []
    for row, length in zip(ids, packed["padding_mask"].sum(axis=1)):
        ends = np.flatnonzero(row[length:] == tokenizer.end_token_id)
        row = row[1 : length + (ends[0] if len(ends) else len(row))]  # no start, no end
        texts.append(_detokenize(tokenizer, row))
    return texts


def _detokenize(tokenizer, ids):
    text = tokenizer.detokenize(np.asarray(ids, "int32")[None])
    text = text[0] if isinstance(text, list) else np.asarray(text).reshape(-1)[0]
    return text.decode("utf-8") if isinstance(text, bytes) else str(text)


def test_gpt_from_preset_generates_text_as_keras_hub_does(gpt_preset):
    folder, task = gpt_preset
    gpt = GPT.from_preset(str(folder))
    assert isinstance(gpt.preprocessor, keras_hub.models.GPT2CausalLMPreprocessor)
    # The preprocessor is no part of the model's weights or config.
    assert len(gpt.weights) == len(task.backbone.weights)
    prompts = ["a b", "c", "b a c c"]
    expected = _keras_hub_greedy_text(task, prompts, 10)
    assert any(e != p for e, p in zip(expected, prompts))  # something was added
    assert gpt.generate(prompts, max_length=10) == expected
    # Without a length, the preprocessor's sequence_length (10), as in KerasHub.
    assert gpt.generate(prompts) == expected
    assert gpt.generate(prompts[0], max_length=10) == expected[0]  # a string for a string
    # Beam search over prompts of different lengths, as over each alone;
    # the beam arguments reach the search (one beam with no length penalty
    # and no stop token is greedy). Weights of scale 1 first: the preset's
    # small ones leave hypotheses within float rounding of each other.
    _randomize(gpt)
    beams = dict(max_new_tokens=4, sampling="beam", num_beams=2)
    assert gpt.generate(prompts, **beams) == [gpt.generate(p, **beams) for p in prompts]
    one_beam = dict(sampling="beam", num_beams=1, length_penalty=0.0, stop_token_ids=[])
    assert gpt.generate(prompts, max_length=10, **one_beam) == gpt.generate(
        prompts, max_length=10, stop_token_ids=[]
    )
    # max_new_tokens counts the new tokens; max_length, the start token too.
    assert gpt.generate("a", max_new_tokens=3) == gpt.generate("a", max_length=2 + 3)


def test_gpt_max_length_is_the_output_length(gpt_preset):
    gpt = GPT.from_preset(str(gpt_preset[0]))
    ids = np.array([[0, 2, 6], [0, 4, 4]])
    by_length = gpt.generate(ids, max_length=7)
    assert by_length.shape == (2, 7)
    np.testing.assert_array_equal(by_length, gpt.generate(ids, max_new_tokens=4))
    with pytest.raises(ValueError, match=r"max_length.*must exceed.*3 tokens.*max_length=3"):
        gpt.generate(ids, max_length=3)
    with pytest.raises(ValueError, match=r"exactly one of `max_new_tokens`.*max_length=5"):
        gpt.generate(ids, max_new_tokens=2, max_length=5)
    with pytest.raises(ValueError, match=r"exactly one of .*max_new_tokens=None, max_length=None"):
        gpt.generate(ids)


def test_text_without_a_preprocessor_and_wrong_arguments_say_what_they_take(gpt_preset):
    gpt = GPT(8, 16, 1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"GPT.generate` was given text.*from_preset"):
        gpt.generate("hello", 5)
    with pytest.raises(ValueError, match=r"GPT2Backbone or keras_hub.models.LlamaBackbone.*backbone of type str \('gpt2_base_en'\).*GPT.from_preset\('gpt2_base_en'\)"):
        GPT.from_keras_hub("gpt2_base_en")
    with pytest.raises(ValueError, match=r"BartBackbone.*backbone of type GPT2Backbone"):
        Seq2SeqTransformer.from_keras_hub(gpt_preset[1].backbone)
    with pytest.raises(TypeError, match=r"`preset` must be .*preset=3"):
        GPT.from_preset(3)
    with pytest.raises(TypeError, match=r"`preprocessor` must be a KerasHub preprocessor.*str"):
        gpt.preprocessor = "gpt2"
    # The id-level arguments text does not take are named, not dropped.
    folder, _ = gpt_preset
    with_text = GPT.from_preset(str(folder))
    for name, value in [
        ("num_return_sequences", 2), ("return_scores", True), ("pad_token_id", 3),
        ("prompt_padding_mask", np.ones((1, 2), bool)),
    ]:
        with pytest.raises(ValueError, match=rf"`{name}` is for prompts given as an id.*{name}="):
            with_text.generate("a b", max_new_tokens=2, sampling="beam", **{name: value})


def test_gpt_takes_keras_hub_input_dictionary():
    gpt = GPT(8, 16, 1, 2, 8, 16, seed=1)
    ids = np.array([[1, 2, 3, 0], [4, 5, 0, 0]], "int32")
    mask = ids != 0
    expected = keras.ops.convert_to_numpy(gpt(ids, padding_mask=mask))
    got = keras.ops.convert_to_numpy(gpt({"token_ids": ids, "padding_mask": mask}))
    np.testing.assert_allclose(got, expected, atol=1e-6)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(gpt({"token_ids": ids})),
        keras.ops.convert_to_numpy(gpt(ids)), atol=1e-6,
    )
    with pytest.raises(ValueError, match=r"'token_ids' and optionally 'padding_mask'.*'segment_ids'"):
        gpt({"token_ids": ids, "segment_ids": ids})


def test_compile_without_a_loss_trains_with_the_from_logits_loss():
    keras.utils.set_random_seed(0)
    gpt = GPT(8, 16, 1, 2, 8, 16)
    x = {"token_ids": np.array([[1, 2, 3, 4, 5, 0]] * 4, "int32"),
         "padding_mask": np.array([[True] * 5 + [False]] * 4)}
    y = np.array([[2, 3, 4, 5, 6, 0]] * 4, "int32")
    gpt.compile(optimizer=keras.optimizers.Adam(1e-2), jit_compile=False)
    # The loss is the cross-entropy of the softmax of the logits, per token.
    logits = keras.ops.convert_to_numpy(gpt(x)).astype("float64")
    log_probabilities = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probabilities, y[..., None], -1).mean()
    assert gpt.evaluate(x, y, verbose=0) == pytest.approx(expected, rel=1e-4)
    # Each weight moves by more than `np.allclose`'s default tolerance.
    with harness.trains_every_weight(gpt, unless=("key/bias",), rtol=1e-5, atol=1e-8):
        history = gpt.fit(x, y, epochs=3, verbose=0).history["loss"]
    assert history[0] > 1 and history[-1] < history[0]
    with pytest.raises(ValueError, match=r"`loss` must be given.*Received: loss=None"):
        gpt.compile(optimizer="adam", loss=None)


@pytest.fixture(scope="module")
def bert_preset(tmp_path_factory):
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=BERT_VOCABULARY)
    return _saved_preset(
        tmp_path_factory, "bert_preset", 4, keras_hub.models.BertBackbone,
        keras_hub.models.BertMaskedLM,
        keras_hub.models.BertMaskedLMPreprocessor(tokenizer=tokenizer, sequence_length=12),
        vocabulary_size=len(BERT_VOCABULARY),
    )


def test_bert_from_preset_fills_masks_in_text(bert_preset):
    folder, task = bert_preset
    bert = BertMaskedLM.from_preset(str(folder))
    results = bert.fill_mask(["the [MASK] sat on the [MASK]", "[MASK] cat"], top_k=3)
    # KerasHub's own model on the same ids: [CLS] the [MASK] sat on the [MASK] [SEP].
    rows = [[2, 5, 4, 7, 8, 5, 4, 3], [2, 4, 6, 3, 0, 0, 0, 0]]
    positions = [[2, 6], [1, 1]]
    logits = keras.ops.convert_to_numpy(task({
        "token_ids": np.array(rows, "int32"),
        "segment_ids": np.zeros((2, 8), "int32"),
        "padding_mask": np.array(rows) != 0,
        "mask_positions": np.array(positions, "int32"),
    })).astype("float64")
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    assert [len(r) for r in results] == [2, 1]
    for row, masks in enumerate(results):
        for m, pairs in enumerate(masks):
            top = np.argsort(-probabilities[row, m])[:3]
            assert [token for token, _ in pairs] == [BERT_VOCABULARY[i] for i in top]
            np.testing.assert_allclose([p for _, p in pairs], probabilities[row, m, top], rtol=1e-4)
    assert bert.fill_mask("the [MASK]", top_k=2) == bert.fill_mask(["the [MASK]"], top_k=2)[0]
    with pytest.raises(ValueError, match=r"mask token '\[MASK\]'.*'the cat'"):
        bert.fill_mask("the cat")
    # Token ids take the tokenizer's mask id by default.
    (ids_result,) = bert.fill_mask(np.array([[2, 5, 4, 3]]), top_k=2)
    assert [BERT_VOCABULARY[i] for i in ids_result[0][1]] == [t for t, _ in bert.fill_mask("the [MASK]", top_k=2)[0]]


def test_bert_ids_without_preprocessor_need_the_mask_id():
    bert = BertMaskedLM(10, 1, 2, 8, 16, max_sequence_length=8)
    with pytest.raises(ValueError, match=r"`mask_token_id` is needed.*mask_token_id=None"):
        bert.fill_mask(np.array([[2, 4, 3]]))
    with pytest.raises(ValueError, match=r"BertMaskedLM.fill_mask` was given text"):
        bert.fill_mask("the [MASK]", 4)


@pytest.fixture(scope="module")
def bart_preset(tmp_path_factory):
    tokenizer = keras_hub.models.BartTokenizer(vocabulary=BART_VOCABULARY, merges=MERGES)
    preprocessor = keras_hub.models.BartSeq2SeqLMPreprocessor(
        tokenizer=tokenizer, encoder_sequence_length=10, decoder_sequence_length=8
    )
    return _saved_preset(
        tmp_path_factory, "bart_preset", 5, keras_hub.models.BartBackbone,
        keras_hub.models.BartSeq2SeqLM, preprocessor, vocabulary_size=len(BART_VOCABULARY),
    )


def test_seq2seq_from_preset_translates_text_as_keras_hub_does(bart_preset):
    folder, task = bart_preset
    model = Seq2SeqTransformer.from_preset(str(folder))
    sources = ["a b", "c c a", "b"]
    expected = task.generate(sources, max_length=6)
    assert model.translate(sources, max_length=6) == list(expected)
    # By default, the preprocessor's decoder_sequence_length (KerasHub's
    # preset loading sets 1024), at most the model's max_target_length; a
    # string for a string.
    assert model.preprocessor.decoder_sequence_length > model.max_target_length
    text = model.translate(sources[0])
    assert isinstance(text, str) and [text] == model.translate(sources[:1], max_length=16)
    # Beam search from BART's decoder prompt (two ids), a batch as each
    # source alone (weights of scale 1, as for GPT above).
    _randomize(model)
    beams = dict(max_length=6, sampling="beam", num_beams=2)
    assert model.translate(sources, **beams) == [model.translate(t, **beams) for t in sources]
    with pytest.raises(ValueError, match=r"`num_return_sequences` is for prompts given as an id"):
        model.translate(sources, sampling="beam", num_return_sequences=2)


def _bart_packed(task):
    """KerasHub's packed inputs of three sources with decoder prompts of
    three lengths (BART's `[</s>, <s>]` and 0, 1, 3 tokens more)."""
    packed = task.preprocessor.generate_preprocess(
        {"encoder_text": ["a b", "c c a", "b"], "decoder_text": ["a", "", "b c a"]},
        sequence_length=8,
    )
    return {k: keras.ops.convert_to_numpy(v) for k, v in packed.items()}


@pytest.mark.parametrize("stopping", [False, True], ids=["no_stop", "end_token"])
def test_seq2seq_generates_from_the_input_dictionary_as_keras_hub_does(bart_preset, stopping):
    """`BartSeq2SeqLM.generate` on packed inputs (no preprocessor): each
    decoder prompt continued to the packed width, the decoder's ids and
    mask back, the mask `True` through the end token; the tokens agree
    wherever the mask is `True`."""
    folder, preset_task = bart_preset
    task = keras_hub.models.BartSeq2SeqLM.from_preset(str(folder))
    task.compile(sampler="greedy")
    # Matrices of scale 1: tokens that vary and hang on no rounding, none
    # of them the pad id, which KerasHub may generate and ours never does.
    rng = np.random.default_rng(4)
    for variable in task.weights:
        if len(variable.shape) >= 2:
            variable.assign(rng.normal(size=variable.shape).astype("float32"))
    model = Seq2SeqTransformer.from_keras_hub(task)
    packed = _bart_packed(preset_task)
    task.preprocessor = None
    prompts = packed["decoder_padding_mask"].sum(axis=1)
    end = None
    if stopping:  # the first token row 0 generates, so that it stops there
        end = int(model.generate(packed)["decoder_token_ids"][0, prompts[0]])
    expected = task.generate(packed, stop_token_ids=None if end is None else [end])
    expected = {k: keras.ops.convert_to_numpy(v) for k, v in expected.items()}
    real_new = ~packed["decoder_padding_mask"] & expected["decoder_padding_mask"]
    new = expected["decoder_token_ids"][real_new]
    assert model.pad_token_id not in new and (stopping or len(set(new.tolist())) > 2)
    got = model.generate(packed, end_token_id=end)
    assert set(got) == set(expected) == {"decoder_token_ids", "decoder_padding_mask"}
    np.testing.assert_array_equal(got["decoder_padding_mask"], expected["decoder_padding_mask"])
    real = expected["decoder_padding_mask"]
    np.testing.assert_array_equal(
        got["decoder_token_ids"][real], expected["decoder_token_ids"][real]
    )
    assert real.all() != stopping  # some row stopped early
    if not stopping:
        return  # the rest once, with the end token (each call compiles on TensorFlow)
    # `max_new_tokens` instead: each row's new tokens after its own prompt,
    # as that source and prompt alone give them, the mask on its own tokens.
    short = model.generate(packed, max_new_tokens=2, end_token_id=end)
    for row, length in enumerate(prompts):
        source = packed["encoder_token_ids"][row : row + 1]
        start = packed["decoder_token_ids"][row, :length].tolist()
        alone = model.generate(source, 2, start, end_token_id=end)[0]
        np.testing.assert_array_equal(short["decoder_token_ids"][row, : length + 2], alone)
        assert not short["decoder_padding_mask"][row, length + 2 :].any()
    # `strip_prompt`: each row shifted left by its prompt, the mask on the
    # new tokens only; for ids, the new tokens only.
    stripped = model.generate(packed, end_token_id=end, strip_prompt=True)
    for row, length in enumerate(prompts):
        new = got["decoder_token_ids"][row, length:]
        np.testing.assert_array_equal(stripped["decoder_token_ids"][row, : len(new)], new)
        np.testing.assert_array_equal(
            stripped["decoder_padding_mask"][row, : len(new)],
            got["decoder_padding_mask"][row, length:],
        )
        assert not stripped["decoder_padding_mask"][row, len(new) :].any()
    ids = model.generate(packed["encoder_token_ids"], 3, [2, 0])
    np.testing.assert_array_equal(
        model.generate(packed["encoder_token_ids"], 3, [2, 0], strip_prompt=True), ids[:, 2:]
    )


def test_seq2seq_generate_says_what_ids_and_the_dictionary_take(bart_preset):
    folder, task = bart_preset
    model = Seq2SeqTransformer.from_keras_hub(task)
    packed = _bart_packed(task)
    sources = packed["encoder_token_ids"]
    for kwargs, message in [
        (dict(start_token_id=2), r"`start_token_id` is for prompts given as an id"),
        (dict(return_scores=True), r"`return_scores` is for prompts given as an id"),
        (dict(encoder_padding_mask=packed["encoder_padding_mask"]),
         r"`encoder_padding_mask` is for prompts given as an id"),
    ]:
        with pytest.raises(ValueError, match=message):
            model.generate(packed, **kwargs)
    with pytest.raises(ValueError, match=r"holds 'encoder_token_ids', 'decoder_token_ids'.*"
                                         r"Received: keys \['decoder_token_ids', 'token_ids'\]"):
        model.generate({"token_ids": sources, "decoder_token_ids": sources[:, :2]})
    with pytest.raises(ValueError, match=r"`decoder_token_ids`.*max_target_length"):
        model.generate({"encoder_token_ids": sources, "decoder_token_ids": np.ones((3, 40), int)})
    for row in ([1, 0, 1, 0, 0, 0, 0, 0], [0] * 8):  # not a prefix; empty
        bad = dict(packed, decoder_padding_mask=np.array([row] * 3, bool))
        with pytest.raises(ValueError, match=r"`decoder_padding_mask` must have the shape of "
                                             r"`decoder_token_ids` and mark a non-empty prefix"
                                             rf".*row 0 of the mask: \[{row[0]}, 0, {row[2]}"):
            model.generate(bad)
    # Prompts that fill the width come back as they are (KerasHub's loop has
    # no position to fill), alone or beside a shorter one, which is
    # continued as it would be alone (the two need one call each: the model
    # holds 16 target positions).
    full = {"encoder_token_ids": sources, "decoder_token_ids": packed["decoder_token_ids"][:, :2]}
    out = model.generate(full)
    np.testing.assert_array_equal(out["decoder_token_ids"], full["decoder_token_ids"])
    assert out["decoder_padding_mask"].all()
    ids = np.full((2, 16), 1, "int32")
    ids[0], ids[1, :2] = np.arange(16) % 8 + 2, [2, 0]
    out = model.generate({"encoder_token_ids": sources[:2], "decoder_token_ids": ids,
                          "decoder_padding_mask": ids != 1})
    np.testing.assert_array_equal(out["decoder_token_ids"][0], ids[0])
    np.testing.assert_array_equal(
        out["decoder_token_ids"][1], model.generate(sources[1:2], 14, [2, 0])[0]
    )
    with pytest.raises(ValueError, match=r"`max_new_tokens` is required with sources given as ids"):
        model.generate(sources, start_token_id=2)
    with pytest.raises(ValueError, match=r"`start_token_id` is required.*start_token_id=None"):
        model.generate(sources, 3)


def _randomize(model, seed=0):
    """Every weight of `model` drawn from N(0, 1): logits far enough apart
    that no choice between tokens or hypotheses hangs on float rounding."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        variable.assign(rng.normal(scale=1.0, size=variable.shape).astype("float32"))
    return model


def _random_gpt(seed=0):
    gpt = GPT(8, 16, 1, 2, 8, 16)
    gpt.build((None, None))
    return _randomize(gpt, seed)


SAMPLERS = [
    ("top_k", dict(sampling="top_k", top_k=5)),  # KerasHub's defaults for the names
    ("top_p", dict(sampling="top_p", top_p=0.1)),
    ("beam", dict(sampling="beam", num_beams=5)),
    ("random", dict(sampling="random")),
    ("greedy", dict(sampling="greedy")),
    (lambda: keras_hub.samplers.TopKSampler(k=2, seed=7, temperature=0.5),
     dict(sampling="top_k", top_k=2, seed=7, temperature=0.5)),
    (lambda: keras_hub.samplers.TopPSampler(p=0.6, seed=4, temperature=2.0),
     dict(sampling="top_p", top_p=0.6, seed=4, temperature=2.0)),
    (lambda: keras_hub.samplers.RandomSampler(seed=5), dict(sampling="random", seed=5)),
    (lambda: keras_hub.samplers.BeamSampler(num_beams=3), dict(sampling="beam", num_beams=3)),
    (lambda: keras_hub.samplers.GreedySampler(), dict(sampling="greedy")),
]


@pytest.fixture(scope="module")
def sampler_gpt():
    """One model for the sampler tests, so that each compiled loop is made
    once; each test compiles it with its own sampler."""
    return _random_gpt()


@pytest.mark.parametrize("sampler, arguments", SAMPLERS, ids=[str(i) for i in range(len(SAMPLERS))])
def test_compile_takes_keras_hub_samplers(sampler_gpt, sampler, arguments):
    """`compile(sampler=...)` sets what `generate` does, as the matching
    arguments would; `generate`'s own arguments take precedence."""
    gpt = sampler_gpt
    prompt = np.array([[1, 2, 3], [4, 5, 6]], "int32")
    seeded = {"seed": 11} if "seed" not in arguments else {}
    expected = gpt.generate(prompt, 6, **{**arguments, **seeded})
    greedy = gpt.generate(prompt, 6, sampling="greedy")
    gpt.compile(optimizer="sgd", sampler=sampler() if callable(sampler) else sampler)
    np.testing.assert_array_equal(gpt.generate(prompt, 6, **seeded), expected)
    # A given `sampling` replaces the sampler.
    np.testing.assert_array_equal(gpt.generate(prompt, 6, sampling="greedy"), greedy)
    if arguments["sampling"] == "top_k":
        # A given argument overrides the sampler's: top_k=1 is greedy.
        np.testing.assert_array_equal(gpt.generate(prompt, 6, top_k=1, seed=3), greedy)


def test_sampled_tokens_follow_the_sampler_seed_and_a_translation_model_takes_one():
    gpt = _random_gpt()
    prompt = np.array([[1, 2, 3]], "int32")
    # Without a sampler (not compiled, or compiled without one): greedy.
    greedy = gpt.generate(prompt, 8, sampling="greedy")
    np.testing.assert_array_equal(gpt.generate(prompt, 8), greedy)
    gpt.compile(optimizer="sgd")
    np.testing.assert_array_equal(gpt.generate(prompt, 8), greedy)
    runs = []
    for seed in (1, 2, 3):
        gpt.compile(sampler=keras_hub.samplers.RandomSampler(seed=seed, temperature=3.0))
        runs.append(gpt.generate(prompt, 8))
    assert len({r.tobytes() for r in runs}) > 1  # the seed reaches the loop
    model = Seq2SeqTransformer(9, 9, 8, 8, num_encoder_layers=1, num_decoder_layers=1,
                               num_heads=2, hidden_dim=8, intermediate_dim=16)
    source = np.array([[3, 4, 5], [6, 7, 8]], "int32")
    expected = model.generate(source, 4, start_token_id=1, sampling="beam", num_beams=2,
                              return_scores=True)
    model.compile(sampler=keras_hub.samplers.BeamSampler(num_beams=2))
    for got, want in zip(model.generate(source, 4, start_token_id=1, return_scores=True),
                         expected):
        np.testing.assert_array_equal(got, want)


class _OwnSampler(keras_hub.samplers.GreedySampler):
    def get_next_token(self, probabilities):
        return keras.ops.argmin(probabilities, axis=-1)


@pytest.mark.parametrize(
    "sampler, message",
    [
        ("contrastive", r"`sampler` must be one of \['beam', 'greedy', 'random', 'top_k', "
                        r"'top_p'\].*sampler='contrastive'"),
        (lambda: keras_hub.samplers.TopPSampler(p=0.5, k=3), r"TopPSampler with k=3"),
        (lambda: keras_hub.samplers.BeamSampler(return_all_beams=True),
         r"return_all_beams=True: pass num_return_sequences"),
        (lambda: keras_hub.samplers.BeamSampler(temperature=0.5), r"temperature=0.5"),
        (lambda: keras_hub.samplers.ContrastiveSampler(), r"must be a name or.*ContrastiveSampler"),
        (lambda: _OwnSampler(), r"not a sampler's own code.*_OwnSampler"),
    ],
    ids=["name", "top_p_k", "all_beams", "beam_temperature", "contrastive", "subclass"],
)
def test_compile_refuses_samplers_the_loop_cannot_run(sampler, message):
    gpt = _random_gpt()
    with pytest.raises(ValueError, match=message):
        gpt.compile(sampler=sampler() if callable(sampler) else sampler)


def test_a_keras_file_loads_compiled_with_its_optimizer_state_and_sampler(tmp_path):
    """`model.save` then `keras.models.load_model`: the model comes back
    compiled (Keras skips a custom `compile` unless the model compiles from
    its config), with the optimizer's trained state and the sampler."""
    gpt = _random_gpt()
    gpt.compile(optimizer="adam", sampler=keras_hub.samplers.TopKSampler(k=3, seed=1))
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 1]], "int32")
    gpt.fit(ids, ids, epochs=2, verbose=0)
    path = str(tmp_path / "gpt.keras")
    gpt.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.compiled
    assert isinstance(loaded.sampler, keras_hub.samplers.TopKSampler)
    assert (loaded.sampler.k, loaded.sampler.seed) == (3, 1)
    np.testing.assert_array_equal(loaded.generate(ids[:, :2], 4), gpt.generate(ids[:, :2], 4))
    saved = [keras.ops.convert_to_numpy(v) for v in gpt.optimizer.variables]
    restored = [keras.ops.convert_to_numpy(v) for v in loaded.optimizer.variables]
    assert len(saved) == len(restored) and int(restored[0]) == 2  # two steps taken
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)
    # Training goes on from there, as it would have without the round trip.
    gpt.train_on_batch(ids, ids)
    loaded.train_on_batch(ids, ids)
    for a, b in zip(gpt.weights, loaded.weights):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b),
                                   rtol=1e-5, atol=1e-6)
    # A name as the sampler, and a model without one.
    model = Seq2SeqTransformer(9, 9, 8, 8, num_encoder_layers=1, num_decoder_layers=1,
                               num_heads=2, hidden_dim=8, intermediate_dim=16)
    model.build()
    model.compile(optimizer="sgd", sampler="beam")
    model.save(path)
    assert keras.models.load_model(path).sampler == "beam"
    bert = BertMaskedLM(vocabulary_size=10, num_layers=1, num_heads=2, hidden_dim=8,
                        intermediate_dim=16, max_sequence_length=8)
    bert.compile(optimizer="sgd")
    bert.save(path)
    assert keras.models.load_model(path).compiled


@pytest.mark.parametrize("stopping", [False, True], ids=["no_stop", "stop_token"])
def test_gpt_generates_from_the_input_dictionary_as_keras_hub_does(gpt_preset, stopping):
    """KerasHub's `generate` on packed inputs (no preprocessor): each row
    continued to the packed width, the dictionary back, its mask `True` up
    to the first stop token; the tokens agree wherever the mask is `True`."""
    folder, task = gpt_preset
    gpt = GPT.from_preset(str(folder))
    packed = task.preprocessor.generate_preprocess(["a b", "c", "b a c c"], sequence_length=9)
    packed = {k: keras.ops.convert_to_numpy(v) for k, v in packed.items()}
    stop = None
    if stopping:  # the first token row 0 generates, so that it stops there
        first = gpt.generate(packed, stop_token_ids=None)["token_ids"]
        stop = [int(first[0, packed["padding_mask"][0].sum()])]
    preprocessor, task.preprocessor = task.preprocessor, None
    try:
        expected = task.generate(packed, stop_token_ids=stop)
    finally:
        task.preprocessor = preprocessor
    expected = {k: keras.ops.convert_to_numpy(v) for k, v in expected.items()}
    got = gpt.generate(packed, stop_token_ids=stop)
    assert set(got) == {"token_ids", "padding_mask"} and got["token_ids"].shape == (3, 9)
    np.testing.assert_array_equal(got["padding_mask"], expected["padding_mask"])
    real = expected["padding_mask"]
    np.testing.assert_array_equal(got["token_ids"][real], expected["token_ids"][real])
    if stop:
        assert not real.all()  # some row stopped early
    # `max_new_tokens` instead: each row's new tokens after its own prompt.
    lengths = packed["padding_mask"].sum(axis=1)
    short = gpt.generate(packed, max_new_tokens=2, stop_token_ids=stop)
    for row, length in enumerate(lengths):
        alone = gpt.generate(packed["token_ids"][row : row + 1, :length], 2, stop_token_ids=stop)
        np.testing.assert_array_equal(short["token_ids"][row, : length + 2], alone[0])


def test_stop_token_ids_auto_is_the_preprocessor_s_end_token(gpt_preset):
    folder, _ = gpt_preset
    gpt = GPT.from_preset(str(folder))
    ids = np.array([[0, 2, 6]], "int32")
    end = gpt.preprocessor.tokenizer.end_token_id
    np.testing.assert_array_equal(
        gpt.generate(ids, 6, stop_token_ids="auto"), gpt.generate(ids, 6, stop_token_ids=[end])
    )
    gpt.preprocessor = None
    with pytest.raises(ValueError, match=r"stop_token_ids=\"auto\".*no preprocessor"):
        gpt.generate(ids, 6, stop_token_ids="auto")


def test_score_is_keras_hub_s(gpt_preset):
    """`score` against KerasHub's `CausalLM.score` on the same weights, in
    both modes, and its errors."""
    folder, task = gpt_preset
    gpt = GPT.from_preset(str(folder))
    ids = np.array([[0, 2, 6, 3, 1], [0, 4, 0, 0, 0]], "int32")
    mask = ids != 0
    mask[:, 0] = True
    targets = np.roll(ids, -1, axis=1)
    for mode, target in [("logits", None), ("loss", targets)]:
        expected = keras.ops.convert_to_numpy(
            task.score(ids, padding_mask=mask, scoring_mode=mode, target_ids=target)
        )
        got = keras.ops.convert_to_numpy(
            gpt.score(ids, padding_mask=mask, scoring_mode=mode, target_ids=target)
        )
        assert got.shape == expected.shape == ((2, 5, 8) if mode == "logits" else (2, 5))
        # At the real positions (what a padded one reads is each model's own).
        np.testing.assert_allclose(got[mask], expected[mask], rtol=1e-4, atol=1e-5)
    for kwargs, message in [
        (dict(scoring_mode="probs"), r"`scoring_mode` must be 'logits' or 'loss'.*'probs'"),
        (dict(scoring_mode="loss"), r"`target_ids` must be given"),
        (dict(layer_intercept_fn=lambda x, i: x), r"`layer_intercept_fn` is not supported"),
    ]:
        with pytest.raises(ValueError, match=message):
            gpt.score(ids, **kwargs)


def test_strip_prompt_returns_the_new_tokens_only(gpt_preset):
    """KerasHub's `strip_prompt`: ids, text and the packed dictionary (the
    last against `GPT2CausalLM.generate(..., strip_prompt=True)`)."""
    folder, task = gpt_preset
    gpt = GPT.from_preset(str(folder))
    # Ids, prompts of different lengths, greedy and beams with scores.
    ids = np.array([[0, 2, 6, 3], [0, 4, 0, 0]], "int32")
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool)
    full = gpt.generate(ids, 3, prompt_padding_mask=mask)
    new = gpt.generate(ids, 3, prompt_padding_mask=mask, strip_prompt=True)
    np.testing.assert_array_equal(new, [full[0, 4:7], full[1, 2:5]])
    beams = dict(sampling="beam", num_beams=2, num_return_sequences=2, return_scores=True)
    (full, scores), (new, new_scores) = (
        gpt.generate(ids, 3, prompt_padding_mask=mask, strip_prompt=strip, **beams)
        for strip in (False, True)
    )
    np.testing.assert_array_equal(new, np.stack([full[0, :, 4:7], full[1, :, 2:5]]))
    np.testing.assert_array_equal(new_scores, scores)
    # The packed dictionary, as KerasHub strips it.
    packed = gpt.preprocessor.generate_preprocess(["a b", "c", "b a c c"], sequence_length=9)
    packed = {k: keras.ops.convert_to_numpy(v) for k, v in packed.items()}
    preprocessor, task.preprocessor = task.preprocessor, None
    try:
        expected = task.generate(packed, stop_token_ids=None, strip_prompt=True)
    finally:
        task.preprocessor = preprocessor
    expected = {k: keras.ops.convert_to_numpy(v) for k, v in expected.items()}
    got = gpt.generate(packed, stop_token_ids=None, strip_prompt=True)
    np.testing.assert_array_equal(got["padding_mask"], expected["padding_mask"])
    real = expected["padding_mask"]
    np.testing.assert_array_equal(got["token_ids"][real], expected["token_ids"][real])
    # Text: the continuation of each prompt, as each prompt alone gives it
    # (weights of scale 1: no choice hangs on rounding).
    _randomize(gpt)
    prompts = ["a b", "c"]
    tokenizer = gpt.preprocessor.tokenizer
    continuations = gpt.generate(prompts, max_new_tokens=3, strip_prompt=True)
    for prompt, continuation in zip(prompts, continuations):
        prompt_ids = _tokenize_with_start(gpt, prompt)
        tail = gpt.generate(prompt_ids[None], 3, stop_token_ids=[tokenizer.end_token_id])[0]
        tail = [t for t in tail[len(prompt_ids):] if t != tokenizer.end_token_id]
        assert continuation == _detokenize(tokenizer, tail)


def _tokenize_with_start(gpt, text):
    packed = gpt.preprocessor.generate_preprocess([text], sequence_length=16)
    ids = keras.ops.convert_to_numpy(packed["token_ids"])[0]
    return ids[keras.ops.convert_to_numpy(packed["padding_mask"])[0].astype(bool)].astype("int32")
