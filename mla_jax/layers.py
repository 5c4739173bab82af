"""Building blocks over plain param pytrees named after the HF checkpoint: RMSNorm, dense MLP, MoE.

Weights keep the HF (torch Linear) layout [out, in]; stacked experts are [E, out, in].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mla_jax.comm import LOCAL, Comm
from mla_jax.config import DeepseekConfig
from pallas_kernels import fp8_matmul as fp8
from pallas_kernels import grouped_matmul as gmm_kernel
from pallas_kernels import linear as linear_kernel
from pallas_kernels import moe_router
from pallas_kernels import rms_norm as rms_norm_kernel
from pallas_kernels.util import FLOAT_DTYPES

GMM_IMPLS = ("ragged_dot", "pallas")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerRow:
    """Row `index` of a weight stacked over a scan's layers, [Lyr, ...]: what the layer loop puts in a layer's
    params in place of the weights a kernel reads in place (a slice that feeds a custom call is a device copy):
    the norms' (`add_rms_norm`), the linears' (`linear` for fp8, `linears`), W_UK_T's and W_UV's (`mla.absorb_q`,
    `mla.v_up_proj`). XLA ops take `row()`, a slice XLA can fuse into them."""

    stacked: jax.Array  # [Lyr, ...]
    index: jax.Array  # i32[]

    @property
    def shape(self) -> tuple[int, ...]:  # the row's
        return self.stacked.shape[1:]

    @property
    def dtype(self):
        return self.stacked.dtype

    def row(self) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self.stacked, self.index, keepdims=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertCopies:
    """An MoE layer's output left uncombined (`moe(..., combine=False)`): the down kernel's rows `copies`
    [T*K + S*T, D] in the grouped kernel's order (`grouped_matmul.copy_groups`: token t's K routed copies at rows
    t*K.., then the S shared chunks' T rows each) and the router weights f32[T, K]. The next norm combines them as
    it adds them to the residual stream (`add_rms_norm`, one kernel on a GPU), so a decode step runs no combine
    kernel a layer; `combine()` is the layer's output [T, D] (plain jnp)."""

    copies: jax.Array  # [T*K + S*T, D]
    weights: jax.Array  # f32[T, K]
    shared: int = dataclasses.field(metadata=dict(static=True))  # S

    def combine(self) -> jax.Array:
        return rms_norm_kernel.combine_copies_reference(self.copies, self.weights, self.shared)

    @staticmethod
    def of(f: jax.Array, top_k: int, shared: int) -> "ExpertCopies":
        """A combined output f [T, D] (a dense layer's) in this form: token t's first routed copy with weight 1."""
        t, d = f.shape
        copies = jnp.zeros((t * (top_k + shared), d), f.dtype).at[: t * top_k : top_k].set(f)
        return ExpertCopies(copies, jnp.zeros((t, top_k), jnp.float32).at[:, 0].set(1.0), shared)


def combined(f) -> jax.Array:
    """An MLP/MoE output as [T, D] (`ExpertCopies` combined)."""
    return f.combine() if isinstance(f, ExpertCopies) else f


def layer_row(w) -> jax.Array:
    """A weight as an array: a `LayerRow`'s row, anything else as it is."""
    return w.row() if isinstance(w, LayerRow) else w


def in_place(w) -> tuple[jax.Array, jax.Array | None]:
    """What a kernel that reads a weight in place takes: (a `LayerRow`'s stacked array, its row index), or (w,
    None) for a plain weight."""
    return (w.stacked, w.index) if isinstance(w, LayerRow) else (w, None)


