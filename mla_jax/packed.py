"""A step's host-built inputs (batch metadata, sampling arrays) as one int32 buffer.

The metadata and sampling pytrees hold ~15 small numpy arrays; sent field by field, each is its own host→device
transfer and its own argument of the jitted step. Packed, they are one transfer and one argument: `Packed.of`
concatenates the leaves' 4-byte words on the host, and `unpack` (inside jit) slices them back at static offsets
and bitcasts each to its dtype. The layout (tree structure, shapes, dtypes) is static pytree data, so a
`Packed` selects its compiled step exactly as the unpacked tree would.

Each leaf starts at a multiple of `ALIGN_WORDS` (256 bytes): XLA passes a slice at an offset as a view of the
buffer, and Mosaic GPU kernels refuse inputs that are not 256-byte aligned (the H200 run of 2026-12-01: "Input
buffer 2 is not 256-byte aligned" in the Hopper decode of a 128-head engine step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_WORD_DTYPES = ("int32", "uint32", "float32")
ALIGN_WORDS = 64  # 256 bytes: the alignment Mosaic GPU kernels require of their inputs


def _padded(n: int) -> int:
    return -(-n // ALIGN_WORDS) * ALIGN_WORDS


@jax.tree_util.register_pytree_node_class
class Packed:
    """`buf` i32[n] holds the leaves of a pytree; `layout` = (treedef, ((shape, dtype name), ...))."""

    def __init__(self, buf: Any, layout: tuple):
        self.buf, self.layout = buf, layout

    @staticmethod
    def of(tree: Any) -> "Packed":
        """Packs a pytree of numpy arrays (int32, uint32, float32 or bool) into one host buffer."""
        leaves, treedef = jax.tree.flatten(tree)
        words, spec = [], []
        for i, leaf in enumerate(leaves):
            a = np.asarray(leaf)
            name = a.dtype.name
            if name == "bool":
                a = a.astype(np.int32)
            elif name not in _WORD_DTYPES:
                raise TypeError(f"cannot pack leaf {i} of dtype {name} (int32, uint32, float32 or bool only)")
            words.append(a.reshape(-1).view(np.int32))  # reshape copies a non-contiguous leaf
            spec.append((a.shape, name))
        # one zeroed buffer filled in place (np.pad and np.concatenate per leaf took ~3x the host time)
        buf = np.zeros(sum(_padded(w.size) for w in words), np.int32)
        off = 0
        for w in words:
            buf[off : off + w.size] = w
            off += _padded(w.size)
        return Packed(buf, (treedef, tuple(spec)))

    def unpack(self) -> Any:
        """The original pytree (inside jit: static slices of the one buffer)."""
        treedef, spec = self.layout
        leaves, off = [], 0
        for shape, name in spec:
            n = int(np.prod(shape, dtype=np.int64))
            w = self.buf[off : off + n].reshape(shape)
            off += _padded(n)
            if name == "bool":
                w = w != 0
            elif name != "int32":
                w = jax.lax.bitcast_convert_type(w, jnp.dtype(name))
            leaves.append(w)
        return jax.tree.unflatten(treedef, leaves)

    def tree_flatten(self):
        return (self.buf,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)
