"""pallas_kernels.mla_decode_sm90 (Hopper, Mosaic GPU) against the float32 reference.

CPU: the kernel runs under the Mosaic GPU interpreter (TMA, mbarriers, wgmma and the three
warpgroups simulated; its happens-before race detector on), and it is lowered for sm_90 (Mosaic
GPU's Python passes: layout inference, wgmma/TMA checks, the shared-memory budget). GPU (-m gpu):
the real kernel against the reference.

Inputs as in test_mla_decode.py (its `make_inputs`): fresh random numbers; every cache row no query
attends to is NaN (unused pages, the tail of each request's last page, pages that block-table
padding points to), q rows with seq_len 0 are NaN; the interpreter fills fresh shared memory with
NaN too.

Tolerances (bf16 operands, f32 accumulation; out rounded to q.dtype):
  bf16 and fp8 cache: |out - ref| <= 2e-2 + 2e-2 |ref|, lse within 1e-3 (interpreter), 1e-2 (GPU).

The interpreter runs each warpgroup as a jitted program that blocks in host callbacks at barriers;
XLA's CPU runtime has one worker per core (2 on CI), so 3 warpgroups deadlock unless NPROC (read by
XLA when it creates the CPU client) allows more: it is set below, before any test touches JAX.
"""
from __future__ import annotations

import os

os.environ.setdefault("NPROC", "8")  # >= 3 XLA CPU workers for the interpreter's 3 warpgroups

import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

from pallas_kernels import mla_decode, mla_decode_sm90 as k90  # noqa: E402
from tests.pallas_kernels.test_mla_decode import SCALE, assert_close, make_inputs  # noqa: E402

_NPROC_IN_TIME = (not xla_bridge.backends_are_initialized()
                  or int(os.environ.get("NPROC", "0") or 0) >= 4)
L, R, G = 512, 64, 64


def run_interpreted(q, cache, bt, sl, ks, **kw):
  """The one helper that touches interpreter internals (private API: race state and reset)."""
  if not _NPROC_IN_TIME:
    pytest.skip("JAX's CPU client was created before NPROC was raised: the interpreter's 3 "
                "warpgroups would deadlock on 2 workers (set NPROC=8 in tests/conftest.py)")
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  try:
    out, lse = k90.mla_decode_sm90(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=L,
                                   interpret=params, **kw)
    out, lse = jax.block_until_ready((out, lse))
  except Exception:
    ipc.reset_gpu_interpret_mode_state()  # the interpreter's shared state survives a failure
    raise
  assert not ipc.get_races().races_found, "the interpreter's race detector fired"
  return out, lse


