"""EXPERIMENT (session 16, not a committed benchmark): A/B of the narrow decode's options."""
import functools, json, os, sys
import jax, jax.numpy as jnp
sys.path.insert(0, os.path.dirname(__file__))
from decode import make_inputs, SCALE  # noqa
from mla_jax.bench import common
from pallas_kernels import mla_decode_sm90_narrow as kn

out = sys.argv[1]
rows = []
for (b, ctx, splits) in ((128, 8192, 1), (64, 4096, 2), (32, 1024, 4), (8, 4096, 16)):
    for dtype in ("fp8", "bf16"):
        q, cache, bt, sl, ks = make_inputs(jax.random.key(0), b, 1, 16, ctx, dtype)
        variants = [dict(stages=1), dict(stages=2)] if dtype == "fp8" else [dict(stages=2), dict(stages=2, chunk=1024)]
        for v in variants:
            kw = dict(v)
            chunk = kw.pop("chunk", kn._QK_CHUNK)
            fn = jax.jit(functools.partial(kn.narrow_decode, scale=SCALE, l=512, splits=splits, interpret=False, **kw))
            off = jnp.zeros((1,), jnp.int32)
            old, kn._QK_CHUNK = kn._QK_CHUNK, chunk
            try:
                t = common.device_time_us(lambda *a: fn(*a[:5], kv_scale=a[5]), [(q, cache, bt, sl, off, ks)])
            except Exception as e:  # noqa
                t = {"error": str(e)[:300]}
            finally:
                kn._QK_CHUNK = old
            r = dict(B=b, ctx=ctx, dtype=dtype, **v, **t)
            print(r, flush=True)
            rows.append(r)
json.dump(rows, open(os.path.join(out, "narrow-probe.json"), "w"), indent=1)
