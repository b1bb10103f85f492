"""The functional core of attention: score -> mask -> normalize -> dropout -> sum.

Shape legend: `...` any leading axes (batch, heads), `T` query length, `S` key
length, `Dq`/`Dk`/`Dv` query, key and value feature sizes.

The public face of the attention core (`keras_attention.kernels`), whose
explicit kernel these functions are: `attention` computes
`normalize(scorer(q, K), mask) @ V` on tensors of any leading axes, and the
layers reach the same arithmetic (or a fused kernel that gives the same
results) through `keras_attention.kernels.attention`.
"""

from keras_attention.kernels.explicit import attention
from keras_attention.kernels.explicit import mask_fill_value
from keras_attention.kernels.explicit import masked_softmax
from keras_attention.kernels.explicit import nonfinite_positions
from keras_attention.kernels.explicit import poison_outputs
from keras_attention.kernels.explicit import sanitize_nonfinite
from keras_attention.kernels.explicit import softmax_dtype

__all__ = [
    "attention",
    "mask_fill_value",
    "masked_softmax",
    "nonfinite_positions",
    "poison_outputs",
    "sanitize_nonfinite",
    "softmax_dtype",
]
