"""What bounds the fp8 -> bf16 cast of a page in shared memory on Hopper (the fp8 cache's P.V operand).

The Hopper decode with an fp8 cache casts V (64 tokens x 512 columns of e4m3) into a bf16 tile for the
P.V wgmma; its traces put the cast at 0.5-0.8 us per 64 x 64 chunk, ~4x what shared-memory bandwidth
allows (docs/perf-notes.md). This benchmark isolates it: each CTA (one per SM) streams fp8 pages
through a 2-deep TMA ring and runs one variant on each page's L columns:

  tma        no cast: the ring alone (the load-bound floor)
  f32        x.astype(f32).astype(bf16), stored to a 128B-swizzled bf16 tile (the decode's cast)
  f16        x.astype(f16), stored to an f16 tile (sm_90 casts e4m3x2 -> f16x2 natively)
  bits       e4m3 -> bf16 by integer and bf16 ALU ops, no conversion unit (`e4m3_to_bf16_bits`, exact),
             stored to the bf16 tile
  load_f32   the f32 variant's loads and converts, summed into registers, no tile store
  copy       the fp8 chunk loaded and stored to another fp8 tile, no convert

    PYTHONPATH=. python3 bench/fp8_cast.py --out DIR [--pages-per-cta 256]

Writes DIR/fp8-cast-h200.json: per variant the device time per page per SM and the equivalent
bandwidth, beside the copy ceiling. `--check` (also on CPU, in the interpreter) compares each
casting variant's tile with the exact cast.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_jax.bench import common
from pallas_kernels.mgpu import interpret_params, tiled
from pallas_kernels.util import BF16, F16, FP8, num_sms

G, D, L = 64, 576, 512
VARIANTS = ("tma", "f32", "f16", "bits", "load_f32", "copy")


def e4m3_to_bf16_bits(x):
    """Exact e4m3 -> bf16 without a float convert: the 7 magnitude bits shifted into bf16's exponent and
    mantissa fields with the exponent rebiased (+120), which is exact for normals; a subnormal (exponent
    field 0, value m 2^-9) comes out as 2^-7 + m 2^-10 and is mapped back by 2 (v - 2^-7), exact in bf16;
    then the sign to bit 15. All integer / bf16 ALU work, no conversion unit."""
    u = lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint16)
    v = lax.bitcast_convert_type(((u & 0x7F) << 4) + 0x3C00, BF16)
    v = jnp.where((u & 0x78) == 0, (v - jnp.asarray(2.0**-7, BF16)) * jnp.asarray(2.0, BF16), v)
    return lax.bitcast_convert_type(lax.bitcast_convert_type(v, jnp.uint16) | ((u & 0x80) << 8), BF16)


def _kernel(src, out, ring, tile, tile8, bars, *, mode, pages_per_cta, n_pages):
    cta = lax.axis_index("cta")
    base = cta * pages_per_cta

    def fetch(i, slot):
        page = lax.rem(base + i, jnp.int32(n_pages))
        plgpu.copy_gmem_to_smem(src.at[page], ring.at[slot], bars.at[slot])

    fetch(jnp.int32(0), 0)

    def step(i, acc):
        slot = lax.rem(i, jnp.int32(2))
        plgpu.barrier_wait(bars.at[slot])

        @pl.when(i + 1 < pages_per_cta)
        def _():
            fetch(i + 1, 1 - slot)

        for c in range(L // 64):
            if mode == "tma":
                break
            x = ring.at[slot, :, pl.ds(64 * c, 64)][...]
            if mode == "f32":
                tile.at[:, pl.ds(64 * c, 64)][...] = x.astype(jnp.float32).astype(BF16)
            elif mode == "f16":
                tile.at[:, pl.ds(64 * c, 64)][...] = x.astype(F16).astype(tile.dtype)
            elif mode == "bits":
                tile.at[:, pl.ds(64 * c, 64)][...] = e4m3_to_bf16_bits(x)
            elif mode == "load_f32":
                acc = acc + x.astype(jnp.float32)
            elif mode == "copy":
                tile8.at[:, pl.ds(64 * c, 64)][...] = x
        plgpu.commit_smem()  # generic-proxy reads of the slot before the next TMA into it
        return acc

    acc = plgpu.layout_cast(jnp.zeros((G, 64), jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, pages_per_cta, step, acc)

    @pl.when(cta == 0)
    def _():
        if mode == "load_f32":
            tile.at[:, pl.ds(0, 64)][...] = acc.astype(tile.dtype)  # keeps the loads live
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile, out.at[1])
        if mode in ("f32", "f16", "bits"):  # the last page's cast, for --check
            plgpu.copy_smem_to_gmem(tile, out.at[0])
        plgpu.wait_smem_to_gmem(0)


def run(src, mode, pages_per_cta, ctas, interpret=False):
    """(out [2, G, L] bf16: the last cast tile of CTA 0 and, for load_f32, its register sums)."""
    n_pages = src.shape[0]
    tile_dt = F16 if mode == "f16" else BF16
    kernel = plgpu.kernel(
        functools.partial(_kernel, mode=mode, pages_per_cta=pages_per_cta, n_pages=n_pages),
        out_type=jax.ShapeDtypeStruct((2, G, L), tile_dt),
        grid=(ctas,),
        grid_names=("cta",),
        scratch_types=[
            plgpu.SMEM((2, G, D), FP8, transforms=tiled(FP8, 64)),
            plgpu.SMEM((G, L), tile_dt, transforms=tiled(tile_dt)),
            plgpu.SMEM((G, L), FP8, transforms=tiled(FP8, 64)),
            plgpu.Barrier(num_barriers=2),
        ],
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
        kernel_name=f"fp8_cast_{mode}",
    )
    return kernel(src)


def random_pages(n_pages, seed=0):
    """fp8 pages covering e4m3's range, subnormals and both zeros included."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 256, size=(n_pages, G, D), dtype=np.uint8)
    bits[bits & 0x7F == 0x7F] = 0x3C  # no NaN
    return jnp.asarray(bits.view(jnp.float8_e4m3fn))


