"""Pieces every Triton kernel here shares: float32-accurate tensor-core dots from TF32 halves,
the clamped BCE epilogue, libdevice or interpreter math, and the pre-split weight workspace.

elbo_forward.py (slab forward) and iwae.py import these, so there is one definition of
"float32-accurate decoder + BCE" in the backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ... import contract
from ...params import VAEParams
from .fp16x3 import INV_LO_SCALE, _pow2f, _split16

# Read when this module is imported: @triton.jit decides then between compiling for the GPU and
# running in the numpy interpreter, so the math helpers below are chosen at the same moment.
INTERPRET = bool(triton.knobs.runtime.interpret)

if INTERPRET:
    # The interpreter cannot call libdevice; numpy's float32 exp/log stand in. log1p(v) through
    # log(1 + v) * v / ((1 + v) - 1) is accurate to a few ulp (Goldberg); exact when 1 + v == 1.
    @triton.jit
    def _exp(v):
        return tl.exp(v)

    @triton.jit
    def _log(v):
        return tl.log(v)

    @triton.jit
    def _add_rn(a, b):
        return a + b  # the interpreter's dots are numpy float32 products: nothing to fold

    @triton.jit
    def _lg2(v):
        return tl.log2(v)

    @triton.jit
    def _rcp_den(den):
        return 1.0 / den

    @triton.jit
    def _clamp100(v):
        return tl.maximum(v, -100.0, propagate_nan=tl.PropagateNan.ALL)
else:
    from triton.language.extra import libdevice

    # libdevice (__nv_expf, __nv_logf, __nv_log1pf) matches what PyTorch's own CUDA kernels call;
    # tl.exp / tl.log lower to ex2.approx / lg2.approx, whose error near saturation (p -> 0 or 1)
    # would move the clamped BCE by more than the 1e-4 the contract allows.
    @triton.jit
    def _exp(v):
        return libdevice.exp(v)

    @triton.jit
    def _log(v):
        return libdevice.log(v)

    @triton.jit
    def _add_rn(a, b):
        """a + b as one float32 round-to-nearest add that no compiler pass moves into an MMA:
        Triton's combine pass rewrites `c + tl.dot(a, b)` as dot(a, b, c), whose additions
        truncate (see _encode_hidden)."""
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _asm1(v, op: tl.constexpr):
        return tl.inline_asm_elementwise(op, "=r,r", [v], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _lg2(v):
        """The hardware log2 (MUFU; 2^-22 relative, 2^-22.6 absolute on [0.5, 2])."""
        return _asm1(v, "lg2.approx.ftz.f32 $0, $1;")

    @triton.jit
    def _rcp_den(den):
        """1 / den for den in [1, inf] or NaN, bit-exact to IEEE division below 2^100
        (rcp.approx + one Newton FMA, as cuda/iwae.cu's rcp_den; checked on every float,
        benchmarks/PERF.md); above, 1 / den < 2^-100 and only 1 - p = 1 matters, which holds."""
        d = tl.minimum(den, 1.2676506002282294e30)  # 2^100; NaN stays NaN through the logs
        r = _asm1(d, "rcp.approx.ftz.f32 $0, $1;")
        return tl.fma(r, tl.fma(-d, r, 1.0), r)

    @triton.jit
    def _clamp100(v):
        """max(v, -100) keeping NaN (PyTorch's std::max), one instruction."""
        return _asm1(v, "max.NaN.f32 $0, $1, 0fC2C80000;")


@triton.jit
def _split(v):
    """v = hi + lo, hi holding v's top 11 significant bits (exact in TF32, rounded to nearest),
    so that a TF32 tensor-core product of hi and lo parts loses nothing at fp32 scale.
    Where rounding up would carry past FLT_MAX (|v| within 2^-12 of it) hi is truncated
    instead: a finite v never gives hi = inf (and lo = -inf), which would turn a huge but
    finite operand's products into inf - inf = NaN. NaN stays NaN in hi (the bit trick alone
    would turn the GPU's 0x7FFFFFFF into -0)."""
    u = v.to(tl.uint32, bitcast=True)
    hi = ((u + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    hi = tl.where(tl.abs(hi) == float("inf"), (u & 0xFFFFE000).to(tl.float32, bitcast=True), hi)
    hi = tl.where(v != v, v, hi)  # noqa: PLR0124 (NaN test; works in the interpreter too)
    return hi, v - hi


@triton.jit
def _dot3(a_hi, a_lo, b_hi_ptrs, b_lo_ptrs, b_mask, acc):
    """acc + a @ b to about fp32 accuracy in three TF32 MMAs (hi*hi + hi*lo + lo*hi; the lo*lo
    term is ~2^-22 relative). B's halves come pre-split from the workspace, so they flow from
    global memory to shared memory straight into the MMAs. The two small terms are summed apart
    and NaN there is dropped, as Triton's own tf32x3 does: an infinite a gives lo = inf - inf,
    while fp32 gives inf * b_hi, which hi*hi alone reproduces."""
    b_hi = tl.load(b_hi_ptrs, mask=b_mask, other=0.0)
    b_lo = tl.load(b_lo_ptrs, mask=b_mask, other=0.0)
    corr = tl.dot(a_hi, b_lo, input_precision="tf32")
    corr = tl.dot(a_lo, b_hi, corr, input_precision="tf32")
    corr = tl.where(corr != corr, 0.0, corr)  # noqa: PLR0124 (NaN test)
    return tl.dot(a_hi, b_hi, acc + corr, input_precision="tf32")


@triton.jit
def _encode_hidden(x_rows, row_ok, enc_hi, enc_lo, enc_exp, enc_b, hh, h_ok,
                   D: tl.constexpr, W_STRIDE: tl.constexpr, BLOCK_K: tl.constexpr,
                   HALF: tl.constexpr):
    """(relu(x @ enc_w[hh, :]^T + enc_b[hh]) as a [BM, BH] tile, invalid-x count per row).

    HALF: enc_hi / enc_lo are fp16x3.split_weights16's scaled float16 halves with one exponent
    per hidden unit (enc_exp), and x is split into float16 halves (unscaled: x is in [0, 1] in
    every valid row), lo halves LO_SCALE times their remainder; else TF32 halves
    (common._split, enc_exp unused).

    x_rows: [BM, 1] pointers to the rows' starts; enc_hi / enc_lo: the weight halves (row
    stride W_STRIDE, split_weights; TMA descriptors for them measured no faster on the H200 and
    cost host time per launch). The encoder is the one layer whose K is long (D = 784) and
    whose operands are unscaled data. A tensor core adds each MMA's exact products
    to its accumulator and truncates the sum, so one accumulator carried over all of K drifts
    toward zero by up to ~1 ulp per k8 step, and the small hi * lo terms added into it drown:
    that failed test_saturated_params (a CPU emulation of the tensor core reproduced it, and
    passed with this scheme at k tiles of 16 to 112). Here each k tile's three products
    start from zero (small terms first) and join the running sum through a float32
    round-to-nearest add. x is finite in every valid row (invalid rows end NaN anyway), so no
    NaN guard on the small terms: an infinite weight gives NaN here where float32 gives +-inf
    (as before this scheme; not a case the contract covers)."""
    k_idx = tl.arange(0, BLOCK_K)
    acc = tl.zeros([x_rows.shape[0], hh.shape[0]], dtype=tl.float32)
    bad = tl.zeros([x_rows.shape[0], BLOCK_K], dtype=tl.int32)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + k_idx
        k_ok = kk < D
        m = row_ok[:, None] & k_ok[None, :]
        xt = tl.load(x_rows + kk[None, :], mask=m, other=0.0)
        # Targets outside [0, 1] (or NaN) make the row NaN; counted here, where x is in
        # registers anyway, per element (the row sums once after the loop, no shuffles here).
        bad += tl.where(m & ~((xt >= 0.0) & (xt <= 1.0)), 1, 0)
        if HALF:
            x_hi, x_lo = _split16(xt, 1.0)
        else:
            x_hi, x_lo = _split(xt)
        w_off = hh[None, :] * W_STRIDE + kk[:, None]
        w_mask = k_ok[:, None] & h_ok[None, :]
        w_hi = tl.load(enc_hi + w_off, mask=w_mask, other=0.0)
        w_lo = tl.load(enc_lo + w_off, mask=w_mask, other=0.0)
        tile = tl.dot(x_lo, w_hi, input_precision="tf32")
        tile = tl.dot(x_hi, w_lo, tile, input_precision="tf32")
        if HALF:  # float16 lo halves are LO_SCALE times their remainder (fp16x3.py)
            tile = tile * INV_LO_SCALE
        tile = tl.dot(x_hi, w_hi, tile, input_precision="tf32")
        acc = _add_rn(acc, tile)
    if HALF:
        acc = acc * _pow2f(tl.load(enc_exp + hh, mask=h_ok, other=0))[None, :]
    hb = tl.load(enc_b + hh, mask=h_ok, other=0.0)
    h = tl.maximum(acc + hb[None, :], 0.0, propagate_nan=tl.PropagateNan.ALL)
    return h, tl.sum(bad, axis=1)


@triton.jit
def _log1p_small(u):
    """log1p(u) for |u| < 2^-7 by its series to u^4: relative error < 2^-23 there."""
    return u * (1.0 + u * (-0.5 + u * (0.3333333432674408 - 0.25 * u)))


@triton.jit
def _bce_rowsum(logits, xv, mask):
    """Row sums of F.binary_cross_entropy(sigmoid(logits), x) with PyTorch's float32 numerics
    where they decide anything, in ~35 instructions per element instead of IEEE logf + log1pf
    + division (~60, and 250 registers at a [128, 64] tile; benchmarks/PERF.md).

    den = 1 + expf(-a) and p = 1 / den exactly as PyTorch rounds them (libdevice expf, _rcp_den),
    so 1 - p, and which elements the -100 clamps hit, are PyTorch's. Then
        log p      = log1p(p - 1) by its series where p > 1 - 2^-7 (p - 1 exact), else
                     -log2(den) ln 2 (differs from log of the rounded p by <= 2^-24 absolute);
        log(1 - p) = log1p(-p) by its series where p < 2^-7, else log2(1 - p) ln 2 (1 - p
                     rounded by <= 2^-25; exact for p >= 1/2; 0 when p = 1: -inf, clamped).
    Outside the series' ranges every |log| is >= 2^-7, so the hardware log2's 2^-22.6 absolute
    error is <= 2^-16 of the term: a row sum moves by < 2^-16 relative (the contract is 1e-4).
    A NaN logit gives NaN through -log2(den)."""
    den = 1.0 + _exp(-logits)
    p = _rcp_den(den)
    ln2 = 0.6931471805599453
    log_p = tl.where(p > 0.9921875, _log1p_small(p - 1.0), -_lg2(den) * ln2)
    log_q = tl.where(p < 0.0078125, _log1p_small(-p), _lg2(1.0 - p) * ln2)
    e = (xv - 1.0) * _clamp100(log_q) - xv * _clamp100(log_p)
    return tl.sum(tl.where(mask, e, 0.0), axis=1)


@triton.jit
def _decoder_hidden(z_hi, z_lo, w1_hi, w1_lo, b1_ptr, hh, h_ok, l_idx, l_ok, L: tl.constexpr):
    """d chunk [BM, BH] = relu(z @ dec_w1[hh, :]^T + dec_b1[hh]), split for the next MMA."""
    return _split(_decoder_hidden_f32(z_hi, z_lo, w1_hi, w1_lo, b1_ptr, hh, h_ok, l_idx, l_ok, L))


@triton.jit
def _decoder_hidden_f32(z_hi, z_lo, w1_hi, w1_lo, b1_ptr, hh, h_ok, l_idx, l_ok,
                        L: tl.constexpr):
    """The same d chunk in float32, unsplit."""
    w_off = hh[None, :] * L + l_idx[:, None]
    b1 = tl.load(b1_ptr + hh, mask=h_ok, other=0.0)
    acc = tl.zeros([z_hi.shape[0], hh.shape[0]], dtype=tl.float32) + b1[None, :]
    d = _dot3(z_hi, z_lo, w1_hi + w_off, w1_lo + w_off, l_ok[:, None] & h_ok[None, :], acc)
    return tl.maximum(d, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _split_weights_kernel(enc_w, mu_w, lv_w, dec_w1, dec_w2,
                          enc_hi, enc_lo, mu_hi, mu_lo, lv_hi, lv_lo, w1_hi, w1_lo, w2_hi, w2_lo,
                          D: tl.constexpr, H: tl.constexpr, L: tl.constexpr,
                          DP: tl.constexpr, HP: tl.constexpr, BLOCK: tl.constexpr,
                          BIG: tl.constexpr):
    """Each weight matrix w -> (hi, lo) once per forward (1.7 MB at 784/256/32, one launch).
    enc_w and dec_w2 land with row strides DP and HP (multiples of 4; see split_weights), and
    only if BIG."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if BIG:
        _split_store(enc_w, enc_hi, enc_lo, offs, H, D, DP)
        _split_store(dec_w2, w2_hi, w2_lo, offs, D, H, HP)
    _split_store(mu_w, mu_hi, mu_lo, offs, L, H, H)
    _split_store(lv_w, lv_hi, lv_lo, offs, L, H, H)
    _split_store(dec_w1, w1_hi, w1_lo, offs, H, L, L)


@triton.jit
def _split_store(src, hi_ptr, lo_ptr, offs, ROWS: tl.constexpr, COLS: tl.constexpr,
                 STRIDE: tl.constexpr):
    m = offs < ROWS * COLS
    hi, lo = _split(tl.load(src + offs, mask=m, other=0.0))
    dst = (offs // COLS) * STRIDE + offs % COLS
    tl.store(hi_ptr + dst, hi, mask=m)
    tl.store(lo_ptr + dst, lo, mask=m)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _check(x: torch.Tensor, params: VAEParams, eps: torch.Tensor) -> None:
    """The kernels' terms beyond the op's contract: dense contiguous float32 on one device
    (a CUDA one, or any under the interpreter), sizes in int32."""
    contract.check_kernel_tensors(
        "triton", [("x", x), ("eps", eps), *zip(VAEParams._fields, params)],
        device_type=None if INTERPRET else "cuda")


SPLIT_BLOCK = 1024


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4


def split_weights(params: VAEParams, big: bool = True) -> list[torch.Tensor]:
    """[hi, lo] for enc_w, mu_w, lv_w, dec_w1, dec_w2: one workspace of 2 x 1.7 MB (784/256/32),
    from the caching allocator, so CUDA-graph capture sees an ordinary in-graph allocation.
    Every half starts 16-byte aligned, and enc_w's and dec_w2's halves have row strides padded
    to a multiple of 4 floats (dec_w2's for the decoder's stacked_descriptor, hi right before
    lo; enc_w's padding is no longer needed since the encoder reads by pointers, and was kept
    as measured); read row strides through .stride(0). big=False leaves out enc_w and dec_w2
    (their halves come back empty: the fp16x3 slab forward splits them itself)."""
    d, h, lat = params.dims
    weights = (params.enc_w, params.mu_w, params.lv_w, params.dec_w1, params.dec_w2)
    shapes = [((h if big else 0, d), _pad4(d)), ((lat, h), h), ((lat, h), h), ((h, lat), lat),
              ((d if big else 0, h), _pad4(h))]
    sizes = [_pad4(rows * stride) for (rows, _), stride in shapes]
    ws = torch.empty(2 * sum(sizes), dtype=torch.float32, device=params.enc_w.device)
    halves, off = [], 0
    for ((rows, cols), stride), n in zip(shapes, sizes):
        for part in (0, 1):  # one view op per half: this runs on every forward (host time)
            halves.append(ws.as_strided((rows, cols), (stride, 1), off + part * n))
        off += 2 * n
    grid = (triton.cdiv(max(w.numel() for w in (weights if big else weights[1:4])),
                        SPLIT_BLOCK),)
    _split_weights_kernel[grid](*weights, *halves, D=d, H=h, L=lat, DP=_pad4(d), HP=_pad4(h),
                                BLOCK=SPLIT_BLOCK, BIG=big)
    return halves


def stacked_descriptor(hi: torch.Tensor, lo: torch.Tensor, block: tuple[int, int]):
    """One TMA descriptor over two halves that lie one after the other with the same row stride
    (a weight's halves from split_weights, or a workspace's): rows [0, R) read hi, rows [R, 2R)
    read lo. Reads beyond the columns or past the last row come back as zeros; a block that
    runs past row R reads lo's first rows, so kernels must mask those rows' results (they do:
    they are outside the matrix). One descriptor instead of two halves the host's per-launch
    descriptor work (Triton encodes each one on the host at every launch)."""
    rows, cols = hi.shape
    stride = hi.stride(0)
    if lo.data_ptr() != hi.data_ptr() + rows * stride * hi.element_size() or lo.stride(0) != stride:
        raise ValueError("stacked_descriptor needs lo right after hi, with the same row stride")
    return TensorDescriptor(hi, [2 * rows, cols], [stride, 1], list(block))

