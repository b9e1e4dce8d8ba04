# Copyright © 2026 turboquant_mlx contributors.

"""The codec of one layer: what turns a head vector into codes and back.

A :class:`Codec` holds the layer's rotation (seeded, shared by keys and values), the
Lloyd–Max codebooks for the key and value bit widths at the stored head dim, and the
head dims (the model's, and the stored one: the next multiple of 32 where the kernels
do not take the model's; see :func:`~turboquant_mlx._common.padded_head_dim`). It is
immutable once built; the single-sequence and the batch cache build it the same way at
their first update, and a compressed buffer (:mod:`turboquant_mlx.buffer`) is written
and read with it.
"""

from . import codebook, ops
from ._common import _PREFIX, padded_head_dim
from .rotation import Rotation

__all__ = ["Codec"]


class Codec:
    """Rotation + codebooks of one layer for keys of ``key_bits`` and values of
    ``value_bits`` bits per coordinate, at the model head dim ``head_dim``.

    Raises:
        ValueError: a head dim the cache cannot store, naming it and the bit width.
    """

    def __init__(self, head_dim: int, key_bits: int, value_bits: int, seed: int):
        try:
            stored = padded_head_dim(head_dim)
        except ValueError as e:
            raise ValueError(f"{_PREFIX} {e}.") from None
        words = []
        for bits in (key_bits, value_bits):
            try:
                words.append(ops.words_per_token(stored, bits))
            except Exception as e:
                raise ValueError(
                    f"{_PREFIX} head_dim {head_dim} is not supported at {bits} bits: {e}"
                ) from e
        self.model_dim = int(head_dim)
        self.head_dim = stored  # the stored vectors' dim
        self.key_bits = key_bits
        self.value_bits = value_bits
        self.key_words, self.value_words = words  # packed uint32 words per token
        self.rotation = Rotation(stored, seed)
        self.key_centroids = codebook.centroids(stored, key_bits)
        self.value_centroids = codebook.centroids(stored, value_bits)

    @property
    def padded(self) -> bool:
        """Whether vectors are stored zero-padded (``head_dim > model_dim``)."""
        return self.head_dim != self.model_dim

    def token_bytes(self) -> int:
        """Bytes one token of one head takes: key and value codes, two fp16 scales."""
        return 4 * (self.key_words + self.value_words) + 2 * 2

    def __deepcopy__(self, memo):
        return self  # immutable: copies of a cache share it

    def __copy__(self):
        return self

    def __repr__(self):
        return (
            f"Codec(head_dim={self.model_dim}, stored={self.head_dim}, "
            f"key_bits={self.key_bits}, value_bits={self.value_bits}, "
            f"seed={self.rotation.seed})"
        )
