"""The backward's fused engine on the CPU (issue #56 item 4): backward_fused.cu's kernels and
binding_backward_fused.cpp's order, as NumPy replays them.

What is modelled is what the CPU can get wrong: each kernel's grid (row tiles x column groups,
then the side jobs' 32 x 32 tiles; a block per R rows; output tiles x row chunks), the element
every block writes and where (flat buffers with the kernels' index arithmetic, each element
counted: written exactly once, padding never), the operands' layouts as the GEMMs read them back
through TMA's view (rows of K floats at stride ld, zeros past K), the TF32 splits
(tf32_split_inf / tf32_split_act, bit for bit), tc_gemm.cu's kTcStore numerics (per K stage of 32
the three TF32 products, joined by a float32 add, split K summed in split order, the mask), and
every float32 sum in its order (one FMA chain per output; row chunks added in chunk order).
h, mu, lv, z and d come from torch's float32 ops, as the engine takes them from cuBLAS.

Constants as backward_fused.h, tc_gemm.cu and elbo.h have them (test_cuda_fused_backward.py
reads them there); tc_gemm_splits and fused_col_groups as the host functions compute them
(test_cuda_compile.py runs the real ones against these).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

T = 32                 # kFusedTile
WIDE_ROWS = 2048       # kFusedWideRows: the latent kernel's R = 32 from here (else 8)
WGRAD_ROWS = 256       # kWgradRows
WGRAD_MAX = 8          # kWgradMax
THREADS, WARPS = 256, 8  # kThreads, kWarps
TC_BM, TC_BN, TC_BK = 128, 128, 32  # TcShape<kTcStore>::kBM, kTcTileN, tc::kBK
SMS = 132              # an H100's multiprocessors
F32 = np.float32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round4(v: int) -> int:
    return (v + 3) // 4 * 4


# ---- host plans (backward_fused.cu, tc_gemm.cu) -------------------------------------------
def col_groups(n: int, d: int, sms: int = SMS) -> int:
    """fused_col_groups: about one wave of row-tile blocks, at most one per column tile."""
    return max(1, min(cdiv(d, T), cdiv(sms, cdiv(n, T))))


def tc_splits(m: int, n: int, k: int, sms: int = SMS) -> int:
    """tc_gemm_splits."""
    blocks = cdiv(m, TC_BM) * cdiv(n, TC_BN)
    most, want = cdiv(k, TC_BK) // 2, sms // blocks
    return 1 if want < 2 or most < 2 else min(want, most)


def latent_rows(n: int) -> int:
    """fused_latent_plan's R (where R = 32 fits the shared memory: the dims tested here)."""
    return 32 if n >= WIDE_ROWS else 8