CASES = {
    # name: (make_inputs kwargs, kernel kwargs)
    # 3 requests, ragged (2 pages + 22 rows, empty, exactly 1 page), 2 splits: f32 partials + merge.
    "n16_ragged_empty_2splits_bf16": (
        dict(b=3, nq=1, n=16, max_pages=3, lens=[150, 0, 64]), dict(num_kv_splits=2)),
    # Two head tiles, the second with 16 real rows (only those move), one split (final bf16
    # output staged directly), a 1-token request.
    "n80_two_tiles_tail16_1split_bf16": (
        dict(b=2, nq=1, n=80, max_pages=2, lens=[100, 1]), dict(num_kv_splits=1)),
    # Spec decode: Q=3 causal rows folded into one padded tile, 1-stage ring (reuse every page).
    "q3_causal_n16_stages1_bf16": (
        dict(b=2, nq=3, n=16, max_pages=3, lens=[140, 2], causal=True),
        dict(num_kv_splits=1, num_stages=1)),
    # fp8 cache, Q=2 causal, N=64 (2 tiles), 2 splits over 3 pages; 1-token request.
    "fp8_q2_causal_n64_2splits": (
        dict(b=2, nq=2, n=64, max_pages=3, lens=[170, 1], causal=True, cache_dtype="fp8"),
        dict(num_kv_splits=2)),
    # Work list over 2 "SMs": the 10-page request is cut in two pieces (merged by LSE), the
    # 1-page one stays whole (final output written directly), the empty one writes zeros / -inf.
    # N=20: 24 rows move (q padded by 4 zero rows).
    "worklist_split_whole_empty_n20_bf16": (
        dict(b=3, nq=1, n=20, max_pages=12, lens=[600, 64, 0]),
        dict(schedule="worklist", num_sms=2)),
    # Work list, fp8, Q=2 causal x 64 heads = 2 tiles per request, 4 "SMs": tiles of 11 pages
    # split in two, 3-page tiles whole; causal rows end inside the first piece of the split.
    "worklist_fp8_q2_causal_n64": (
        dict(b=2, nq=2, n=64, max_pages=12, lens=[700, 130], causal=True, cache_dtype="fp8"),
        dict(schedule="worklist", num_sms=4)),
    # fp8 with f16 wgmma operands (native e4m3 -> f16 cast), a 1-deep fp8 ring.
    "fp8_f16_compute_1stage": (
        dict(b=2, nq=1, n=16, max_pages=4, lens=[200, 64], cache_dtype="fp8"),
        dict(fp8_compute="float16", fp8_stages=1, num_kv_splits=1)),
    # fp8 QK^T (fp8 q, per-row scale) on the fp8 ring, V cast alone: Q=2 causal, 2 tiles, 2 splits,
    # the default 3-deep fp8 ring; a 1-token request.
    "fp8_qk_q2_causal_n64_2splits": (
        dict(b=2, nq=2, n=64, max_pages=4, lens=[170, 1], causal=True, cache_dtype="fp8"),
        dict(fp8_qk=True, num_kv_splits=2)),
    # fp8 QK^T with a 1-deep fp8 ring (every page waits for WG0's QK^T and the cast to free the
    # slot) and a 2-deep V ring; 5 pages, a partial last one, N=16.
    "fp8_qk_fp8stages1_n16": (
        dict(b=2, nq=1, n=16, max_pages=5, lens=[300, 64], cache_dtype="fp8"),
        dict(fp8_qk=True, fp8_stages=1, num_stages=2, num_kv_splits=1)),
}


def reference_for(q, cache, bt, sl, ks, kernel_kw):
  """The float32 reference of these kernel options: with fp8_qk the kernel's logits are those of
  the per-row fp8-quantized q (`quantize_q_fp8`), so that is the reference's q."""
  if kernel_kw.get("fp8_qk"):
    q = k90.fp8_qk_reference_q(q)
  return k90.mla_decode_reference(q, cache, bt, sl, scale=SCALE, kv_scale=ks)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(name):
  inputs_kw, kernel_kw = CASES[name]
  q, cache, bt, sl, ks = make_inputs(zlib.crc32(name.encode()), l=L, r=R, g=G, **inputs_kw)
  if kernel_kw.get("schedule") == "worklist":  # the case must exercise split and whole tiles
    rows = np.repeat(np.asarray(sl), inputs_kw["n"], axis=1)
    rows = np.pad(rows, ((0, 0), (0, -rows.shape[1] % k90.TILE_M)))
    tile_len = rows.reshape(rows.shape[0], -1, k90.TILE_M).max(-1)
    meta, _ = k90._worklist_pieces(jnp.asarray(tile_len), kernel_kw["num_sms"],
                                   k90._WORKLIST_MIN_PAGES)
    slots = np.asarray(meta)[:, 4]
    assert (slots >= 0).any() and (slots == -1).any()
  out, lse = run_interpreted(q, cache, bt, sl, ks, **kernel_kw)
  ref, ref_lse = reference_for(q, cache, bt, sl, ks, kernel_kw)
  assert out.dtype == q.dtype and lse.dtype == jnp.float32
  assert_close(out, lse, ref, ref_lse, "bf16")