def rms_norm(p: dict, x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """HF DeepseekRMSNorm: normalise in float32, cast back, then scale by the weight."""
    return add_rms_norm(p, x, None, eps)[0]


def add_rms_norm(
    p: dict, x: jnp.ndarray, residual: jnp.ndarray | ExpertCopies | None, eps: float, router: dict | None = None
):
    """(normed, h): h = x + residual (the residual stream's add; x when None), normed = rms_norm(h). On a GPU one
    Pallas kernel for [T, D] rows (`pallas_kernels.rms_norm`: XLA runs three), elsewhere plain jnp. The weight
    may be a `LayerRow` (read in place by the kernel); the residual may be `ExpertCopies` (combined in the kernel).
    With `router` (an MoE gate's params, `router_fusable`): (normed, h, the gate's logits f32[T, E] of normed), in
    the same kernel."""
    w, i = in_place(p["weight"])
    kw = dict(eps=eps, weight_index=i)
    if isinstance(residual, ExpertCopies):
        kw.update(residual_weights=residual.weights, residual_shared=residual.shared)
        residual = residual.copies
    if router is not None:  # stacked like the norm weight (`router_fusable`): the same index
        kw["router"] = in_place(router["weight"])[0]
    if jax.default_backend() == "gpu" and x.ndim == 2:
        return rms_norm_kernel.add_rms_norm(x, residual, w, **kw)
    return rms_norm_kernel.add_rms_norm_reference(x, residual, w, **kw)


# At most this many tokens get the router's logits from the norm kernel (E/eb programs a row, each renormalizing it:
# cheap for decode batches; measured at batch 1 on the H200, 3.2 us for the norm and the GEMV's 2.0 + 2.3). 128: see
# LINEAR_MAX_T (session 33).
ROUTER_IN_NORM_MAX_T = 128


def router_fusable(norm: dict, gate: dict, x: jnp.ndarray, comm: Comm = LOCAL) -> bool:
    """Whether the MoE gate's logits come out of the layer's input norm kernel (`add_rms_norm(..., router=)`): on a
    GPU for up to ROUTER_IN_NORM_MAX_T tokens routed where they are normed (no DP token gather), a float32 gate
    stacked like the norm weight (`LayerRow`s of one layer index, or both plain)."""
    w, g = norm["weight"], gate["weight"]
    rows = isinstance(w, LayerRow), isinstance(g, LayerRow)
    return (
        jax.default_backend() == "gpu"
        and x.ndim == 2
        and 1 <= x.shape[0] <= ROUTER_IN_NORM_MAX_T
        and comm.dp == 1
        and jnp.dtype(g.dtype) == jnp.float32
        and rows[0] == rows[1]
        and (not rows[0] or w.index is g.index)
    )


def is_fp8(p: dict) -> bool:
    """A block-FP8 linear: {"weight": e4m3 [out, in], "weight_scale_inv": f32 [cdiv(out,128), cdiv(in,128)]}."""
    return "weight_scale_inv" in p


def act_dtype(p: dict, default=jnp.bfloat16):
    """The dtype a linear's input is cast to: its weight's; for an fp8 weight (quantized in the GEMM) `default`,
    the model's float dtype."""
    return default if is_fp8(p) else p["weight"].dtype


def _fp8_kernel_ok(n: int, k: int) -> bool:
    return jax.default_backend() == "gpu" and fp8.unsupported_reason(n, k) is None


def linear(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """x [..., in] @ weight[out, in]^T; the weight may be a `LayerRow`. An fp8 weight (`is_fp8`) runs the W8A8
    Mosaic GPU GEMM on a GPU (`pallas_kernels.fp8_matmul`, the row read in place); elsewhere, or for shapes it does
    not take, XLA's dequantize + dot. Other weights: XLA's dot (of the LayerRow's `row()`)."""
    w = p["weight"]
    if not is_fp8(p):
        return jnp.einsum("...i,oi->...o", x, layer_row(w))
    s = p["weight_scale_inv"]
    # a LayerRow (the layer loop's stacked weights): the kernel reads its row in place
    (wq, i), (ws, _) = in_place(w), in_place(s)
    x2 = x.reshape(-1, x.shape[-1])
    if _fp8_kernel_ok(*w.shape) and x2.shape[0] > 0:
        y = fp8.fp8_matmul(x2, wq, ws, rhs_index=i, out_dtype=x.dtype)
    else:
        y = fp8.fp8_matmul_xla(x2, wq, ws, rhs_index=i)
    return y.reshape(*x.shape[:-1], w.shape[0])


# At most this many tokens take the dense linear kernel (`pallas_kernels.linear`, through `linears`) on a GPU, more
# take XLA's dot: decode batches are weight-bandwidth bound (the kernel's case), prefill chunks compute bound
# (cuBLAS's). 128 (with HEAD_MATMUL_MAX_T and ROUTER_IN_NORM_MAX_T): XLA's GEMMs copy the layer loop's slice of each
# stacked weight first (5 `memcpy128` a layer at batch 128); H100, session 33, one call: the batch-128 step (ctx 1k)
# 16.13 -> 15.49 ms with the three at 128 instead of 64, the verify step at batch 32, k = 2 (96 rows) 14.68 -> 14.11.
LINEAR_MAX_T = 128

# The same for block-FP8 weights (the W8A8 linear and the grouped kernel's fp8 path, `fp8_experts_triton`): past it
# the Mosaic GPU GEMM. Measured up to 64 tokens only (sessions 22-24); the bf16 bound moved to 128 without it.
FP8_LINEAR_MAX_T = 64


# One token through one weight of at most this many inputs stays with XLA: its GEMV fuses the layer loop's slice of
# the stacked weight and beat the kernel on the H200 (2026-12-02, bench/results/linear-h200.json: o_proj [2048, 2048]
# 3.7 us against 5.4-6.0, the router's [64, 2048] 1.5 against 1.9-3.0); two weights are one kernel launch against two.
XLA_GEMV_MAX_K = 2048


# Block-FP8 linears with more inputs than this stay with the Mosaic GPU GEMM (`linear`) where it takes the shape; the
# Triton kernel's cost grows with K faster than the bytes (H200, session 22, part 36, device time a call with x's
# quantization: V3's q_a_proj [1536, 7168] 22.1 us at one token against the Mosaic path's 12.5, 25.3 against 14.0 at
# 32; V2-Lite's q_proj [3072, 2048] 9.3 against 10.3 and 10.4 against 11.4; the V2-Lite-shaped step, every fp8
# linear of <= 64 tokens on the Triton kernel: 2.78 / 7.39 ms at batch 1 / 32 against 3.26 / 9.61, part 35). 2816:
# V2-Lite's shared experts' down_proj, the deepest of its fp8 linears that the Mosaic kernel also takes.
FP8_LINEAR_MAX_K = 2816


def _linear_kernel_ok(ps: tuple[dict, ...], x: jnp.ndarray) -> bool:
    """The dense linear kernel for these linears of x [T, in]: on a GPU, 1 <= T <= LINEAR_MAX_T, float dtypes, one
    weight dtype (all block-FP8 or none), and either all plain weights or all `LayerRow`s of one layer index; not
    one token through a single bf16/f32 weight of at most XLA_GEMV_MAX_K inputs. fp8 weights: at most
    FP8_LINEAR_MAX_T tokens and FP8_LINEAR_MAX_K inputs (or a shape the Mosaic GPU GEMM does not take)."""
    ws = [p["weight"] for p in ps]
    rows = [isinstance(w, LayerRow) for w in ws]
    fp8 = [is_fp8(p) for p in ps]
    if any(fp8):
        dtypes_ok = all(fp8) and jnp.dtype(x.dtype) in FLOAT_DTYPES
        # deep weights that the Mosaic GPU GEMM takes stay with it (FP8_LINEAR_MAX_K)
        dtypes_ok &= x.shape[-1] <= FP8_LINEAR_MAX_K or not all(_fp8_kernel_ok(*w.shape) for w in ws)
        dtypes_ok &= x.shape[0] <= FP8_LINEAR_MAX_T
    else:
        dtypes_ok = (
            not (len(ws) == 1 and x.shape[0] == 1 and ws[0].shape[-1] <= XLA_GEMV_MAX_K)
            and all(jnp.dtype(w.dtype) in FLOAT_DTYPES and w.dtype == ws[0].dtype for w in ws)
            and jnp.dtype(x.dtype) in FLOAT_DTYPES
        )
    return (
        jax.default_backend() == "gpu"
        and x.ndim == 2
        and 1 <= x.shape[0] <= LINEAR_MAX_T
        and dtypes_ok
        and (not any(rows) or (all(rows) and all(w.index is ws[0].index for w in ws)))
    )


def linears(ps: tuple[dict, ...], x: jnp.ndarray, out_dtype=None) -> tuple[jnp.ndarray, ...]:
    """Several linears of the same x [T, in]: (linear(p, x) for p in ps), each [T, out_j] (in out_dtype when given).

    On a GPU for up to LINEAR_MAX_T tokens, bf16/f32 weights of one dtype (plain or `LayerRow`s of one layer, read in
    place) are one launch of `pallas_kernels.linear` (XLA: a reduce fusion each, at about half the copy bandwidth,
    issue #22); the product is in the promotion of x's and the weights' dtypes, float32 exactly. Block-FP8 weights
    likewise, as the W8A8 product `linear`'s fp8 GEMM computes (the kernel quantizes x itself: one launch where the
    GEMM's path ran padding, quantization, the GEMM and a split-K sum per weight). Elsewhere, or for more tokens,
    `linear` each."""
    ps = tuple(ps)
    if _linear_kernel_ok(ps, x):
        arrays, index = zip(*(in_place(p["weight"]) for p in ps))  # one index (`_linear_kernel_ok`)
        scales = tuple(in_place(p["weight_scale_inv"])[0] for p in ps) if is_fp8(ps[0]) else None
        return linear_kernel.linear(x, arrays, scales=scales, rhs_index=index[0], out_dtype=out_dtype)
    if len(ps) > 1 and all(_linear_kernel_ok((p,), x) for p in ps):
        return tuple(linears((p,), x, out_dtype)[0] for p in ps)  # the kernel, each weight its own call
    outs = tuple(linear(p, x) for p in ps)
    return outs if out_dtype is None else tuple(o.astype(out_dtype) for o in outs)


def mlp(p: dict, x: jnp.ndarray, *, intermediate_size: int | None = None, comm: Comm = LOCAL) -> jnp.ndarray:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). x [T, D]. With `comm`, a device whose gate/up rows are fewer
    than `intermediate_size` holds a slice of the intermediate dim, and the partial outputs are all-reduced. The
    linears go through `linears` (gate and up one kernel launch at decode sizes on a GPU)."""
    gate, up = linears((p["gate_proj"], p["up_proj"]), x)
    (y,) = linears((p["down_proj"],), jax.nn.silu(gate) * up)
    split = intermediate_size is not None and p["gate_proj"]["weight"].shape[0] != intermediate_size
    return comm.reduce_model(y) if split else y


def route(
    p_gate: dict, cfg: DeepseekConfig, x: jnp.ndarray, logits: jnp.ndarray | None = None
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Router: x [T, D] -> (weights f32[T, K], expert ids i32[T, K]). Scores in float32 as HF/vLLM do. The
    logits (unless given: `add_rms_norm(..., router=)` made them) are one `linears` call (on a GPU for few tokens
    the linear kernel, exact float32), else XLA's; the selection (scores, group limit, top-k, weights) is
    `pallas_kernels.moe_router`: one kernel on a GPU (XLA runs three: softmax, a sort for the top-k, its slice),
    its reference elsewhere."""
    if logits is None:  # f32 [E, D] weight (may be a LayerRow): the product in float32 (x promoted to it)
        (logits,) = linears(({"weight": p_gate["weight"]},), x, out_dtype=jnp.float32)  # [T, E]
    K = cfg.num_experts_per_tok
    if cfg.topk_method == "noaux_tc":
        # V3: the correction bias steers selection only; weights come from the unbiased scores.
        bias = p_gate["e_score_correction_bias"].astype(jnp.float32)
        kw = dict(n_group=cfg.n_group, topk_group=cfg.topk_group, group_score="top2", fill=-jnp.inf)
        kw.update(renormalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
    else:
        # DeepSeek-V2's gate: renormalise when asked, otherwise scale (V2 and V2-Lite ship norm_topk_prob=false).
        bias, renorm = None, bool(cfg.norm_topk_prob and K > 1)
        limited = cfg.topk_method == "group_limited_greedy"
        kw = dict(n_group=cfg.n_group, topk_group=cfg.topk_group) if limited else {}
        kw.update(group_score="max", fill=0.0, renormalize=renorm, scale=1.0 if renorm else cfg.routed_scaling_factor)
    if jax.default_backend() == "gpu" and x.shape[0] > 0:
        return moe_router.moe_topk(logits, bias, top_k=K, scoring=cfg.scoring_func, **kw)
    return moe_router.moe_topk_reference(logits, bias, top_k=K, scoring=cfg.scoring_func, **kw)


def expert_gmm(
    lhs: jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray],
    w: jnp.ndarray,
    group_sizes: jnp.ndarray | None,
    impl: str = "ragged_dot",
    layer: jnp.ndarray | int | None = None,
    scale_inv: jnp.ndarray | None = None,
    row_groups: jnp.ndarray | None = None,
    shared_w: jnp.ndarray | None = None,
    fp8_triton: bool = False,
    shared_scale: jnp.ndarray | None = None,
    out_dtype=None,
) -> jnp.ndarray:
    """Grouped matmul of expert-sorted rows: lhs [M, in] x w [E, out, in] (HF layout) -> [M, out].

    Row block e (group_sizes[e] rows) uses expert e; rows past sum(group_sizes) come out 0. "ragged_dot" is
    `jax.lax.ragged_dot_general` (XLA's GPU lowering may expand it into a dense [E, M, in] problem);
    "pallas" is `pallas_kernels.grouped_matmul`, which computes each row's own expert only (interpret mode on
    a CPU). With `layer`, w is stacked over a scan's layers, [layers, E, out, in], and layer `layer` is used:
    the Pallas kernel reads it in place (no per-layer copy of the experts), ragged_dot slices it out.
    `scale_inv` (fp8 experts: w e4m3 with block scales [(layers,) E, cdiv(out,128), cdiv(in,128)]): the W8A8
    grouped GEMM on a GPU for either impl (`fp8_grouped_matmul`, in place), else dequantize + ragged_dot; with
    `fp8_triton` (`fp8_experts_triton`: decode sizes, impl "pallas") the Triton grouped kernel's W8A8 path.
    `row_groups` (instead of group_sizes, rows unsorted, each row's expert; `by_row_ok` says where it is taken):
    the kernels' one-item-per-row work list; lhs may then hold one row per token (`grouped_matmul`).
    `shared_w` ("pallas", `shared_fusable`): the shared experts' weight [(layers,) out, S*in] or
    [(layers,) S*out, in], whose S expert-sized chunks are groups E..E+S-1 (`grouped_matmul(shared_rhs=)`); fp8
    (with `fp8_triton`) with its block scales `shared_scale`. lhs may be an (e4m3 [M, in], f32 scale [M, in/128])
    pair, rows already in the W8A8 format (`expert_glu`'s output for fp8 experts with `fp8_triton`), then the output
    is in `out_dtype`.
    """
    if impl not in GMM_IMPLS:
        raise ValueError(f"gmm_impl must be one of {GMM_IMPLS}, got {impl!r}")
    if row_groups is not None and not by_row_ok(impl, w, scale_inv, fp8_triton):
        raise ValueError(
            f"row_groups needs the grouped Pallas kernel (gmm_impl='pallas', or fp8 on a GPU), not {impl!r}"
        )
    if isinstance(lhs, tuple) and not (scale_inv is not None and fp8_triton):
        raise ValueError("quantized rows (e4m3, scale) are the fp8 experts' Triton path's input (fp8_triton)")
    if scale_inv is not None and fp8_triton:
        lhs, lhs_scale = lhs if isinstance(lhs, tuple) else (lhs, None)
        return gmm_kernel.grouped_matmul(
            lhs,
            w,
            group_sizes,
            row_groups=row_groups,
            lhs_scale=lhs_scale,
            preferred_element_type=out_dtype if lhs_scale is not None else None,
            rhs_scale=scale_inv,
            rhs_index=layer,
            shared_rhs=shared_w,
            shared_scale=shared_scale,
            interpret=jax.default_backend() == "cpu",
        )
    if scale_inv is not None:
        if shared_w is not None:
            raise ValueError("fp8 shared chunks need the grouped Pallas kernel's fp8 path (fp8_triton)")
        if _fp8_kernel_ok(*w.shape[-2:]):
            return fp8.fp8_grouped_matmul(
                lhs, w, scale_inv, group_sizes, row_groups=row_groups, rhs_index=layer, out_dtype=lhs.dtype
            )
        return fp8.fp8_grouped_matmul_xla(lhs, w, scale_inv, group_sizes, rhs_index=layer)
    if impl == "pallas":
        return gmm_kernel.grouped_matmul(
            lhs,
            w,
            group_sizes,
            row_groups=row_groups,
            transpose_rhs=True,
            rhs_index=layer,
            shared_rhs=shared_w,
            interpret=jax.default_backend() == "cpu",
        )
    if shared_w is not None:
        raise ValueError(f"shared_w needs the grouped Pallas kernel (gmm_impl='pallas'), not {impl!r}")
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    # rhs is [E, out, in] (HF layout): contract lhs dim 1 with rhs dim 2.
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    return jax.lax.ragged_dot_general(lhs, w, group_sizes, dn)


def expert_glu(
    lhs: jnp.ndarray,
    gate: dict,
    up: dict,
    group_sizes: jnp.ndarray | None,
    impl: str = "ragged_dot",
    layer: jnp.ndarray | int | None = None,
    row_groups: jnp.ndarray | None = None,
    shared: dict | None = None,
    fp8_triton: bool = False,
) -> jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray]:
    """The experts' SwiGLU input silu(lhs @ gate^T) * (lhs @ up^T) [M, I] for expert-sorted (or `row_groups`)
    rows; gate / up: the `gate_proj` / `up_proj` param dicts. bf16 experts with impl "pallas": one kernel
    (`grouped_matmul(..., up_rhs=)`: both weights' tiles per program, the SwiGLU on its float32 accumulators),
    else two `expert_gmm`s and the elementwise product. `shared`: the shared experts' params (their gate/up
    chunks are groups E.., see `expert_gmm`). fp8 experts with `fp8_triton`: that kernel's W8A8 path, one pass too
    (fp8 shared chunks included), its output already in the down projection's W8A8 input format (e4m3 [M, I], f32
    [M, I/128]: `grouped_matmul(quantize_out=True)`, no quantization kernel between the two)."""
    g, u = gate["weight"], up["weight"]
    if is_fp8(gate) and fp8_triton:
        kw = {}
        if shared is not None:  # fp8 shared chunks: their weights and block scales
            sg, su = shared["gate_proj"], shared["up_proj"]
            kw = dict(shared_rhs=sg["weight"], shared_up_rhs=su["weight"])
            kw.update(shared_scale=sg["weight_scale_inv"], shared_up_scale=su["weight_scale_inv"])
        return gmm_kernel.grouped_matmul(
            lhs,
            g,
            group_sizes,
            row_groups=row_groups,
            up_rhs=u,
            rhs_scale=gate["weight_scale_inv"],
            up_scale=up["weight_scale_inv"],
            rhs_index=layer,
            interpret=jax.default_backend() == "cpu",
            preferred_element_type=lhs.dtype,
            quantize_out=True,
            **kw,
        )
    if impl == "pallas" and not is_fp8(gate):
        sg, su = (None, None) if shared is None else (shared["gate_proj"]["weight"], shared["up_proj"]["weight"])
        return gmm_kernel.grouped_matmul(
            lhs,
            g,
            group_sizes,
            row_groups=row_groups,
            up_rhs=u,
            transpose_rhs=True,
            rhs_index=layer,
            shared_rhs=sg,
            shared_up_rhs=su,
            interpret=jax.default_backend() == "cpu",
        )
    if shared is not None:
        raise ValueError("the shared experts join the routed kernel only for bf16 experts with gmm_impl='pallas'")
    h = expert_gmm(lhs, g, group_sizes, impl, layer, gate.get("weight_scale_inv"), row_groups)
    return jax.nn.silu(h) * expert_gmm(lhs, u, group_sizes, impl, layer, up.get("weight_scale_inv"), row_groups)


