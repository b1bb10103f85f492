"""Functions that take the arguments of another, with its signature.

A stack's `call` takes its block's call arguments, a model's constructor
its encoder's, `SoftAttention.call` some of `MultiHeadAttention.call`'s
(`selection`), `HardAttention.call` `SoftAttention`'s and one more: the
argument list is written once, on the source, and the forwarding function
gets the same public signature (`inspect.signature`, `help`,
`typing.get_type_hints`, and Keras, which reads the `training` and `mask`
arguments of `call` from it).
"""

import functools
import inspect
import typing


def takes_arguments_of(source, adding=None, before=None):
    """Decorator: the decorated function takes the arguments of `source`.

    A call is bound to `source`'s signature (an unknown, missing or doubled
    argument is the `TypeError` that `source` itself would raise), the
    defaults are filled in, and the decorated function is called with every
    argument by keyword; the keyword arguments that `source`'s `**kwargs`
    would collect come by their own names. The decorated function's
    `__signature__` and `__annotations__` are `source`'s.

    A function whose arguments are `source`'s and a few more (a layer that
    returns one thing more than its base) names the more in `adding`, a
    function whose parameters are written as they are to stand in the
    derived signature.

    Args:
        source: the function whose signature is taken, e.g.
            `TransformerDecoderBlock.call` (with its `self`).
        adding: optional function whose parameters are added to `source`'s.
        before: with `adding`, the name of the parameter of `source` they
            go before; None: after the last parameter but a `**kwargs`.

    Returns:
        The decorator.
    """
    signature = inspect.signature(source)
    # Resolved from `source`'s module, so that they name types wherever read.
    hints = typing.get_type_hints(source)
    if adding is not None:
        signature = _inserted(signature, inspect.signature(adding), before)
        hints.update(typing.get_type_hints(adding))
        # In the signature's order, as `typing.get_type_hints` gives them.
        order = [*signature.parameters, "return"]
        hints = {name: hints[name] for name in order if name in hints}
    if any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values()):
        raise TypeError(f"`{source.__qualname__}` takes `*args`: it cannot be forwarded by name")
    var_keyword = next(
        (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
    )

    def decorate(function):
        @functools.wraps(function)
        def forwarding(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as error:
                raise TypeError(f"{function.__qualname__}(): {error}") from None
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            if var_keyword is not None:
                arguments.update(arguments.pop(var_keyword))
            return function(**arguments)

        # `functools.wraps` points `__wrapped__` at `function`, whose own
        # signature `inspect` would then report: the public one is `source`'s.
        del forwarding.__wrapped__
        forwarding.__signature__ = signature
        forwarding.__annotations__ = dict(hints)
        return forwarding

    return decorate


def selection(source, names):
    """A function that only declares `source`'s parameters `names`, in that
    order, with their defaults and annotations: for `takes_arguments_of`,
    where a function takes some of another's arguments, in its own order.

    Args:
        source: the function whose parameters are taken.
        names: the names of the parameters, in the order they go in.

    Returns:
        A function with that signature and those annotations; calling it
        raises `TypeError`.
    """
    signature = inspect.signature(source)
    unknown = [name for name in names if name not in signature.parameters]
    if unknown:
        raise TypeError(f"`{source.__qualname__}` has no parameters {unknown}")
    hints = typing.get_type_hints(source)
    qualname = f"selection({source.__qualname__})"

    def selected(*args, **kwargs):
        raise TypeError(f"{qualname} declares a signature; it is not called")

    selected.__qualname__ = selected.__name__ = qualname
    # `Signature` checks the order (defaults, keyword-only, `**kwargs` last).
    selected.__signature__ = signature.replace(
        parameters=[signature.parameters[name] for name in names]
    )
    selected.__annotations__ = {
        name: hints[name] for name in (*names, "return") if name in hints
    }
    return selected


def _inserted(signature, added, before):
    """`signature` with the parameters of `added` before the parameter named
    `before` (None: before a `**kwargs`, else at the end)."""
    parameters = list(signature.parameters.values())
    names = [p.name for p in parameters]
    if before is None:
        ends_in_kwargs = parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD
        before = names[-1] if ends_in_kwargs else None
    if before is None:
        at = len(parameters)
    elif before in names:
        at = names.index(before)
    else:
        raise TypeError(f"`before` names no parameter of {signature}. Received: {before!r}")
    doubled = set(added.parameters) & set(signature.parameters)
    if doubled:
        raise TypeError(f"Parameters added twice to {signature}: {sorted(doubled)}")
    # `Signature` checks the order (defaults, keyword-only, `**kwargs` last).
    return signature.replace(
        parameters=parameters[:at] + list(added.parameters.values()) + parameters[at:]
    )
