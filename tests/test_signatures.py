"""`_signatures.takes_arguments_of`, and the public signatures derived with it."""

import inspect
import types
import typing

import keras
import numpy as np
import pytest

from keras_attention import _signatures
from keras_attention.layers import FeedForward
from keras_attention.layers import HardAttention
from keras_attention.layers import MultiHeadAttention
from keras_attention.layers import SelfAttention
from keras_attention.layers import SoftAttention
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.layers import TransformerDecoderStack
from keras_attention.layers import TransformerEncoderBlock
from keras_attention.layers import TransformerEncoderStack
from keras_attention.models import BertEncoder
from keras_attention.models import BertMaskedLM
from keras_attention.models import GPT
from keras_attention.models import Seq2SeqTransformer


def _source(a: int, b: str = "b", *, c: float = 1.0, **kwargs: typing.Any) -> tuple:
    return a, b, c, kwargs


@_signatures.takes_arguments_of(_source)
def _forwarding(a, b, c, **rest):
    return a, b, c, rest


def test_signature_and_hints_are_the_source_s():
    assert inspect.signature(_forwarding) == inspect.signature(_source)
    assert typing.get_type_hints(_forwarding) == typing.get_type_hints(_source)
    assert _forwarding.__name__ == "_forwarding"


def test_arguments_arrive_by_name_with_defaults_and_keyword_extras():
    assert _forwarding(1) == (1, "b", 1.0, {})
    assert _forwarding(1, "x", c=2.0, name="n") == (1, "x", 2.0, {"name": "n"})


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((), {}, r"_forwarding\(\): missing a required argument: 'a'"),
        ((1, "x", 3.0), {}, r"too many positional arguments"),
        ((1,), {"a": 2}, r"multiple values for argument 'a'"),
    ],
)
def test_bad_arguments_are_type_errors(args, kwargs, message):
    with pytest.raises(TypeError, match=message):
        _forwarding(*args, **kwargs)


def test_a_source_with_star_args_is_refused():
    def source(*args):
        return args

    with pytest.raises(TypeError, match=r"takes `\*args`"):
        _signatures.takes_arguments_of(source)


def _added(d: bytes = b"", *, e: int = 0):
    return d, e


@_signatures.takes_arguments_of(_source, adding=_added, before="c")
def _forwarding_more(a, b, c, d, e, **rest):
    return a, b, c, d, e, rest


def test_added_parameters_stand_where_named_with_their_hints():
    expected = (
        "(a: int, b: str = 'b', d: bytes = b'', *, e: int = 0, c: float = 1.0, "
        "**kwargs: Any) -> tuple"
    )
    assert str(inspect.signature(_forwarding_more)) == expected
    hints = typing.get_type_hints(_forwarding_more)
    assert list(hints) == ["a", "b", "d", "e", "c", "kwargs", "return"]
    assert hints["d"] is bytes
    assert _forwarding_more(1, "x", b"y", e=2, name="n") == (1, "x", 1.0, b"y", 2, {"name": "n"})


def test_added_parameters_go_before_kwargs_or_at_the_end_by_default():
    def ends_in_kwargs(self, a=0, **kwargs):
        return a

    def plain(self, a=0):
        return a

    for source, names in (
        (ends_in_kwargs, ["self", "a", "z", "kwargs"]),
        (plain, ["self", "a", "z"]),
    ):
        derived = _signatures.takes_arguments_of(source, adding=lambda z=1: None)(plain)
        assert list(inspect.signature(derived).parameters) == names


@pytest.mark.parametrize(
    "adding, before, message",
    [
        (lambda d=0: None, "nothing", r"`before` names no parameter .* Received: 'nothing'"),
        (lambda b=0: None, None, r"Parameters added twice .*\['b'\]"),
    ],
)
def test_bad_added_parameters_are_refused(adding, before, message):
    with pytest.raises(TypeError, match=message):
        _signatures.takes_arguments_of(_source, adding=adding, before=before)


def test_added_parameters_out_of_order_are_refused():
    with pytest.raises(ValueError, match=r"non-default argument follows default argument"):
        _signatures.takes_arguments_of(_source, adding=lambda d: None, before="c")


def test_a_selection_declares_the_named_parameters_in_their_new_order():
    def source(x: int, y: str = "y", z: float = 0.0, w=None) -> tuple:
        return x, y, z, w

    selected = _signatures.selection(source, ("x", "z", "y"))
    assert str(inspect.signature(selected)) == "(x: int, z: float = 0.0, y: str = 'y') -> tuple"
    assert typing.get_type_hints(selected) == {"x": int, "z": float, "y": str, "return": tuple}
    with pytest.raises(TypeError, match=r"declares a signature"):
        selected(a=1)
    with pytest.raises(TypeError, match=r"has no parameters \['z'\]"):
        _signatures.selection(_source, ("a", "z"))
    with pytest.raises(ValueError, match=r"non-default argument follows default argument"):
        _signatures.selection(_source, ("b", "a"))