def check(interpret):
    src = random_pages(4)
    ok = True
    for mode in ("f32", "f16", "bits"):
        out = np.asarray(run(src, mode, 3, 1, interpret=interpret)[0], np.float32)
        want = np.asarray(src[2, :, :L], np.float32)  # CTA 0's last page (pages 0, 1, 2)
        good = np.array_equal(out, want)
        ok &= good
        print(f"check {mode}: {'exact' if good else 'MISMATCH'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--pages-per-cta", type=int, default=256)
    ap.add_argument("--check", action="store_true", help="only compare the casts with the exact one")
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if args.check or not on_gpu:
        raise SystemExit(0 if check(not on_gpu) else 1)
    checks = "PASS" if check(False) else "FAIL"
    ceil = common.measure_ceilings()
    res = common.results_header(ceil)
    res["checks"] = checks
    ctas = num_sms()
    src = random_pages(ctas * 8)  # 0.3 GB: past L2
    page_bytes = G * D
    for mode in VARIANTS:
        t0 = time.time()
        fn = jax.jit(functools.partial(run, mode=mode, pages_per_cta=args.pages_per_cta, ctas=ctas))
        dev = common.device_time_us(fn, [(src,)])
        us = dev["device_us"]
        per_page = us / args.pages_per_cta
        row = {
            "variant": mode,
            "ctas": ctas,
            "pages_per_cta": args.pages_per_cta,
            "device_us": round(us, 1),
            "us_per_page": round(per_page, 3),
            "us_per_64x64_chunk": round(per_page / (L // 64), 3) if mode != "tma" else None,
            "fp8_TBps": round(ctas * args.pages_per_cta * page_bytes / (us * 1e-6) / 1e12, 3),
            "compile_and_time_s": round(time.time() - t0, 1),
        }
        row["frac_copy"] = round(row["fp8_TBps"] / ceil["copy_TBps"], 3)
        print(row, flush=True)
        res["rows"].append(row)
        common.write_results(os.path.join(args.out, "fp8-cast-h200.json"), res)


if __name__ == "__main__":
    main()
