"""bench/decode.py on CPU: its A/B options (--knob: a kernel module's switch, each value a literal of its type;
--only: a subset of the rows), with a clear error for each malformed spec; the rows' float32 references (once an
input set) and fp8_qk's errors on both footings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_decode_sm90 as k90
from pallas_kernels import mla_decode_sm90_narrow as narrow
from tests.mla_jax.helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("decode", folder="bench")


def test_knob_parses_a_switch_and_its_values(bench):
    module, name, values = bench.parse_knob("mla_decode_sm90_narrow.PDL=False, True")
    assert module is narrow and name == "PDL" and values == [False, True]
    _, _, pages = bench.parse_knob("mla_decode_sm90._WORKLIST_MIN_PAGES=2,4")
    assert pages == [2, 4]
    _, _, regs = bench.parse_knob("mla_decode_sm90._REGS_PV8=(232, 232, 40),(224, 224, 56)")
    assert regs == [(232, 232, 40), (224, 224, 56)]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("PDL=True", "expected MODULE.NAME=V1,V2"),
        ("mla_decode_sm90_narrow.PDL", "expected MODULE.NAME=V1,V2"),
        ("no_such_kernel.X=1", "no module pallas_kernels.no_such_kernel"),
        ("mla_decode_sm90.NO_SUCH=1", "has no NO_SUCH"),
        ("mla_decode_sm90_narrow.PDL=True,yes", "'True,yes' is not a comma-separated list of Python literals"),
        ("mla_decode_sm90_narrow.PDL=False,1", "1 is int, PDL is bool"),
    ],
)
def test_knob_names_what_is_wrong(bench, spec, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_knob(spec)


def test_set_knob_retraces(bench, monkeypatch):
    """The switch is read at trace time: set_knob must drop what was compiled with the old value."""
    monkeypatch.setattr(narrow, "PDL", False)  # restored after the test
    seen = []

    @jax.jit
    def f(x):
        seen.append(narrow.PDL)
        return x + 1

    f(jnp.ones(2))
    bench.set_knob(narrow, "PDL", True)
    f(jnp.ones(2))
    assert seen == [False, True]


def test_knob_checks_the_values_not_the_modules_own(bench):
    assert bench.knob_values_to_check([False, True], False) == [True]
    assert bench.knob_values_to_check([0, 128, 192], 0) == [128, 192]
    assert bench.knob_values_to_check([True], True) == [True]  # only the module's own: checked all the same


def test_only_selects_rows(bench):
    assert bench.parse_only("fp8_qk=True,schedule=grid") == {"fp8_qk": True, "schedule": "grid"}
    assert bench.parse_only("") == {}
    with pytest.raises(ValueError, match="'fp8_qk' is not KEY=VALUE"):
        bench.parse_only("fp8_qk")


def test_reference_is_computed_once_an_input_set(bench, monkeypatch):
    calls = []
    real = bench.md.mla_decode_reference

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(bench.md, "mla_decode_reference", counting)
    args = bench.make_inputs(jax.random.key(0), 2, 1, 16, 128, "bf16")
    ref, ref_lse = bench.reference_f32(args)
    again = bench.reference_f32(args)
    assert len(calls) == 1 and again[0] is ref
    bench.reference_f32(bench.make_inputs(jax.random.key(1), 2, 1, 16, 128, "bf16"))
    assert len(calls) == 2 and np.isfinite(ref).all()


def test_fp8_qk_rows_report_both_footings(bench):
    """A one-term fp8_qk row errs nothing against the reference on its own rounded q (FlashMLA's footing) and
    something against the exact q; the terms each kind of row multiplies."""
    args = bench.make_inputs(jax.random.key(2), 2, 1, 64, 128, "fp8")
    q, cache, bt, sl, ks = args

    def one_term(*a):  # what a one-term kernel computes, exactly
        return bench.md.mla_decode_reference(
            k90.fp8_qk_reference_q(q, split=False), cache, bt, sl, scale=bench.SCALE, kv_scale=ks
        )

    err = bench.error_vs_f32(one_term, args, q_terms=1)
    assert err["rel_err_own_q"] == 0 and err["lse_err_own_q"] == 0 and err["rel_err"] > 1e-3
    assert set(bench.error_vs_f32(one_term, args)) == {"rel_err", "lse_err"}
    assert bench.fp8_qk_terms(128, {}) == 0
    assert bench.fp8_qk_terms(128, {"fp8_qk": True}) == 1
    assert bench.fp8_qk_terms(128, {"fp8_qk": True, "fp8_q_split": True}) == 2
    assert bench.fp8_qk_terms(16, {"fp8_qk": True}) == 1  # the narrow kernel


def test_sweep_gives_the_fp8_pv_kernel_even_rings_only(bench):
    """The sweep's fp8_qk variants at 128 heads (the fp8 P.V kernel: page pairs) hold an even fp8 ring, each one the
    kernel accepts; at 16 heads (the narrow kernel) the V ring's depth is swept too."""
    wide = [v for v in bench.sm90_sweep_variants("fp8", 4, 128) if v.get("fp8_qk")]
    assert wide and all(v["fp8_stages"] % 2 == 0 for v in wide)
    narrow = [v for v in bench.sm90_sweep_variants("fp8", 4, 16) if v.get("fp8_qk")]
    assert {"fp8_qk": True, "num_stages": 2, "fp8_stages": 1} in narrow