# At most this many routed token copies (T x top-k) skip the sort by expert on every path that takes `row_groups`
# (the Mosaic GPU fp8 GEMM too): each copy is its own work item (the shared experts' chunks one item each for all T
# tokens). Sorting costs a chain of small XLA kernels a layer (argsort, group sizes, the gather of the copies, the
# inverse permutation, the combine); unsorted, a copy re-reads an expert that another copy also hit, which one
# token's distinct top-k never do. 16 copies: one row tile of the kernel (batch 1-2 at V2's top-6 and V3's top-8).
BY_ROW_MAX_COPIES = gmm_kernel.PER_COPY_MAX_COPIES
# Up to this many routed copies the Triton grouped kernel (bf16 experts, or fp8 ones where `fp8_experts_triton`)
# takes each token's top-k unsorted past BY_ROW_MAX_COPIES too: an item per (expert, row tile) (`grouped_matmul`'s
# items by group, the slots' copies listed by one small kernel), so no sort kernels and, the copies in token order, no
# combine kernel (the next norm combines them: `ExpertCopies`). Measured on the H200 with each program finding its
# copies itself (part 45, V2-Lite step, bf16): batch 8 (48 copies) 3% faster than sorted, batch 32 (192) the same,
# batch 128 (768) 1.7x slower. With the table kernel and the items listing only the slots' tiles (738ec3f), batch 128
# at ctx 1k by group 14.755 ms against sorted 15.438 (-4.4%, 1.27x against 1.33x the roofline; H100, one call,
# session 34): 1024 copies (batch 128's 768, the batch-32 k = 2 verify step's 576); more are not measured.
BY_GROUP_MAX_COPIES = 1024