# ---- float32 arithmetic as the kernels round it --------------------------------------------
def fma(a, b, c):
    """fmaf(a, b, c): the exact product (float64 holds it) plus c, rounded to float32 (through
    float64: a double rounding that differs from one rounding in rare ties only)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64)
            + np.asarray(c, np.float64)).astype(F32)


def tf32(v: np.ndarray) -> np.ndarray:
    """The top 11 significant bits (hi's bits; what the MMA reads of any float32 operand)."""
    return (np.asarray(v, F32).view(np.uint32) & np.uint32(0xFFFFE000)).view(F32)


def split_inf(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """elbo_math.cuh tf32_split_inf."""
    v = np.asarray(v, F32)
    hi = tf32(v)
    with np.errstate(invalid="ignore"):
        lo = (v - hi).astype(F32)
        lo = np.where(~np.isfinite(v), v, np.where(lo == 0, hi * F32(5.9604645e-8), lo))
    return hi, lo.astype(F32)


def split_act(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """elbo_math.cuh tf32_split_act."""
    v = np.asarray(v, F32)
    hi = tf32(v)
    with np.errstate(invalid="ignore"):
        lo = (v - hi).astype(F32)
    return hi, np.where(np.isnan(lo), v, lo).astype(F32)


def sigmoid(a):
    with np.errstate(over="ignore"):
        return (F32(1) / (F32(1) + np.exp(-a.astype(F32)))).astype(F32)


def bce_grad_elem(a, xv, g_rec, row_nan):
    """elbo_math.cuh bce_grad_elem (g_rec, row_nan: per row, broadcast)."""
    g = np.where(row_nan, F32(0), g_rec).astype(F32)
    pr = sigmoid(a)
    safe = np.where(row_nan, F32(0.5), pr)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        den = np.fmax(((F32(1) - safe) * safe).astype(F32), F32(1e-12))  # fmaxf
        gp = ((g * (safe - xv).astype(F32)).astype(F32) / den).astype(F32)
        return ((np.where(row_nan, F32(0), gp) * (F32(1) - pr).astype(F32)).astype(F32)
                * pr).astype(F32)


def bce_grad_x(a, g_rec, row_nan, keep):
    """elbo_math.cuh bce_grad_x."""
    safe = np.where(row_nan, F32(0.5), sigmoid(a))
    with np.errstate(divide="ignore", invalid="ignore"):
        logit = np.log((safe / (F32(1) - safe).astype(F32)).astype(F32)).astype(F32)
    return np.where(keep, (-logit * np.where(row_nan, F32(0), g_rec)).astype(F32), F32(0))


def latent_grads(gz, ep, gk, mu, lv, rec: bool, kl: bool):
    """elbo_math.cuh latent_grads, elementwise."""
    with np.errstate(over="ignore", invalid="ignore"):
        sd = np.exp((F32(0.5) * lv).astype(F32)).astype(F32)
        zero = np.zeros_like(lv)
        gm, gl, ge = zero, zero, zero
        if rec:
            gm = gz
            gl = (F32(0.5) * ((gz * ep).astype(F32) * sd).astype(F32)).astype(F32)
            ge = (gz * sd).astype(F32)
        if kl:
            kl_mu = (gk * mu).astype(F32)
            kl_lv = ((F32(-0.5) * gk).astype(F32)
                     * (F32(1) - np.exp(lv).astype(F32)).astype(F32)).astype(F32)
            gm = (gm + kl_mu).astype(F32) if rec else kl_mu
            gl = (gl + kl_lv).astype(F32) if rec else kl_lv
    return gm, gl, ge


# ---- buffers that count their writes --------------------------------------------------------
class Buf:
    """A flat float32 buffer as the kernels see one: NaN until written, every write counted."""

    def __init__(self, size: int):
        self.v = np.full(size, np.nan, F32)
        self.n = np.zeros(size, np.int64)

    def put(self, idx, vals) -> None:
        idx = np.asarray(idx).ravel()
        np.add.at(self.n, idx, 1)
        self.v[idx] = np.asarray(vals, F32).ravel()

    def written_once(self, idx) -> bool:
        return bool((self.n[np.asarray(idx).ravel()] == 1).all())

    def untouched_elsewhere(self, idx) -> bool:
        mask = np.ones(self.v.size, bool)
        mask[np.asarray(idx).ravel()] = False
        return bool((self.n[mask] == 0).all())


class Operand:
    """A GEMM operand as TcSplits::add lays it: (halves, rows, ld), ld = round4(cols)."""

    def __init__(self, rows: int, cols: int, split: bool):
        self.rows, self.cols, self.ld = rows, cols, round4(cols)
        self.halves = [Buf(rows * self.ld) for _ in range(2 if split else 1)]

    def index(self):
        """Flat indices of the real elements (the padding columns cols..ld excluded)."""
        r, c = np.meshgrid(np.arange(self.rows), np.arange(self.cols), indexing="ij")
        return r * self.ld + c

    def view(self, half: int = 0) -> np.ndarray:
        """What TMA reads: rows of `cols` floats at stride ld."""
        return self.halves[half].v.reshape(self.rows, self.ld)[:, :self.cols]

    def check(self) -> None:
        for h in self.halves:
            assert h.written_once(self.index()), "an operand element not written exactly once"
            assert h.untouched_elsewhere(self.index()), "an operand's padding written"


def put_job(dst: Operand, idx, vals) -> None:
    """backward_fused.cu put: the halves (tf32_split_inf), or a plain copy."""
    if len(dst.halves) == 1:
        dst.halves[0].put(idx, vals)
    else:
        hi, lo = split_inf(vals)
        dst.halves[0].put(idx, hi)
        dst.halves[1].put(idx, lo)


def tile_job(src: np.ndarray, dst: Operand, trans: bool) -> None:
    """A side job (tile_job): every 32 x 32 tile of src, row-major over its tiles."""
    rows, cols = src.shape
    for tb in range(cdiv(rows, T) * cdiv(cols, T)):
        r0, c0 = (tb // cdiv(cols, T)) * T, (tb % cdiv(cols, T)) * T
        r = np.arange(r0, min(r0 + T, rows))[:, None]
        c = np.arange(c0, min(c0 + T, cols))[None, :]
        if trans:  # destination row c, column r
            put_job(dst, (c * dst.ld + r).T, src[r, c].T)
        else:
            put_job(dst, r * dst.ld + c, src[r, c])


def row_tiles(n: int, d: int, groups: int):
    """The row-tile kernels' main blocks (row_tile): (r0, column tiles, first)."""
    tiles = cdiv(d, T)
    for b in range(cdiv(n, T) * groups):
        rt, cg = divmod(b, groups)
        yield rt * T, range(cg * tiles // groups, (cg + 1) * tiles // groups), cg == 0


def tile_rows_cols(r0: int, ct: int, n: int, d: int):
    r = np.arange(r0, min(r0 + T, n))
    c = np.arange(ct * T, min(ct * T + T, d))
    return r, c


# ---- the kernels ----------------------------------------------------------------------------
def fused_prep(x, g_elbo, g_recon, g_kl, rec: bool, kl: bool, sms: int = SMS):
    """fused_prep_kernel's main blocks: (keep, g_rec, g_kl, xc, xc^T halves)."""
    n, d = x.shape
    keep, xc = Buf(n), Buf(n * d)
    grec, gkl = Buf(n), Buf(n)
    xt = Operand(d, n, True)
    ge = -g_elbo if g_elbo is not None else np.zeros(n, F32)
    for r0, cts, first in row_tiles(n, d, col_groups(n, d, sms)):
        rows = np.arange(r0, min(r0 + T, n))
        bad = ~((x[rows] >= 0) & (x[rows] <= 1)).all(axis=1)  # outside_unit, whole rows
        if first:
            keep.put(rows, np.where(bad, F32(0), F32(1)))
            if rec:  # branch_grad
                g = (g_recon[rows] + ge[rows]).astype(F32) if g_recon is not None else ge[rows]
                grec.put(rows, np.where(bad, F32(0), g))
            if kl:
                g = (g_kl[rows] + ge[rows]).astype(F32) if g_kl is not None else ge[rows]
                gkl.put(rows, np.where(bad, F32(0), g))
        for ct in cts:
            r, c = tile_rows_cols(r0, ct, n, d)
            v = np.where(bad[r - r0][:, None], F32(0), x[np.ix_(r, c)])
            xc.put(r[:, None] * d + c[None, :], v)
            put_job(xt, (c[None, :] * xt.ld + r[:, None]), v)  # xc^T row c, column r
    return keep, grec, gkl, xc, xt


def fused_bce_grad(logits, xc, g_rec, keep, need_x: bool, sms: int = SMS):
    """fused_bce_grad_kernel's main blocks: (ga, ga^T, gx)."""
    n, d = logits.shape
    ga, gx = Buf(n * d), Buf(n * d)
    gat = Operand(d, n, False)
    for r0, cts, _ in row_tiles(n, d, col_groups(n, d, sms)):
        rows = np.arange(r0, min(r0 + T, n))
        row_nan = np.isnan(logits[rows]).any(axis=1)
        for ct in cts:
            r, c = tile_rows_cols(r0, ct, n, d)
            a, nan = logits[np.ix_(r, c)], row_nan[r - r0][:, None]
            v = bce_grad_elem(a, xc[np.ix_(r, c)], g_rec[r][:, None], nan)
            ga.put(r[:, None] * d + c[None, :], v)
            if need_x:
                gx.put(r[:, None] * d + c[None, :],
                       bce_grad_x(a, g_rec[r][:, None], nan, keep[r][:, None] != 0))
            gat.halves[0].put(c[None, :] * gat.ld + r[:, None], v)
    return ga, gat, gx


def fused_latent(g_d, wd1, mu, lv, eps, g_kl, wmu, wlv, h, rec: bool, kl: bool):
    """fused_latent_kernel: values per element in the kernel's FMA order (independent of the
    block), writes per block of R rows: (g_mu, g_lv, g_eps, g_a1, g_a1^T)."""
    n, hd = h.shape
    lat = mu.shape[1]
    gz = np.zeros((n, lat), F32)
    if rec:
        for j in range(hd):  # one chain per (row, l), j ascending
            gz = fma(g_d[:, j:j + 1], wd1[j][None, :], gz)
    gk = g_kl[:, None] if kl else np.zeros((n, 1), F32)
    gm, gl, ge = latent_grads(gz, eps, gk, mu, lv, rec, kl)
    am = np.zeros((n, hd), F32)
    al = np.zeros((n, hd), F32)
    for k in range(lat):  # l ascending, one chain each
        am = fma(gm[:, k:k + 1], wmu[k][None, :], am)
        al = fma(gl[:, k:k + 1], wlv[k][None, :], al)
    with np.errstate(invalid="ignore"):
        a1 = np.where(h <= 0, F32(0), (am + al).astype(F32))  # threshold_backward(., h, 0)
    out = {name: Buf(n * lat) for name in ("g_mu", "g_lv", "g_eps")}
    g_a1, g_a1t = Buf(n * hd), Operand(hd, n, False)
    big = latent_rows(n)
    for b in range(cdiv(n, big)):
        rows = np.arange(b * big, min(b * big + big, n))
        e = rows[:, None] * lat + np.arange(lat)[None, :]
        for name, v in zip(("g_mu", "g_lv", "g_eps"), (gm, gl, ge)):
            out[name].put(e, v[rows])
        cols = np.arange(hd)[None, :]
        g_a1.put(rows[:, None] * hd + cols, a1[rows])
        g_a1t.halves[0].put(cols * g_a1t.ld + rows[:, None], a1[rows])
    return out["g_mu"], out["g_lv"], out["g_eps"], g_a1, g_a1t


def fused_wgrad(jobs, n: int):
    """fused_wgrad_kernel (+ its finish): jobs = [(g or None, a)], each dst = g^T a (or a's
    column sums), rows in ascending order per chunk of WGRAD_ROWS, chunks added in order."""
    assert 1 <= len(jobs) <= WGRAD_MAX
    chunks = cdiv(n, WGRAD_ROWS)
    outs = []
    for g, a in jobs:
        q = a.shape[1]
        p = 1 if g is None else g.shape[1]
        parts = []
        for y in range(chunks):
            acc = np.zeros((p, q), F32)
            for r in range(y * WGRAD_ROWS, min(n, (y + 1) * WGRAD_ROWS)):
                if g is None:
                    acc = (acc + a[r][None, :]).astype(F32)
                else:
                    acc = fma(g[r][:, None], a[r][None, :], acc)
            parts.append(acc)
        total = parts[0]
        if chunks > 1:  # fused_wgrad_finish_kernel: 0, then each chunk in order
            total = np.zeros((p, q), F32)
            for part in parts:
                total = (total + part).astype(F32)
        outs.append(total if g is not None else total[0])
    return outs


def wgrad_tiles(jobs, n: int):
    """fused_wgrad_kernel's grid as (job, output indices) per block, every chunk: each output
    of each chunk must be written exactly once."""
    written = [np.zeros((cdiv(n, WGRAD_ROWS), 1 if g is None else g.shape[1], a.shape[1]),
                        np.int64) for g, a in jobs]
    for t, (g, a) in enumerate(jobs):
        p, q = (1 if g is None else g.shape[1]), a.shape[1]
        tiles = cdiv(q, THREADS) if g is None else cdiv(p, T) * cdiv(q, T)
        for tb in range(tiles):
            for y in range(written[t].shape[0]):
                if g is None:
                    cols = np.arange(tb * THREADS, min(tb * THREADS + THREADS, q))
                    written[t][y, 0, cols] += 1
                else:
                    p0, q0 = (tb // cdiv(q, T)) * T, (tb % cdiv(q, T)) * T
                    for warp in range(WARPS):
                        pp = np.arange(p0 + warp, p0 + T, WARPS)  # p0 + warp + 8 i
                        pp = pp[pp < p]
                        qq = np.arange(q0, min(q0 + T, q))
                        written[t][y][np.ix_(pp, qq)] += 1
    return written


def tc_store(a: np.ndarray, w: Operand, bias=None, mask=None, w_finite=False, sms: int = SMS):
    """tc_gemm.cu kTcStore: a (M x K, as TMA reads it) times w's halves^T; per K stage of 32 the
    three TF32 products (lo*hi + hi*lo + hi*hi, summed exactly here, rounded once) joined to the
    running sum by a float32 add; K split in tc_splits parts, summed in split order; + bias in
    split 0; 0 where mask <= 0."""
    m, k = a.shape
    n = w.rows
    assert w.cols == k, (w.cols, k)
    a_hi, a_lo = (split_act if w_finite else split_inf)(a)
    w_hi, w_lo = w.view(0).astype(F32), w.view(1).astype(F32)
    splits, nk = tc_splits(m, n, k, sms), cdiv(k, TC_BK)
    runs = []
    for z in range(splits):
        run = np.zeros((m, n), F32)
        if z == 0 and bias is not None:
            run = run + bias[None, :].astype(F32)
        for kt in range(z * nk // splits, (z + 1) * nk // splits):
            ks = slice(kt * TC_BK, min(k, (kt + 1) * TC_BK))
            with np.errstate(invalid="ignore", over="ignore"):
                acc = (tf32(a_lo[:, ks]).astype(np.float64) @ w_hi[:, ks].T.astype(np.float64)
                       + a_hi[:, ks].astype(np.float64) @ tf32(w_lo[:, ks]).T.astype(np.float64)
                       + a_hi[:, ks].astype(np.float64) @ w_hi[:, ks].T.astype(np.float64))
            run = (run + acc.astype(F32)).astype(F32)
        runs.append(run)
    v = runs[0]
    for run in runs[1:]:  # tc_splitk_kernel
        v = (v + run).astype(F32)
    return np.where(mask <= 0, F32(0), v) if mask is not None else v


# ---- the engine ------------------------------------------------------------------------------
def fused_backward(x, params, eps, grads, *, need_x=True, need_eps=True, sms: int = SMS):
    """binding_backward_fused.cpp's fused_backward on float32 torch tensors (CPU): [g_x, g_eps,
    10 parameter grads] as torch tensors, and the operands it built (each checked: every element
    written once, the padding never). Overflow, inf - inf and the like are the regimes' own."""
    with np.errstate(all="ignore"):
        return _fused_backward(x, params, eps, grads, need_x, need_eps, sms)


def _fused_backward(x, params, eps, grads, need_x, need_eps, sms):
    enc_w, enc_b, mu_w, mu_b, lv_w, lv_b, dec_w1, dec_b1, dec_w2, dec_b2 = params
    g_elbo, g_recon, g_kl = (None if g is None else g.numpy() for g in grads)
    rec, kl = g_elbo is not None or g_recon is not None, g_elbo is not None or g_kl is not None
    n, d = x.shape
    hd, lat = enc_w.shape[0], mu_w.shape[0]
    np_ = {k: v.numpy() for k, v in zip(("enc_w", "mu_w", "lv_w", "dec_w1", "dec_w2", "dec_b2"),
                                         (enc_w, mu_w, lv_w, dec_w1, dec_w2, dec_b2))}
    keep, grec, gkl, xc, xt = fused_prep(x.numpy(), g_elbo, g_recon, g_kl, rec, kl, sms)
    built = {"xt": xt}
    xc_t = torch.from_numpy(xc.v.reshape(n, d))
    h = F.relu(F.linear(xc_t, enc_w, enc_b))  # cuBLAS in the engine: the reference's bits
    mu, lv = F.linear(h, mu_w, mu_b), F.linear(h, lv_w, lv_b)
    out = [np.zeros((n, d), F32), np.zeros((n, lat), F32)] + [np.zeros(t.shape, F32)
                                                                for t in params]
    g_d = ga = z = None
    if rec:
        dec_h, dec_t = Operand(d, hd, True), Operand(hd, d, True)
        tile_job(np_["dec_w2"], dec_h, False)
        tile_job(np_["dec_w2"], dec_t, True)
        z = mu + torch.exp(0.5 * lv) * eps
        dd = F.relu(F.linear(z, dec_w1, dec_b1)).numpy()
        logits = tc_store(dd, dec_h, bias=np_["dec_b2"], w_finite=True, sms=sms)
        gab, gat, gx = fused_bce_grad(logits, xc.v.reshape(n, d), grec.v, keep.v, need_x, sms)
        dt = Operand(hd, n, True)
        tile_job(dd, dt, True)
        ga = gab.v.reshape(n, d)
        g_d = tc_store(ga, dec_t, mask=dd, w_finite=True, sms=sms)
        out[10] = tc_store(gat.view(), dt, sms=sms)
        if need_x:
            out[0] = gx.v.reshape(n, d)
        built.update(dec_h=dec_h, dec_t=dec_t, gat=gat, dt=dt)
        z = z.numpy()
    gm, gl, ge, g_a1, g_a1t = fused_latent(g_d, np_["dec_w1"], mu.numpy(), lv.numpy(),
                                           eps.numpy(), gkl.v, np_["mu_w"], np_["lv_w"],
                                           h.numpy(), rec, kl)
    built["g_a1t"] = g_a1t
    gm, gl, a1 = gm.v.reshape(n, lat), gl.v.reshape(n, lat), g_a1.v.reshape(n, hd)
    out[2] = tc_store(g_a1t.view(), xt, sms=sms)
    hn = h.numpy()
    jobs = [(gm, hn), (gl, hn)] + ([(g_d, z)] if rec else [])
    jobs += [(None, a1), (None, gm), (None, gl)] + ([(None, g_d), (None, ga)] if rec else [])
    sums = fused_wgrad(jobs, n)
    for slot, v in zip([4, 6] + ([8] if rec else []) + [3, 5, 7] + ([9, 11] if rec else []),
                       sums):
        out[slot] = v
    if need_eps:
        out[1] = ge.v.reshape(n, lat)
    result = [torch.from_numpy(np.ascontiguousarray(o)) for o in out]
    if need_x:  # elbo_backward's tail: + g_a1 enc_w (cuBLAS), invalid rows zeroed
        gx_t = result[0] + torch.from_numpy(a1) @ enc_w
        result[0] = torch.where(torch.from_numpy(keep.v)[:, None] != 0, gx_t,
                                torch.zeros((), dtype=gx_t.dtype))
    for o in built.values():
        o.check()
    return result, built