@pytest.mark.parametrize("num_sms", [1, 4, 132])
def test_worklist_pieces_cover_each_tile(num_sms):
  """The metadata step: pieces tile [0, pages) of every head tile in order, split pieces get
  consecutive unique slots within the static bound, and the grid bound holds."""
  rng = np.random.default_rng(num_sms)
  pieces_fn = jax.jit(k90._worklist_pieces, static_argnums=(1, 2))
  b, t = 7, 2
  for trial in range(12):
    tile_len = rng.integers(0, [700, 20000, 200000][trial % 3], (b, t)).astype(np.int32)
    tile_len[rng.random((b, t)) < 0.2] = 0
    meta, slot_tile = pieces_fn(jnp.asarray(tile_len), num_sms, k90._WORKLIST_MIN_PAGES)
    meta, slot_tile = np.asarray(meta), np.asarray(slot_tile)
    assert meta.shape == (b * t + k90.worklist_slots(num_sms), 6)
    pages = -(-tile_len.reshape(-1) // G)
    seen = {tile: [] for tile in range(b * t)}
    for bb, hh, p0, n, slot, tl in meta:
      if slot == -2:
        assert n == 0
        continue
      tile = bb * t + hh
      assert tl == tile_len[bb, hh]
      seen[tile].append((p0, n, slot))
    for tile, pieces in seen.items():
      assert pieces, f"tile {tile} has no piece"
      assert [p0 for p0, _, _ in pieces] == list(np.cumsum([0] + [n for _, n, _ in pieces])[:-1])
      assert sum(n for _, n, _ in pieces) == pages[tile]
      slots = [slot for _, _, slot in pieces]
      if len(pieces) == 1:
        assert slots == [-1]
      else:
        assert all(n > 0 for _, n, _ in pieces)
        assert slots == list(range(slots[0], slots[0] + len(slots)))
        assert all(slot_tile[sl] == tile for sl in slots)
    assert (slot_tile >= 0).sum() == sum(len(p) for p in seen.values() if len(p) > 1)


def test_batch_invariant_bitwise():
  kw = dict(b=3, nq=1, n=16, l=L, r=R, g=G, max_pages=2, lens=[90, 33, 128])
  q, cache, bt, sl, _ = make_inputs(5, **kw)
  out, lse = run_interpreted(q, cache, bt, sl, None, batch_invariant=True)
  out1, lse1 = run_interpreted(q[1:2], cache, bt[1:2], sl[1:2], None, batch_invariant=True)
  np.testing.assert_array_equal(np.asarray(out[1:2], np.float32), np.asarray(out1, np.float32))
  np.testing.assert_array_equal(np.asarray(lse[1:2]), np.asarray(lse1))


def test_attention_backend_pallas_sm90(monkeypatch):
  """get_backend("pallas_sm90") decodes through this kernel for page 64 when heads x query tokens fill
  its 64-row tile, through the portable kernel otherwise; CPU keeps "xla" as the default backend."""
  from mla_jax import attention
  calls = []
  real = k90.mla_decode_sm90
  monkeypatch.setattr(k90, "mla_decode_sm90", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  if not _NPROC_IN_TIME:
    pytest.skip("NPROC was raised too late for the interpreter")
  decode = attention.get_backend("pallas_sm90").mla_decode
  for g, nq, n_calls in ((G, 4, 1), (16, 4, 1), (G, 1, 1)):  # sm90; page 16; 16 rows < 64
    q, cache, bt, sl, _ = make_inputs(21, b=2, nq=nq, n=16, l=L, r=R, g=g, max_pages=128 // g,
                                      lens=[100, 7])
    out, lse = decode(q, cache, bt, sl, scale=SCALE, kv_scale=None, kv_lora_rank=L)
    ref, ref_lse = k90.mla_decode_reference(q, cache, bt, sl, scale=SCALE)
    assert_close(out, lse, ref, ref_lse, "bf16")
    assert len(calls) == n_calls
  assert attention.default_backend_name() == "xla"


def test_attention_backend_pallas_sm90_fp8qk(monkeypatch):
  """"pallas_sm90_fp8qk" decodes an fp8 cache with fp8_qk=True (against the reference on the quantized q)
  and a bf16 cache exactly like "pallas_sm90"."""
  from mla_jax import attention
  calls = []
  real = k90.mla_decode_sm90
  monkeypatch.setattr(k90, "mla_decode_sm90",
                      lambda *a, **kw: calls.append(kw.get("fp8_qk", False)) or real(*a, **kw))
  if not _NPROC_IN_TIME:
    pytest.skip("NPROC was raised too late for the interpreter")
  decode = attention.get_backend("pallas_sm90_fp8qk").mla_decode
  for cache_dtype in ("fp8", "bf16"):
    q, cache, bt, sl, ks = make_inputs(23, b=2, nq=4, n=16, l=L, r=R, g=G, max_pages=3,
                                       lens=[150, 7], cache_dtype=cache_dtype)
    out, lse = decode(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=L)
    fp8_qk = cache_dtype == "fp8"
    ref, ref_lse = reference_for(q, cache, bt, sl, ks, {"fp8_qk": fp8_qk})
    assert_close(out, lse, ref, ref_lse, "bf16")
    assert calls[-1] == fp8_qk
  assert len(calls) == 2


def _lower_for_sm90(cache_dtype, n=16, **kw):
  q, cache, bt, sl, ks = make_inputs(9, b=2, nq=1, n=n, l=L, r=R, g=G, max_pages=3,
                                     lens=[150, 7], cache_dtype=cache_dtype)
  f = jax.jit(lambda *a: k90.mla_decode_sm90(*a[:4], kv_scale=a[4], scale=SCALE, **kw))
  return f.trace(q, cache, bt, sl, ks).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("cache_dtype, kw", [
    ("bf16", dict(num_kv_splits=2, num_sms=132)),
    ("bf16", dict(num_kv_splits=1, num_sms=132)),
    ("fp8", dict(num_kv_splits=2, num_sms=132)),
    ("fp8", dict(num_kv_splits=1, fp8_compute="float16", num_sms=132)),
    ("bf16", dict(schedule="worklist", num_sms=132)),
    ("bf16", dict(n=80, num_kv_splits=2, num_sms=132)),   # 2 tiles, the last with 16 rows
    ("fp8", dict(n=128, schedule="worklist", num_sms=132)),
    ("fp8", dict(num_kv_splits=1, fp8_qk=True, num_sms=132)),
    ("fp8", dict(n=128, schedule="worklist", fp8_qk=True, fp8_compute="float16", num_sms=132)),
])
def test_lowers_for_sm90(cache_dtype, kw, monkeypatch):
  """The GPU code path (which differs from the interpreted one in `_accumulate`) passes Mosaic
  GPU's Python lowering for sm_90: layouts, wgmma and TMA shapes, 227 KB of shared memory.
  The split merges are Triton kernels, which cannot lower without a GPU: their jnp references stand
  in here (the kernel has its own interpreter and GPU tests in test_mla_decode.py)."""
  def merge_ref(o_part, lse_part, *, out_dtype, interpret):
    out, lse = mla_decode.merge_splits_reference(o_part, lse_part)
    return out.astype(out_dtype), lse
  monkeypatch.setattr(k90, "merge_splits", merge_ref)
  monkeypatch.setattr(k90, "merge_segments", lambda *a, max_segment, interpret:
                      mla_decode.merge_segments_reference(*a))
  text = _lower_for_sm90(cache_dtype, **kw)
  assert "mosaic_gpu" in text


def test_shared_memory_budget_error():
  with pytest.raises(ValueError, match="shared memory"):
    _lower_for_sm90("bf16", num_stages=3, num_sms=132)


def _bad(**over):
  q, cache, bt, sl, ks = make_inputs(3, b=2, nq=1, n=16, l=L, r=R, g=G, max_pages=2, lens=[20, 3])
  args = dict(q=q, kv_c_and_k_pe_cache=cache, block_table=bt, seq_lens=sl, scale=SCALE,
              kv_scale=ks, interpret=True)
  args.update(over)
  return args


@pytest.mark.parametrize("over, match", [
    (lambda a: dict(kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"][:, :32]), "page size G=32"),
    (lambda a: dict(kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"].astype(jnp.float32)),
     "dtype must be bfloat16 or float8"),
    (lambda a: dict(q=a["q"][..., :544], kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"][..., :544],
                    kv_lora_rank=480), "kv_lora_rank must be a multiple of 128"),
    (lambda a: dict(q=a["q"][..., :544], kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"][..., :544]),
     "rope dim"),
    (lambda a: dict(q=a["q"][0]), "q must be"),
    (lambda a: dict(block_table=a["block_table"][:1]), "block_table must be"),
    (lambda a: dict(num_stages=0), "num_stages"),
    (lambda a: dict(fp8_compute="fp8"), "fp8_compute"),
    (lambda a: dict(kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"].astype(jnp.bfloat16),
                    kv_scale=None, fp8_qk=True), "fp8_qk=True needs a float8_e4m3fn"),
    (lambda a: dict(num_sms=0), "num_sms"),
    (lambda a: dict(schedule="persistent"), "schedule"),
    (lambda a: dict(schedule="worklist", num_kv_splits=2), "num_kv_splits applies"),
])
def test_bad_inputs_raise(over, match):
  args = _bad()
  args.update(over(args))
  with pytest.raises(ValueError, match=match):
    k90.mla_decode_sm90(**args)


def test_choose_num_kv_splits_sm90():
  sms = 132
  # One request, 2 head tiles, 512 pages: fill the SMs with ~8-page splits.
  s = k90.choose_num_kv_splits_sm90(1, 2, 512, sms)
  assert 60 <= s <= 66 and 2 * s <= sms
  assert k90.choose_num_kv_splits_sm90(128, 2, 128, sms) == 1     # 256 CTAs: 2 full waves
  assert k90.choose_num_kv_splits_sm90(64, 1, 64, sms) == 2       # 64 CTAs -> 128
  assert k90.choose_num_kv_splits_sm90(1, 1, 1, sms) == 1
  for b, t, p in [(32, 1, 16), (64, 2, 64), (512, 2, 2560), (3, 1, 7)]:
    s = k90.choose_num_kv_splits_sm90(b, t, p, sms)
    assert 1 <= s <= p


# ----------------------------------------------------------------------------------------------
# GPU (make gpu): the real kernel.

GPU_CASES = [
    (dict(b=4, nq=1, n=16, max_pages=48, lens=[3000, 1, 0, 1100]), {}, "bf16"),
    (dict(b=4, nq=1, n=16, max_pages=48, lens=[3000, 1, 0, 1100], cache_dtype="fp8"), {}, "fp8"),
    (dict(b=4, nq=1, n=16, max_pages=48, lens=[3000, 1, 0, 1100], cache_dtype="fp8"),
     {"fp8_compute": "float16"}, "fp8"),
    (dict(b=3, nq=2, n=128, max_pages=24, lens=[1500, 65, 2], causal=True), {}, "bf16"),
    (dict(b=3, nq=1, n=128, max_pages=20, lens=[1200, 64, 999], cache_dtype="fp8"), {}, "fp8"),
    (dict(b=2, nq=4, n=32, max_pages=18, lens=[1100, 5], causal=True), {"num_stages": 1}, "bf16"),
    (dict(b=2, nq=1, n=16, max_pages=64, lens=[4000, 200]), {"num_kv_splits": 7}, "bf16"),
    (dict(b=1, nq=1, n=128, max_pages=128, lens=[8000]), {}, "bf16"),
    (dict(b=5, nq=1, n=16, max_pages=160, lens=[10000, 3, 0, 700, 64]), {"schedule": "worklist"},
     "bf16"),
    (dict(b=3, nq=2, n=64, max_pages=80, lens=[5000, 100, 1], causal=True, cache_dtype="fp8"),
     {"schedule": "worklist"}, "fp8"),
    (dict(b=3, nq=1, n=128, max_pages=20, lens=[1200, 64, 999], cache_dtype="fp8"),
     {"fp8_qk": True}, "fp8_qk"),
    (dict(b=4, nq=1, n=16, max_pages=48, lens=[3000, 1, 0, 1100], cache_dtype="fp8"),
     {"fp8_qk": True, "fp8_stages": 1, "num_stages": 2}, "fp8_qk"),
    (dict(b=3, nq=2, n=64, max_pages=80, lens=[5000, 100, 1], causal=True, cache_dtype="fp8"),
     {"fp8_qk": True, "schedule": "worklist", "fp8_compute": "float16"}, "fp8_qk"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(GPU_CASES)))
def test_gpu_matches_reference(idx):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  inputs_kw, kernel_kw, kind = GPU_CASES[idx]
  q, cache, bt, sl, ks = make_inputs(2000 + idx, l=L, r=R, g=G, **inputs_kw)
  out, lse = k90.mla_decode_sm90(q, cache, bt, sl, scale=SCALE, kv_scale=ks, **kernel_kw)
  ref, ref_lse = reference_for(q, cache, bt, sl, ks, kernel_kw)
  assert_close(out, lse, ref, ref_lse, kind, lse_tol=None if kind == "fp8_qk" else 1e-2)


@pytest.mark.gpu
def test_gpu_batch_invariant_bitwise():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  q, cache, bt, sl, _ = make_inputs(77, b=3, nq=1, n=128, l=L, r=R, g=G, max_pages=40,
                                    lens=[2500, 700, 64])
  out, lse = k90.mla_decode_sm90(q, cache, bt, sl, scale=SCALE, batch_invariant=True)
  out1, lse1 = k90.mla_decode_sm90(q[1:2], cache, bt[1:2], sl[1:2], scale=SCALE,
                                   batch_invariant=True)
  np.testing.assert_array_equal(np.asarray(out[1:2], np.float32), np.asarray(out1, np.float32))
  np.testing.assert_array_equal(np.asarray(lse[1:2]), np.asarray(lse1))


def test_trace_summary():
  """bench/trace_sm90.py's reduction of Mosaic GPU profiler events: nested scopes per warpgroup,
  per-CTA totals and the mean CTA span (tid = 1 + warpgroup + 3 * block)."""
  from bench import trace_sm90 as trace
  ev = lambda name, ph, ts, tid: {"name": name, "ph": ph, "ts": ts, "pid": 1, "tid": tid}
  events = []
  for block, t0 in ((0, 0.0), (1, 100.0)):
    wg0, wg1 = 1 + 3 * block, 2 + 3 * block
    events += [ev("qk", "B", t0, wg0), ev("qk", "E", t0 + 2, wg0),
               ev("pv", "B", t0 + 2, wg0), ev("wait", "B", t0 + 3, wg0), ev("wait", "E", t0 + 4, wg0),
               ev("pv", "E", t0 + 6, wg0),
               ev("pv", "B", t0 + 1, wg1), ev("pv", "E", t0 + 9, wg1)]
  scopes, span = trace.summarize(events)
  assert span == 9.0
  assert scopes[0]["qk"] == (2, 2.0, 2.0) and scopes[0]["pv"] == (2, 4.0, 4.0)
  assert scopes[0]["wait"] == (2, 1.0, 1.0) and scopes[1]["pv"] == (2, 8.0, 8.0)