def by_row_ok(impl: str, w: jnp.ndarray, scale_inv: jnp.ndarray | None, fp8_triton: bool = False) -> bool:
    """Whether `expert_gmm` takes unsorted rows (`row_groups`) for these experts: the Pallas kernels only (fp8
    experts: the Triton one where `fp8_experts_triton`, else the Mosaic GPU one on a GPU)."""
    if scale_inv is not None:
        return fp8_triton or _fp8_kernel_ok(*w.shape[-2:])
    return impl == "pallas"


def fp8_experts_triton(impl: str, tokens: int) -> bool:
    """Whether block-FP8 experts of `tokens` tokens run the Triton grouped kernel's W8A8 path (impl "pallas", at
    most FP8_LINEAR_MAX_T tokens: decode sizes, where it quantizes the rows itself, reads each copy's token row and
    runs gate and up in one pass) rather than the Mosaic GPU W8A8 GEMM (fp8 wgmma: prefill sizes; XLA's form off a
    GPU)."""
    return impl == "pallas" and 1 <= tokens <= FP8_LINEAR_MAX_T


def shared_fusable(gmm_impl: str, routed: dict, shared: dict | None, same_reduction: bool, tokens: int = 0) -> int:
    """How many expert-sized chunks the shared experts are when they run as more groups of the routed experts'
    kernels (0: they run as their own MLP): experts of the grouped Pallas kernel (block-FP8 ones where `tokens`
    tokens take its fp8 path, `fp8_experts_triton`, with the routed experts' intermediate slice whole scale
    blocks), shared weights of the experts' dtype, stacked alike (both read at the layer or neither), a whole
    number of the routed experts' intermediate slices, and partial sums that go into the same reduction
    (`same_reduction`)."""
    if shared is None or gmm_impl != "pallas" or not same_reduction:
        return 0
    rg, sg = routed["gate_proj"], shared["gate_proj"]
    e4m3 = [is_fp8(ps[n]) for ps in (routed, shared) for n in ("gate_proj", "up_proj", "down_proj")]
    rw, sw = rg["weight"], sg["weight"]
    i_loc = rw.shape[-2]
    if any(e4m3) and not (all(e4m3) and fp8_experts_triton(gmm_impl, tokens) and i_loc % fp8.BLOCK == 0):
        return 0
    if isinstance(sw, LayerRow) or rw.dtype != sw.dtype or rw.ndim - sw.ndim != 1:
        return 0
    if sw.shape[-2] % i_loc or sw.shape[-1] != rw.shape[-1]:
        return 0
    if rw.ndim == 4 and rw.shape[0] != sw.shape[0]:
        return 0
    return sw.shape[-2] // i_loc