def test_soft_attention_takes_multi_head_attention_s_arguments_but_the_cache():
    mha = inspect.signature(MultiHeadAttention.call).parameters
    soft = inspect.signature(SoftAttention.call).parameters
    assert set(mha) - set(soft) == {"cache", "cache_update_index"}
    assert all(soft[name] == mha[name] for name in soft)
    assert list(soft)[-3:] == ["use_causal_mask", "return_attention_scores", "training"]


def test_hard_attention_takes_soft_attention_s_arguments_and_return_log_prob():
    soft = list(inspect.signature(SoftAttention.call).parameters.values())
    hard = list(inspect.signature(HardAttention.call).parameters.values())
    assert [p.name for p in hard] == [p.name for p in soft[:-1]] + ["return_log_prob", "training"]
    assert hard[:-2] == soft[:-1] and hard[-1] == soft[-1]
    assert hard[-2].default is False and hard[-2].annotation is bool
    # The output specs bind the call's arguments as `call` does.
    query, value = keras.Input((5, 8)), keras.Input((7, 8))
    specs = HardAttention(selection="argmax")(
        query, value, return_attention_scores=True, return_log_prob=True
    )
    assert [tuple(x.shape) for x in specs] == [
        (None, 5, 8), (None, 5, 7), (None, 5, 7), (None,), (None,)
    ]


def test_soft_and_hard_attention_bind_positional_arguments_as_their_signatures_say():
    x = np.ones((1, 2, 4), "float32")
    mask = np.array([[True, False]])
    for layer in (SoftAttention(), HardAttention(selection="argmax")):
        layer(x, x)  # built: `call` is called directly below
        # Keras takes only tensors by position; `call` itself takes them all.
        positional = layer.call(x, x, None, None, mask, None, None, False, True)
        by_name = layer(x, x, value_mask=mask, return_attention_scores=True)
        for a, b in zip(positional, by_name):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b))
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'quary_mask'"):
            layer.call(x, x, quary_mask=mask)


@pytest.mark.parametrize("layer", [FeedForward, SelfAttention])
def test_layers_of_dense_sublayers_end_with_the_dense_layer_arguments(layer):
    from keras_attention import _keras_objects

    shared = list(inspect.signature(_keras_objects.dense_layer_arguments).parameters.values())
    own = list(inspect.signature(layer.__init__).parameters.values())
    assert own[0] == shared[0] and own[-len(shared) + 1:] == shared[1:]
    assert inspect.signature(layer.__init__).return_annotation is None
    hints = typing.get_type_hints(layer.__init__)
    assert hints["kernel_initializer"] == typing.get_type_hints(
        _keras_objects.dense_layer_arguments
    )["kernel_initializer"]


@pytest.mark.parametrize("model", [GPT, BertEncoder, Seq2SeqTransformer])
def test_models_end_with_attention_dropout_seed_and_the_base_arguments(model):
    from keras_attention.models import _model_arguments

    names = list(inspect.signature(model.__init__).parameters)
    assert names[0] == "self" and names[-3:] == ["attention_dropout", "seed", "kwargs"]
    hints = typing.get_type_hints(model.__init__)
    assert hints["attention_dropout"] == float | None and hints["return"] is type(None)
    with pytest.raises(ValueError, match=r"`hidden_dim` .* divisible by `num_heads`"):
        _model_arguments.store_sizes(types.SimpleNamespace(), 3, 8, 16, 0.0, num_layers=1)
    with pytest.raises(ValueError, match=r"`num_layers` must be a positive integer"):
        _model_arguments.store_sizes(types.SimpleNamespace(), 2, 8, 16, 0.0, num_layers=0)


@pytest.mark.parametrize(
    "derived, source",
    [
        (TransformerEncoderStack.call, TransformerEncoderBlock.call),
        (TransformerDecoderStack.call, TransformerDecoderBlock.call),
        (BertMaskedLM.__init__, BertEncoder.__init__),
    ],
)
def test_derived_public_signatures_equal_their_sources(derived, source):
    assert inspect.signature(derived) == inspect.signature(source)
    assert typing.get_type_hints(derived) == typing.get_type_hints(source)


def test_a_stack_call_with_an_unknown_argument_is_a_type_error():
    stack = TransformerEncoderStack(num_layers=1, intermediate_dim=8, num_heads=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'paddding_mask'"):
        stack.call(None, paddding_mask=None)


def test_a_model_with_an_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match=r"BertMaskedLM.__init__\(\): missing a required"):
        BertMaskedLM(50, num_layers=1)


def test_shared_docstring_pieces_are_filled_in_at_any_indentation():
    from keras_attention import _docs

    text = "Head.\n\n    Call arguments:\n        {position_call_arguments}\n    {unknown}\n"
    filled = _docs.fill(text)
    assert "        start_index: int" in filled
    assert "            each element. Overrides `start_index`." in filled
    assert "{unknown}" in filled  # not a piece: left as it is


def test_public_docstrings_hold_no_unfilled_piece():
    import keras_attention
    from keras_attention import _docs

    for module in (keras_attention.layers, keras_attention.models, keras_attention.scoring):
        for name in module.__all__:
            doc = getattr(getattr(module, name), "__doc__", None) or ""
            for piece in _docs.PIECES:
                assert "{" + piece + "}" not in doc, (name, piece)
