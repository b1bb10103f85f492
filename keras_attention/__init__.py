"""keras_attention: attention layers for Keras 3 on TensorFlow, JAX and PyTorch.

Modules:
    masking: boolean mask helpers (True = may attend).
    ops: `masked_softmax` and the functional core `attention`.
    scoring: scoring functions `s(q, k)`.
    layers: attention layers, positions, feed-forward networks and
        Transformer blocks.
    losses: the REINFORCE objective of hard attention.
    models: models built from the layers (GPT, Seq2SeqTransformer,
        BertMaskedLM, BertClassifier).
    visualization: capture attention weights and plot them.
"""

from keras_attention import layers
from keras_attention import losses
from keras_attention import masking
from keras_attention import models
from keras_attention import ops
from keras_attention import scoring
from keras_attention import visualization
from keras_attention._version import __version__

__all__ = ["layers", "losses", "masking", "models", "ops", "scoring", "visualization", "__version__"]