def _moe_plan(p: dict, cfg: DeepseekConfig, gmm_impl: str, stacked: dict, comm: Comm, tokens: int):
    """(routed experts' params, shared experts' or None, whether those are stacked, whether the routed / shared
    outputs are partial sums to all-reduce, the shared chunks run in the routed kernels (`shared_fusable`)) for a
    layer of `tokens` routed tokens."""
    ex = stacked.get("experts", p.get("experts"))
    sh_stacked = "shared_experts" in stacked
    sh = stacked["shared_experts"] if sh_stacked else p.get("shared_experts")
    E = cfg.n_routed_experts
    e_loc, i_loc = ex["gate_proj"]["weight"].shape[-3:-1]
    routed_split = e_loc * comm.dp != E or i_loc != cfg.moe_intermediate_size
    shared_split = sh is not None and sh["gate_proj"]["weight"].shape[-2] != cfg.moe_intermediate_size * (
        cfg.n_shared_experts or 0
    )
    # fused: the same tokens (no DP gather) and the same reduction (`shared_fusable` checks they are stacked alike)
    same = comm.dp == 1 and routed_split == shared_split
    fused = shared_fusable(gmm_impl, ex, sh, same, tokens) if cfg.n_shared_experts else 0
    return ex, sh, sh_stacked, routed_split, shared_split, fused


