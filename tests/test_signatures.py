"""`_signatures.takes_arguments_of`, and the public signatures derived with it."""

import inspect
import typing

import pytest

from keras_attention import _signatures
from keras_attention.layers import TransformerDecoderBlock
from keras_attention.layers import TransformerDecoderStack
from keras_attention.layers import TransformerEncoderBlock
from keras_attention.layers import TransformerEncoderStack
from keras_attention.models import BertEncoder
from keras_attention.models import BertMaskedLM


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
