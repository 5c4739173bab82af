"""`Packed`: a step's metadata and sampling arrays as one buffer round-trip exactly, inside jit too."""

import jax
import numpy as np
import pytest

from mla_jax.metadata import ScheduledRequest, build_metadata
from mla_jax.packed import ALIGN_WORDS, Packed
from mla_jax.sampling import SamplingArrays, SamplingParams


def _equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bit-exact: NaN payloads and -0.0 too


def test_round_trip_bits_inside_jit():
    tree = dict(
        f=np.array([[1.5, -0.0], [np.nan, np.inf]], np.float32),
        u=np.array([0, 2**32 - 1], np.uint32),
        i=np.arange(-3, 4, dtype=np.int32),
        s=np.int32(7) + np.zeros((), np.int32),
        b=np.array([True, False, True]),
        e=np.zeros((0, 4), np.int32),
        t=np.arange(6, dtype=np.float32).reshape(2, 3).T,  # not contiguous
    )
    packed = Packed.of(tree)
    assert len(jax.tree.leaves(packed)) == 1 and packed.buf.dtype == np.int32
    _equal(packed.unpack(), tree)
    _equal(jax.jit(lambda p: p.unpack())(jax.device_put(packed)), tree)


def test_step_inputs_are_one_transfer():
    reqs = [ScheduledRequest([1, 2, 3], 0, [1]), ScheduledRequest([4], 5, [2, 3])]
    md, _ = build_metadata(reqs, page_size=4, num_pages=8, reorder_batch_threshold=1)
    sp = SamplingArrays.build([SamplingParams(temperature=0.7, top_p=0.9, seed=3), None], [3, 6], md.shape.num_logits)
    packed = Packed.of((md, sp))
    assert len(jax.tree.leaves(packed)) == 1
    assert len(jax.tree.leaves((md, sp))) > 10  # what it replaces: a transfer per field
    _equal(jax.jit(lambda p: p.unpack())(packed), (md, sp))
    # the static parts (BatchShape, sampling flags) select the compiled step, as unpacked
    other = Packed.of((md, SamplingArrays.build([None, None], [0, 0], md.shape.num_logits)))
    assert jax.tree.structure(packed) != jax.tree.structure(other)


def test_unsupported_dtype_named():
    with pytest.raises(TypeError, match="leaf 1 of dtype int64"):
        Packed.of([np.zeros(2, np.int32), np.zeros(2, np.int64)])


def test_leaves_start_at_256_byte_boundaries():
    """Mosaic GPU kernels refuse inputs that are not 256-byte aligned, and XLA passes a leaf as a view of the
    buffer: every leaf starts at a multiple of ALIGN_WORDS words, its padding zero."""
    tree = [np.arange(3, dtype=np.int32), np.full(70, 9, np.int32), np.zeros(0, np.int32), np.ones(1, np.float32)]
    packed = Packed.of(tree)
    assert ALIGN_WORDS * 4 == 256 and packed.buf.size == 4 * ALIGN_WORDS
    starts = [0, ALIGN_WORDS, 3 * ALIGN_WORDS, 3 * ALIGN_WORDS]
    for a, s in zip(tree, starts):
        assert packed.buf[s : s + a.size].tobytes() == a.tobytes()
    assert not packed.buf[3:ALIGN_WORDS].any() and not packed.buf[ALIGN_WORDS + 70 : 3 * ALIGN_WORDS].any()
    _equal(packed.unpack(), tree)