def _by_row(tokens: int, cfg: DeepseekConfig, gmm_impl: str, gate: dict) -> bool:
    """Whether the routed copies of `tokens` tokens skip the sort (`row_groups`): few copies on any path that takes
    them (`BY_ROW_MAX_COPIES`), a decode batch's on the Triton grouped kernel (`BY_GROUP_MAX_COPIES`)."""
    fp8 = is_fp8(gate)
    fp8_triton = fp8 and fp8_experts_triton(gmm_impl, tokens)
    copies = tokens * cfg.num_experts_per_tok
    if copies <= BY_ROW_MAX_COPIES:
        return by_row_ok(gmm_impl, gate["weight"], gate.get("weight_scale_inv"), fp8_triton)
    return copies <= BY_GROUP_MAX_COPIES and (fp8_triton if fp8 else gmm_impl == "pallas")


def moe_copies(
    p: dict,
    cfg: DeepseekConfig,
    tokens: int,
    *,
    gmm_impl: str = "ragged_dot",
    stacked: dict | None = None,
    comm: Comm = LOCAL,
) -> int | None:
    """The shared chunks S of the `ExpertCopies` that `moe(..., combine=False)` returns for `tokens` tokens, or None
    where the layer combines them itself: the copies stay in token order (a decode step's few, `BY_ROW_MAX_COPIES`),
    the shared experts run in the routed kernels (or there are none) and nothing is reduced across devices. p may
    hold `jax.ShapeDtypeStruct`s (only shapes and dtypes are read)."""
    plan = _moe_plan(p, cfg, gmm_impl, {} if stacked is None else stacked, comm, tokens)
    return _copies_chunks(plan, cfg, tokens, gmm_impl, comm)


