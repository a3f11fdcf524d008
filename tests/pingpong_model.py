"""pingpong.cu's schedule and numerics on the CPU (issue #56 item 3): the persistent grid, the
producer's ring order, each consumer's units, stage indices and turns, the resident A and the W
ring as mbarriers with phases (run under random interleavings, so a parity wait that passes on
the wrong phase is caught), the K chunks in tf32x3 with a float32 add per stage, the masks of
the ragged last unit and column tile, and each row's reduction order (per quad lane in column
order across the column tiles, then the xor-1 and xor-2 butterfly, then x ln 2).

Constants as pingpong.cu / elbo.h have them. tests/test_cuda_pingpong.py checks the model
against the spec; the kernel on a GPU is checked by that file's gpu tests.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

BK, BM, BN = 32, 64, 112       # pp::kBK, pp::kBM, kPingpongTileN
STAGES, CONS, MAX_K = 3, 2, 256  # pp::kStages, pp::kCons, kPingpongMaxK
SMS = 132                       # an H100's multiprocessors
CLAMP_BITS = np.float32(-144.269504088896341)  # -100 nats in bits (elbo_math.cuh kClampBits)
LN2 = np.float32(0.693147180559945309)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fits(n: int, k: int) -> bool:
    """pingpong_fits."""
    return n >= 4 and n % 4 == 0 and 1 <= k <= MAX_K and k % 4 == 0


def blocks(m: int, sms: int = SMS) -> int:
    """pingpong_blocks: one block per pair of 64-row units, at most one per SM."""
    return min(cdiv(cdiv(m, BM), 2), sms)


# ---- the schedule: what each warpgroup of block b does, in its program order ----------------
@dataclass
class Dims:
    m: int
    n: int
    k: int
    grid: int

    @property
    def units(self):
        return cdiv(self.m, BM)

    @property
    def pairs(self):
        return cdiv(self.units, 2)

    @property
    def nk(self):
        return cdiv(self.k, BK)

    @property
    def tiles_n(self):
        return cdiv(self.n, BN)


def producer(d: Dims, b: int):
    """The producer thread's actions, as its loops issue them."""
    g, loads = 0, [0, 0]
    for pr in range(b, d.pairs, d.grid):
        for n in range(d.tiles_n):
            for c in range(CONS):
                u = 2 * pr + c
                if u >= d.units:
                    continue
                if n == 0:
                    if loads[c] > 0:
                        yield ("wait", ("aempty", c), (loads[c] - 1) & 1)
                    yield ("load_a", c, u)  # arrive_expect + the boxes: the phase completes
                    loads[c] += 1
                for kt in range(d.nk):
                    st = g % STAGES
                    if g >= STAGES:
                        yield ("wait", ("empty", st), ((g // STAGES) & 1) ^ 1)
                    yield ("load_w", st, (g, u, n, kt))
                    g += 1


def consumer(d: Dims, b: int, c: int, trace: list):
    """Consumer warpgroup c's actions; appends (u, n, kt, g) per stage it consumes to trace."""
    base = turns = 0
    for unit_i, pr in enumerate(range(b, d.pairs, d.grid)):
        u = 2 * pr + c
        if u >= d.units:
            break
        both = 2 * pr + 1 < d.units
        per_tile = (2 if both else 1) * d.nk
        yield ("wait", ("afull", c), unit_i & 1)
        yield ("check_a", c, u)
        for n in range(d.tiles_n):
            last_tile = n + 1 == d.tiles_n
            first_pair = pr == b
            wait_turn = c == 1 or (both if n > 0 else not first_pair)
            pass_turn = both if c == 0 else (not last_tile or pr + d.grid < d.pairs)
            if wait_turn:
                yield ("wait", ("turn", c), turns & 1)
                turns += 1
            yield ("mma_begin", c)
            for kt in range(d.nk):
                gi = base + c * d.nk + kt
                st = gi % STAGES
                yield ("wait", ("full", st), (gi // STAGES) & 1)
                yield ("check_w", st, (gi, u, n, kt))
                trace.append((u, n, kt, gi))
                yield ("arrive", ("empty", st))
                if last_tile and kt + 1 == d.nk:
                    yield ("arrive", ("aempty", c))
            yield ("mma_end", c)
            if pass_turn:
                yield ("arrive", ("turn", 1 - c))
            base += per_tile


@dataclass
class Block:
    """One block's shared state: mbarriers (completed phases; arrivals count 1 per arrive, a
    consumer warpgroup's four warps modelled as one arrival), the ring's and A's contents."""
    completed: dict = field(default_factory=dict)
    slot: dict = field(default_factory=dict)      # ring slot -> the stage it holds
    consumed: set = field(default_factory=set)    # stages released
    a_unit: dict = field(default_factory=dict)    # consumer -> the unit its A holds
    a_free: dict = field(default_factory=dict)    # consumer -> its A's MMAs are done
    in_mma: set = field(default_factory=set)


def _passes(blk: Block, bar, parity: int) -> bool:
    """mbarrier.try_wait.parity: the phase of that parity has completed, i.e. the current
    (incomplete) phase's parity differs."""
    return (blk.completed.get(bar, 0) & 1) != parity


def run_block(d: Dims, b: int, rng: random.Random) -> list:
    """Runs block b's three warpgroups under a random interleaving, asserting what the kernel
    relies on: a parity wait passes only on the phase it means (the slot or A holds exactly the
    stage or unit the consumer expects), the producer overwrites only what was released, the
    MMA loops never overlap, and every warpgroup finishes (no deadlock)."""
    blk, trace = Block(), []
    agents = {"p": producer(d, b), 0: consumer(d, b, 0, trace), 1: consumer(d, b, 1, trace)}
    pending = {a: next(g, None) for a, g in agents.items()}
    while any(v is not None for v in pending.values()):
        ready = [a for a, act in pending.items() if act is not None
                 and not (act[0] == "wait" and not _passes(blk, act[1], act[2]))]
        assert ready, f"deadlock in block {b}: {pending}"
        a = rng.choice(ready)
        act = pending[a]
        kind = act[0]
        if kind == "load_a":
            _, c, u = act
            assert blk.a_free.get(c, True), "A overwritten before its MMAs were done"
            blk.a_unit[c], blk.a_free[c] = u, False
            blk.completed[("afull", c)] = blk.completed.get(("afull", c), 0) + 1
        elif kind == "check_a":
            assert blk.a_unit.get(act[1]) == act[2], ("A holds the wrong unit", act)
        elif kind == "load_w":
            _, st, stage = act
            old = blk.slot.get(st)
            assert old is None or old[0] in blk.consumed, "a stage overwritten before release"
            blk.slot[st] = stage
            blk.completed[("full", st)] = blk.completed.get(("full", st), 0) + 1
        elif kind == "check_w":
            assert blk.slot.get(act[1]) == act[2], ("phase aliasing: the slot holds",
                                                     blk.slot.get(act[1]), "not", act[2])
            blk.consumed.add(act[2][0])
        elif kind == "arrive":
            bar = act[1]
            if bar[0] == "aempty":
                blk.a_free[bar[1]] = True
            blk.completed[bar] = blk.completed.get(bar, 0) + 1
        elif kind == "mma_begin":
            assert not blk.in_mma, "the two consumers' MMA loops overlap"
            blk.in_mma.add(act[1])
        elif kind == "mma_end":
            blk.in_mma.discard(act[1])
        pending[a] = next(agents[a], None)
    return trace


def check_schedule(m: int, n: int, k: int, sms: int = SMS, seeds=(0, 1, 2)) -> dict:
    """Every block under several interleavings; then: each unit's every (column tile, K stage)
    consumed exactly once, in the ring's order per block. Returns counts for the tests."""
    d = Dims(m, n, k, blocks(m, sms))
    seen = {}
    for b in range(d.grid):
        traces = [run_block(d, b, random.Random(s)) for s in seeds]
        for t in traces[1:]:  # each consumer's order is the program's, whatever the interleaving
            assert sorted(t, key=lambda e: e[3]) == sorted(traces[0], key=lambda e: e[3])
        gs = sorted(e[3] for e in traces[0])
        assert gs == list(range(len(gs))), "the ring's stages: each consumed once, none skipped"
        for u, nn, kt, _ in traces[0]:
            seen[(u, nn, kt)] = seen.get((u, nn, kt), 0) + 1
    want = {(u, nn, kt) for u in range(d.units) for nn in range(d.tiles_n) for kt in range(d.nk)}
    assert set(seen) == want and all(v == 1 for v in seen.values()), "units x tiles x stages once"
    return {"grid": d.grid, "units": d.units, "stages": len(seen)}


# ---- numerics: one unit's logits, BCE and row sums as the kernel forms them -----------------
def _tf32(v: np.ndarray) -> np.ndarray:
    """The top 11 significant bits (what the MMA reads of a float32 operand; truncation)."""
    return (v.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def split_w(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tc_split_t_launch's halves of finite weights (tf32_split_inf): hi, lo = w - hi, or
    hi * 2^-24 where that is 0."""
    hi = _tf32(w)
    lo = (w - hi).astype(np.float32)
    lo = np.where(lo == 0, hi * np.float32(5.9604645e-8), lo).astype(np.float32)
    return hi, lo


def bce_bits(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """elbo_math.cuh bce_bits(a, x - 1, x) in float32 (numpy's exp / log2 for the MUFU's)."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        den = (np.float32(1) + np.exp(-a.astype(np.float32))).astype(np.float32)
        p = (np.float32(1) / den).astype(np.float32)
        l1p = np.maximum(np.log2(np.float32(1) - p), CLAMP_BITS)  # np.maximum keeps NaN
        lp = np.maximum(-np.log2(den), CLAMP_BITS)
        return ((x - np.float32(1)) * l1p - x * lp).astype(np.float32)


def unit_logits(a: np.ndarray, w_hi: np.ndarray, w_lo: np.ndarray, bias: np.ndarray,
                n: int) -> np.ndarray:
    """Column tile n of one unit (a: 64 rows of d before its ReLU, zero rows past M; K padded
    to the boxes with zeros as TMA reads them): run = bias, then per K stage of 32 the MMAs'
    lo*hi + hi*lo + hi*hi (float64 here, one rounding) joined by a float32 add."""
    k_pad = a.shape[1]
    cols = slice(n * BN, (n + 1) * BN)
    a = np.maximum(a, 0).astype(np.float32)  # relu (NaN kept: np.maximum)
    a_hi = _tf32(a)
    a_lo = np.where(np.isnan(a - a_hi), a, a - a_hi).astype(np.float32)  # tf32_split_act
    run = np.broadcast_to(bias[cols], (a.shape[0], BN)).astype(np.float32).copy()
    for kt in range(k_pad // BK):
        ks = slice(kt * BK, (kt + 1) * BK)
        acc = (_tf32(a_lo[:, ks]).astype(np.float64) @ w_hi[cols, ks].T.astype(np.float64)
               + a_hi[:, ks].astype(np.float64) @ _tf32(w_lo[cols, ks]).T.astype(np.float64)
               + a_hi[:, ks].astype(np.float64) @ w_hi[cols, ks].T.astype(np.float64))
        run = (run + acc.astype(np.float32)).astype(np.float32)
    return run


def pingpong_model(d_pre: np.ndarray, w: np.ndarray, bias: np.ndarray, x: np.ndarray,
                   kl: np.ndarray, sms: int = SMS):
    """(elbo, recon, kl) as pingpong_kernel writes them, unit by unit in the persistent order
    (float32 numpy). d_pre: (M, K) the decoder's hidden layer before its ReLU; w: (N, K)."""
    m, k = d_pre.shape
    nn = w.shape[0]
    assert fits(nn, k), (nn, k)
    dims = Dims(m, nn, k, blocks(m, sms))
    k_pad, n_pad = dims.nk * BK, dims.tiles_n * BN
    w_hi, w_lo = split_w(w.astype(np.float32))
    w_hi = np.pad(w_hi, ((0, n_pad - nn), (0, k_pad - k)))  # TMA's zeros past N and K
    w_lo = np.pad(w_lo, ((0, n_pad - nn), (0, k_pad - k)))
    bias = np.pad(bias.astype(np.float32), (0, n_pad - nn))  # the kernel's 0 past N
    recon = np.full(m, np.nan, np.float32)
    elbo = np.full(m, np.nan, np.float32)
    kl_out = np.full(m, np.nan, np.float32)
    written = np.zeros(m, np.int64)
    nan = np.float32(np.nan)
    for b in range(dims.grid):
        for pr in range(b, dims.pairs, dims.grid):
            for c in range(CONS):
                u = 2 * pr + c
                if u >= dims.units:
                    break
                m0 = u * BM
                a = np.zeros((BM, k_pad), np.float32)
                rows = min(BM, m - m0)
                a[:rows, :k] = d_pre[m0:m0 + rows]
                # rsum[row, t]: quad lane t's running sum for the row (the kernel's rsum[h] of
                # the thread owning the row: warp row // 16, lane 4 (row % 8) + t).
                rsum = np.zeros((BM, 4), np.float32)
                rbad = np.zeros((BM, 4), bool)
                row_ok = (m0 + np.arange(BM)) < m
                for n in range(dims.tiles_n):
                    run = unit_logits(a, w_hi, w_lo, bias, n)
                    xt = np.zeros((BM, BN), np.float32)
                    lo, hi = n * BN, min(nn, (n + 1) * BN)
                    xt[:rows, :hi - lo] = x[m0:m0 + rows, lo:hi]
                    terms = bce_bits(run, xt)
                    outside = ~((xt >= 0) & (xt <= 1))
                    for j in range(BN // 8):
                        for t in range(4):
                            for e in range(2):
                                cl = 8 * j + 2 * t + e
                                if n * BN + cl - e >= nn:  # the pair's first column past N
                                    continue
                                v = row_ok
                                rsum[:, t] = np.where(v, rsum[:, t] + terms[:, cl], rsum[:, t])
                                rbad[:, t] |= v & outside[:, cl]
                s01 = (rsum[:, 0] + rsum[:, 1]).astype(np.float32)   # xor 1 (lane 0's view)
                s23 = (rsum[:, 2] + rsum[:, 3]).astype(np.float32)
                total = ((s01 + s23).astype(np.float32) * LN2).astype(np.float32)  # xor 2
                bad = rbad.any(axis=1)
                for i in range(rows):  # write_row
                    r = m0 + i
                    written[r] += 1
                    kv = kl[r]
                    recon[r] = nan if bad[i] else total[i]
                    kl_out[r] = nan if bad[i] else kv
                    elbo[r] = nan if bad[i] else -(total[i] + kv)
    assert (written == 1).all(), "every row written exactly once"
    return elbo, recon, kl_out
