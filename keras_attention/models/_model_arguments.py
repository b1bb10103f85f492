"""What the constructors of the Transformer models (`GPT`, `BertEncoder`,
`Seq2SeqTransformer`) share, written once: the arguments they end with, and
the sizes every one of them takes, checked and kept.
"""

from typing import Any

from keras_attention import _signatures
from keras_attention import _validation


def ends_with(
    self,
    attention_dropout: float | None = None,
    seed: int | None = None,
    **kwargs: Any,
) -> None:
    """The arguments every model's constructor ends with (the docstrings'
    `{model_attention_dropout_and_seed}` piece), the base model's last.

    A model's constructor takes them after its own (`takes_arguments`).
    """


def takes_arguments(own):
    """Decorator: a model's constructor takes the arguments of `own` (a
    function of the model's own arguments), then `ends_with`'s."""
    return _signatures.takes_arguments_of(ends_with, adding=own, before="attention_dropout")


def store_sizes(model, num_heads, hidden_dim, intermediate_dim, dropout, **sizes):
    """Checks the sizes a model's constructor takes and sets each as the
    model's attribute of its name: first `sizes` (positive ints, in their
    order: vocabulary sizes, lengths, layer counts), then the sizes of every
    model, positive ints `num_heads`, `hidden_dim` (divisible by
    `num_heads`) and `intermediate_dim`, and the rate `dropout`."""
    check = _validation.check_positive_int
    for name, value in sizes.items():
        setattr(model, name, check(name, value))
    model.num_heads = check("num_heads", num_heads)
    model.hidden_dim = check("hidden_dim", hidden_dim)
    model.intermediate_dim = check("intermediate_dim", intermediate_dim)
    _validation.check_divisible("hidden_dim", model.hidden_dim, "num_heads", model.num_heads)
    model.dropout = _validation.check_rate("dropout", dropout)