def _copies_chunks(plan: tuple, cfg: DeepseekConfig, tokens: int, gmm_impl: str, comm: Comm) -> int | None:
    """`moe_copies` from the layer's `_moe_plan`."""
    ex, _, _, routed_split, _, fused = plan
    if tokens < 1 or comm.dp != 1 or routed_split or (cfg.n_shared_experts and not fused):
        return None
    return fused if _by_row(tokens, cfg, gmm_impl, ex["gate_proj"]) else None


def moe(
    p: dict,
    cfg: DeepseekConfig,
    x: jnp.ndarray,
    *,
    gmm_impl: str = "ragged_dot",
    stacked: dict | None = None,
    layer: jnp.ndarray | int | None = None,
    comm: Comm = LOCAL,
    logits: jnp.ndarray | None = None,
    combine: bool = True,
) -> jnp.ndarray | ExpertCopies:
    """Routed experts + shared experts. x [T, D] -> [T, D]. `logits`: the router's f32[T, E] when the input norm
    computed them (`router_fusable`). `combine=False` (where `moe_copies` allows it): the output left as
    `ExpertCopies`, for the next norm kernel to combine.

    Token copies are sorted by expert and run through grouped matmuls (`expert_glu`, `expert_gmm` with
    `gmm_impl`), so each expert only computes its own tokens; a decode step's few copies (at most
    BY_ROW_MAX_COPIES) stay in token order, each its own work item with its own expert (`row_groups`).
    With the grouped Pallas kernel (block-FP8 weights: at decode sizes, its fp8 path) the shared experts join
    those kernels (`shared_fusable`): their intermediate dim cut into S routed-expert-sized chunks, each token gets
    S more copies of router weight 1, so the step runs no separate shared MLP (three GEMMs, with fp8 weights their
    activations' quantization too).
    `stacked` and `layer` (see `model.split_experts`): {"experts": the routed experts of every layer of the
    group [layers, E, out, in], "shared_experts" (when split out): the shared ones [layers, out, in]}, used at
    `layer`, in place of p's.

    On a mesh (`comm`) this device holds E/n whole experts (expert parallel) or every expert's I/n slice;
    x is replicated, so every device routes all T tokens and keeps the copies routed to its experts (the
    others sort past the ragged groups, which the grouped matmul leaves at 0): the all-gather dispatch. The
    routed and shared partial sums go into one all-reduce, the combine. Nothing is dropped. Under DP
    (data-parallel attention, each "dp" rank its own tokens) the experts are split over "dp" too: the ranks'
    tokens are all-gathered first and the routed partial reduce-scattered back (`Comm.dispatch_tokens`,
    `Comm.combine_tokens`, which say why not an all-to-all); the shared experts run on the rank's own tokens.
    """
    stacked = {} if stacked is None else stacked
    plan = _moe_plan(p, cfg, gmm_impl, stacked, comm, x.shape[0] * comm.dp)
    ex, sh, sh_stacked, routed_split, shared_split, fused = plan
    if not combine and _copies_chunks(plan, cfg, x.shape[0], gmm_impl, comm) is None:
        raise ValueError("moe(combine=False): these experts and tokens are combined in the layer (`moe_copies`)")
    with jax.named_scope("moe_dispatch"):
        xr = comm.dispatch_tokens(x)  # DP: [dp*T, D], every DP rank's tokens
    with jax.named_scope("moe_router"):
        weights, ids = route(p["gate"], cfg, xr, logits if comm.dp == 1 else None)  # [T, K]
    with jax.named_scope("moe_routed"):
        exl = None if "experts" not in stacked else layer  # layer indexes stacked weights
        routed = _routed_experts(cfg, xr, weights, ids, gmm_impl, ex, exl, comm, sh if fused else None, combine)
    if not combine:
        return routed  # ExpertCopies (one device's tokens, no shared MLP, nothing to reduce: `moe_copies`)
    with jax.named_scope("moe_combine"):
        routed = comm.combine_tokens(routed)  # DP: this rank's [T, D], summed over the DP ranks' experts
    split, whole = [], []
    (split if routed_split else whole).append(routed)
    if cfg.n_shared_experts and not fused:
        with jax.named_scope("moe_shared"):  # stacked: the layer's rows (one index: `linears`), read in place
            shp = sh
            if sh_stacked:
                index = jnp.asarray(layer, jnp.int32)
                shp = jax.tree.map(lambda a: LayerRow(a, index), sh)
            (split if shared_split else whole).append(mlp(shp, x).astype(routed.dtype))
    out = sum(whole[1:], whole[0]) if whole else None
    if split:
        part = comm.reduce_model(sum(split[1:], split[0]))
        out = part if out is None else out + part
    return out.astype(x.dtype)


def _routed_experts(cfg, x, weights, ids, gmm_impl, ex, layer, comm, shared=None, combine=True):
    """The routed experts' weighted sum [T, D] for x [T, D], router weights f32[T, K] and ids i32[T, K]; with
    `shared` (its chunks S = `shared_fusable`) plus the shared experts' output, each token's S more copies. With
    `combine=False` (copies in token order only: `moe` checks `moe_copies`) the `ExpertCopies`."""
    T, D = x.shape
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    e_loc, i_loc = ex["gate_proj"]["weight"].shape[-3:-1]
    S = 0 if shared is None else shared["gate_proj"]["weight"].shape[-2] // i_loc
    C = K + S  # copies per token: its routed experts, then the shared chunks (groups e_loc..e_loc+S-1)
    if e_loc != E:  # expert parallel: keep the copies routed to experts [e0, e0 + e_loc)
        local = ids - comm.expert_rank() * e_loc
        mine = (local >= 0) & (local < e_loc)  # [T, K]
    else:
        local, mine = ids, None
    chunks = jnp.broadcast_to(e_loc + jnp.arange(S, dtype=jnp.int32), (T, S))
    gate_w = ex["gate_proj"]
    fp8_triton = is_fp8(gate_w) and fp8_experts_triton(gmm_impl, T)
    mosaic_fp8 = is_fp8(gate_w) and not fp8_triton
    if _by_row(T, cfg, gmm_impl, gate_w):
        order = None  # copies stay in token order; another device's (-1) comes out 0
        key = (local if mine is None else jnp.where(mine, local, -1)).astype(jnp.int32)
        # [T, K]: the Triton kernel numbers the copies (the T*K routed ones, then the S chunks', `copy_groups`) and
        # reads each copy's token row itself; the Mosaic GPU fp8 one takes the copies' groups and rows
        row_groups = key.reshape(-1) if mosaic_fp8 else key
        group_sizes = None
        xs = x[jnp.arange(T * K, dtype=jnp.int32) // K] if mosaic_fp8 else x
    else:
        row_groups = None
        key = local if mine is None else jnp.where(mine, local, e_loc + S)  # other devices' copies sort last
        key = jnp.concatenate([key.astype(jnp.int32), chunks], axis=1).reshape(-1)  # [T*C]
        order = jnp.argsort(key, stable=True)
        # [E_loc + S] (key == e_loc + S is dropped): compare-and-count, one fusion where bincount is a scatter kernel
        group_sizes = jnp.sum(key[None, :] == jnp.arange(e_loc + S, dtype=key.dtype)[:, None], axis=1, dtype=jnp.int32)
        xs = x[order // C]  # [T*C, D], the source token of each sorted copy

    h = expert_glu(  # [T*C, I]
        xs, ex["gate_proj"], ex["up_proj"], group_sizes, gmm_impl, layer, row_groups, shared, fp8_triton
    )
    down = ex["down_proj"]
    shared_down = {} if shared is None else shared["down_proj"]
    # [T*C, D], sorted by expert (or in token order, by row)
    y = expert_gmm(
        h,
        down["weight"],
        group_sizes,
        gmm_impl,
        layer,
        down.get("weight_scale_inv"),
        row_groups,
        shared_down.get("weight"),
        fp8_triton,
        shared_down.get("weight_scale_inv"),
        out_dtype=xs.dtype,
    )
    # Combine: each token gathers its C copies back through the inverse permutation and sums them, weighted (a
    # gather-reduce fusion). A scatter-add of the sorted copies into [T, D] took 5.3 us a layer at T = 1 on the
    # H200 (all K copies add into one row: atomics on the same addresses).
    if order is not None:
        inv = jnp.zeros_like(order).at[order].set(jnp.arange(T * C, dtype=order.dtype))  # copy -> sorted row
        y = y[inv]
    w = weights if mine is None else jnp.where(mine, weights, 0.0)  # f32[T, K]
    if order is None:  # the kernel's order (`grouped_matmul.copy_groups`): T*K routed copies, then S chunks' T
        copies = ExpertCopies(y, w.astype(jnp.float32), S)
        return copies if not combine else copies.combine()
    w = jnp.concatenate([w, jnp.ones((T, S), w.dtype)], axis=1)  # the shared chunks: weight 1
    copies = y.reshape(T, C, D).astype(jnp.float32)  # [T, C, D]
    return jnp.sum(copies * w[:, :, None], axis=1).astype(y.dtype)
