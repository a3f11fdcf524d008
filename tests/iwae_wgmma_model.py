"""iwae_wgmma.cu on the CPU (issue #56 item 5): its schedule, its shared-memory layout and
swizzle, and its numerics, as NumPy replays that tests/test_cuda_iwae_wgmma.py checks against
the spec.

Schedule: one block's producer and two consumers as the kernel's program order of mbarrier waits
and arrivals, TMA loads, wgmma issues (commit groups of half a stage), wait_group and fragment
loads, run under random interleavings. Asserted: a parity wait passes only on the phase it means
(the slot holds exactly the stage the consumer expects), an arrival on `empty` lands in the phase
of its own stage, no stage is released while an MMA group reading it is in flight, no fragment
buffer is reloaded while a group reading it is in flight, the producer overwrites only what both
consumers released, and nothing deadlocks; every stage is consumed once by each consumer, in
order.

Layout: the Smem struct's offsets (checked against the compiled struct by test_cuda_compile.py),
the 128-byte swizzle of z and d (box_off), the ldmatrix addresses and the fragments they deliver,
and the bank conflicts of each shared-memory access pattern.

Numerics: each (image, K-split) block's partial logsumexp as the kernel forms it: z and
log p(z) - log q(z|x) (two half-row sums), both GEMMs per job of 56 columns in tf32x3 (hi*hi apart
from the corrections, each over all of K; a NaN correction dropped), d zero past H, the BCE of
each logit (elbo_math.cuh bce_bits), each row's sum per quad lane in (job, n8 block, column pair)
order then the xor-1, xor-2 butterfly, x ln 2, the per-row running logsumexp masked past the
split's samples, the row lanes merged in row order.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

BK, BN, BM, CONS, STAGES = 32, 56, 128, 2, 4  # iw::kBK, kBN, kBM, kCons, kStages
MAX_L, MAX_H = 32, 256                           # kIwaeWgmmaMaxL, kIwaeWgmmaMaxH (elbo.h)
SLICES = BN // 8
SMEM_OPTIN = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on an H100 and an H200 (227 KiB)
CLAMP_BITS = np.float32(-144.269504088896341)
LN2 = np.float32(0.693147180559945309)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Dims:
    """The kernel's per-dims counts (iwae_wgmma_kernel's first lines)."""
    d: int
    h: int
    l: int  # the latent dim, as the kernel names it

    @property
    def nk1(self):
        return cdiv(self.l, BK)

    @property
    def nk2(self):
        return cdiv(self.h, BK)

    @property
    def hp(self):
        return self.nk2 * BK

    @property
    def jobs_h(self):
        return cdiv(self.hp, BN)

    @property
    def jobs_d(self):
        return cdiv(self.d, BN)

    def fits(self) -> bool:
        """iwae_wgmma_plan's dims rule (the shared memory: smem_bytes)."""
        return (1 <= self.l <= MAX_L and 1 <= self.h <= MAX_H and self.d >= 1
                and smem_bytes(self) <= SMEM_OPTIN)


# ---- shared memory --------------------------------------------------------------------------
# The Smem struct's fields in order: (name, element bytes, count, alignment).
SMEM_FIELDS = [("d", 4, (MAX_H // BK) * BM * BK, 4), ("z", 4, (MAX_L // BK) * BM * BK, 4),
               ("whi", 4, STAGES * BN * BK, 4), ("wlo", 4, STAGES * BN * BK, 4),
               ("lat", 4, 3 * MAX_L, 4), ("b1", 4, MAX_H + BN, 4), ("lpq", 4, BM, 4),
               ("lse", 4, 3 * BM, 4), ("full", 8, STAGES, 8), ("empty", 8, STAGES, 8)]
BOX_BYTES = BM * BK * 4
STAGE_BYTES = BN * BK * 4


def smem_struct() -> tuple[dict[str, int], int]:
    """({field: byte offset}, sizeof(Smem)) under C++'s layout rules."""
    offsets, at, align = {}, 0, 1
    for name, size, count, al in SMEM_FIELDS:
        at = cdiv(at, al) * al
        offsets[name] = at
        at += size * count
        align = max(align, al)
    return offsets, cdiv(at, align) * align


def smem_bytes(d: Dims) -> int:
    """iwae_wgmma_plan's request: the struct, 1024 bytes of alignment slack, then b2 and x over
    GEMM 2's jobs."""
    return smem_struct()[1] + 1024 + 8 * d.jobs_d * BN


def box_off(r: int, c: int) -> int:
    """Float offset of (row r, column c) in a swizzled box of 128 rows x 32 floats."""
    return r * BK + ((((c & 31) >> 2) ^ (r & 7)) << 2) + (c & 3)


def ldsm_lane_address(row_w: int, kt: int, hf: int, k: int, lane: int) -> int:
    """Byte offset (from box 0) of the row lane `lane` hands ldmatrix for k8 step k of half hf
    of stage kt (Consumer::load_frags)."""
    ra = row_w + 8 * ((lane >> 3) & 1) + (lane & 7)
    return kt * BOX_BYTES + 4 * ra * BK + 16 * ((2 * (2 * hf + k) + (lane >> 4)) ^ (lane & 7))


def ldsm_x4(words: np.ndarray, addresses: list[int]) -> np.ndarray:
    """ldmatrix.x4 of 32-bit words: lane l receives, of matrix i, the word (l % 4) of row l / 4,
    row j of matrix i being the 16 bytes at addresses[8 i + j]. Returns regs[lane, i]."""
    regs = np.empty((32, 4), words.dtype)
    for lane in range(32):
        for i in range(4):
            regs[lane, i] = words[addresses[8 * i + lane // 4] // 4 + lane % 4]
    return regs


def wavefronts(byte_addresses: list[list[int]], width: int) -> int:
    """Shared-memory wavefronts for one warp-wide access of `width` bytes per lane (the lanes'
    byte addresses, as phases: lists of the lanes served together): per phase, the most
    distinct 4-byte words any bank is asked for."""
    total = 0
    for phase in byte_addresses:
        banks: dict[int, set[int]] = {}
        for a in phase:
            for w in range(a // 4, (a + width) // 4):
                banks.setdefault(w % 32, set()).add(w)
        total += max(len(v) for v in banks.values())
    return total


def phases(addresses: list[int], width: int) -> list[list[int]]:
    """The lanes a warp's access serves together: all 32 for 4 bytes, half-warps for 8,
    quarter-warps for 16."""
    n = {4: 32, 8: 16, 16: 8}[width]
    return [addresses[i:i + n] for i in range(0, 32, n)]


# ---- the schedule ---------------------------------------------------------------------------
def producer(d: Dims, tiles: int, stages: int = STAGES):
    """produce(): per tile, GEMM 1's jobs x stages, then GEMM 2's."""
    g = 0
    for tile in range(tiles):
        for gemm, jobs, nk in ((1, d.jobs_h, d.nk1), (2, d.jobs_d, d.nk2)):
            for n in range(jobs):
                for kt in range(nk):
                    st = g % stages
                    if g >= stages:
                        yield ("wait", ("empty", st), ((g // stages) & 1) ^ 1)
                    yield ("load", st, (g, tile, gemm, n, kt))
                    g += 1


def slices_on(hn: int, nk: int) -> range:
    """Consumer::epi_on: the previous job's n8 blocks that run on half hn of a job's 2 nk (the
    kernel walks them with a counter: those i with i 2 nk < (hn + 1) 7 not yet run)."""
    first = next((i for i in range(SLICES) if i * 2 * nk >= hn * SLICES), SLICES)
    end = next((i for i in range(SLICES) if i * 2 * nk >= (hn + 1) * SLICES), SLICES)
    return range(first, end)


def consumer(d: Dims, tiles: int, c: int, trace: list, stages: int = STAGES, drain=None):
    """Consumer c's gemm() and job(): (group, stage) issues, waits, the previous job's epilogue
    slices (from lg) and finish (lg = this job's values), in program order. drain: the slices
    the last job of a GEMM runs alone (all of them)."""
    g = 0
    for tile in range(tiles):
        for gemm, jobs, nk in ((1, d.jobs_h, d.nk1), (2, d.jobs_d, d.nk2)):
            for n in range(jobs):
                prev = (tile, gemm, n - 1)
                yield ("frags", c, 0)
                for kt in range(nk):
                    gi = g + kt
                    st = gi % stages
                    stage = (gi, tile, gemm, n, kt)
                    yield ("wait", ("full", st), (gi // stages) & 1)
                    yield ("issue", c, st, stage, 0)
                    trace.append(stage)
                    if kt > 0:
                        yield ("wait_group", c, 1)
                        yield ("release", c, (gi - 1) % stages, gi - 1)
                    yield ("frags", c, 1)
                    if n > 0:
                        yield ("epi", c, prev, slices_on(2 * kt, nk))
                    yield ("issue", c, st, stage, 1)
                    if kt + 1 < nk:
                        yield ("wait_group", c, 1)
                        yield ("frags", c, 0)
                    if n > 0:
                        yield ("epi", c, prev, slices_on(2 * kt + 1, nk))
                yield ("wait_group", c, 0)
                yield ("release", c, (g + nk - 1) % stages, g + nk - 1)
                yield ("finish", c, (tile, gemm, n))
                g += nk
            yield ("epi", c, (tile, gemm, jobs - 1),
                   range(SLICES) if drain is None else drain(nk))


@dataclass
class Block:
    """One block's shared state: mbarrier phases, the ring's slots, the consumers' MMA groups
    in flight (stage index, fragment buffer) and fragment buffers."""
    stages: int
    completed: dict = field(default_factory=dict)   # barrier -> phases completed
    arrivals: dict = field(default_factory=dict)    # empty barrier -> arrivals in its phase
    slot: dict = field(default_factory=dict)        # slot -> the stage it holds
    released: dict = field(default_factory=dict)    # stage index -> consumers that released it
    groups: dict = field(default_factory=dict)      # consumer -> [(stage index, buffer)]
    loaded: dict = field(default_factory=dict)      # (consumer, buffer) -> loaded, unused yet
    lg: dict = field(default_factory=dict)          # consumer -> [job held, slices run]


def _passes(blk: Block, bar, parity: int) -> bool:
    """mbarrier.try_wait.parity: the phase of that parity has completed."""
    return (blk.completed.get(bar, 0) & 1) != parity


def _step(blk: Block, act) -> None:
    kind = act[0]
    if kind == "load":
        _, st, stage = act
        old = blk.slot.get(st)
        assert old is None or blk.released.get(old[0], set()) == set(range(CONS)), \
            ("a stage overwritten before both consumers released it", old, stage)
        blk.slot[st] = stage
        blk.completed[("full", st)] = blk.completed.get(("full", st), 0) + 1
    elif kind == "issue":
        _, c, st, stage, buf = act
        assert blk.slot.get(st) == stage, ("phase aliasing: the slot holds", blk.slot.get(st),
                                           "not", stage)
        assert blk.loaded.pop((c, buf), False), ("MMAs issued from stale fragments", act)
        blk.groups.setdefault(c, []).append((stage[0], buf))
    elif kind == "wait_group":
        _, c, n = act
        pending = blk.groups.get(c, [])
        blk.groups[c] = pending[len(pending) - n:] if n else []
    elif kind == "frags":
        _, c, buf = act
        assert all(b != buf for _, b in blk.groups.get(c, [])), \
            ("fragments overwritten under MMAs in flight", act)
        blk.loaded[(c, buf)] = True
    elif kind == "epi":
        _, c, job, slices = act
        held = blk.lg.get(c)
        assert held is not None and held[0] == job, ("an epilogue of values not held", act)
        assert all(i not in held[1] for i in slices) and list(slices) == sorted(slices)
        assert not held[1] or not slices or min(slices) > max(held[1]), "slices out of order"
        held[1].extend(slices)
    elif kind == "finish":
        _, c, job = act
        held = blk.lg.get(c)
        assert held is None or held[1] == list(range(SLICES)), \
            ("values overwritten before their epilogue ran", held, job)
        blk.lg[c] = [job, []]
    elif kind == "release":
        _, c, st, gi = act
        assert all(s != gi for s, _ in blk.groups.get(c, [])), \
            ("a stage released while MMAs read it", act)
        bar = ("empty", st)
        assert blk.completed.get(bar, 0) == gi // blk.stages, \
            ("an arrival outside its stage's phase", act, blk.completed.get(bar, 0))
        blk.released.setdefault(gi, set()).add(c)
        blk.arrivals[bar] = blk.arrivals.get(bar, 0) + 1
        if blk.arrivals[bar] == CONS:
            blk.arrivals[bar] = 0
            blk.completed[bar] = blk.completed.get(bar, 0) + 1


def run_block(d: Dims, tiles: int, rng: random.Random, stages: int = STAGES,
              consumer_fn=None) -> list:
    """A block's producer and consumers under a random interleaving (the assertions of _step,
    and no deadlock); returns consumer 0's trace of stages consumed, then consumer 1's."""
    consumer_fn = consumer_fn or consumer
    blk, traces = Block(stages), [[], []]
    agents = {"p": producer(d, tiles, stages),
              **{c: consumer_fn(d, tiles, c, traces[c], stages) for c in range(CONS)}}
    pending = {a: next(gen, None) for a, gen in agents.items()}
    while any(v is not None for v in pending.values()):
        ready = [a for a, act in pending.items() if act is not None
                 and not (act[0] == "wait" and not _passes(blk, act[1], act[2]))]
        assert ready, f"deadlock: {pending}"
        a = rng.choice(ready)
        act = pending[a]
        if act[0] != "wait":
            _step(blk, act)
        pending[a] = next(agents[a], None)
    assert not any(blk.groups.values()), "MMA groups left in flight"
    assert all(v[1] == list(range(SLICES)) for v in blk.lg.values()), "an epilogue left undone"
    return traces


def check_schedule(d: Dims, tiles: int, seeds=(0, 1, 2), stages: int = STAGES,
                   consumer_fn=None) -> int:
    """run_block under several interleavings; each consumer consumes the producer's stages once
    each, in order. Returns the stage count."""
    want = [s for s in producer(d, tiles, stages) if s[0] == "load"]
    for seed in seeds:
        for trace in run_block(d, tiles, random.Random(seed), stages, consumer_fn):
            assert trace == [s[2] for s in want], "every stage once, in the producer's order"
    return len(want)


# ---- numerics -------------------------------------------------------------------------------
def _f32(v) -> np.ndarray:
    return np.asarray(v, dtype=np.float32)


def tf32_split(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """elbo_math.cuh tf32_split: hi = the top 11 significant bits, lo = v - hi (float32)."""
    v = _f32(v)
    hi = (v.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    with np.errstate(invalid="ignore"):
        return hi, (v - hi).astype(np.float32)


def _trunc(v: np.ndarray) -> np.ndarray:
    """What the tensor core reads of a float32 operand (its top 11 significant bits)."""
    return tf32_split(v)[0]


def gemm_job(a: np.ndarray, w: np.ndarray, n0: int) -> tuple[np.ndarray, np.ndarray]:
    """(acc, corr) of the job at column n0: a (rows, K padded to stages with zeros), w (N, K)
    unpadded (TMA's zeros past it); corr = lo*hi + hi*lo, acc = hi*hi, each summed over all of K
    (float64, one rounding: the model of an ideal accumulator)."""
    k = a.shape[1]
    wj = np.zeros((BN, k), np.float32)
    rows = w[n0:n0 + BN, :k]
    wj[:rows.shape[0], :rows.shape[1]] = rows
    ah, al = tf32_split(a)
    wh, wl = tf32_split(wj)
    with np.errstate(invalid="ignore", over="ignore"):
        corr = (_trunc(al).astype(np.float64) @ wh.T.astype(np.float64)
                + ah.astype(np.float64) @ _trunc(wl).T.astype(np.float64))
        acc = ah.astype(np.float64) @ wh.T.astype(np.float64)
    return acc.astype(np.float32), corr.astype(np.float32)


def combine(acc: np.ndarray, corr: np.ndarray) -> np.ndarray:
    return (acc + np.where(np.isnan(corr), np.float32(0), corr)).astype(np.float32)


def bce_bits(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """elbo_math.cuh bce_bits(a, x - 1, x) in float32 (numpy's exp / log2 for the MUFU's)."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        den = (np.float32(1) + np.exp(-_f32(a))).astype(np.float32)
        p = (np.float32(1) / den).astype(np.float32)
        l1p = np.maximum(np.log2(np.float32(1) - p), CLAMP_BITS)
        lp = np.maximum(-np.log2(den), CLAMP_BITS)
        return ((x - np.float32(1)) * l1p - x * lp).astype(np.float32)


def _latent_tile(d: Dims, mu, sig, lv, eps_tile, live):
    """fill_z: z (BM, nk1 * BK), zero past L and past the split, and lpq per row (the columns
    < 16 and >= 16 summed apart, then joined)."""
    z = np.zeros((BM, d.nk1 * BK), np.float32)
    lpq = np.zeros(BM, np.float32)
    e = np.zeros((BM, BK), np.float32)
    e[:, :d.l] = eps_tile
    lat = [np.pad(v.astype(np.float32), (0, BK - d.l)) for v in (mu, sig, lv)]  # s.lat
    zz = (lat[0][None, :].astype(np.float64)
          + lat[1][None, :].astype(np.float64) * e).astype(np.float32)
    zz[:, d.l:] = 0
    zz[~live] = 0
    z[:, :BK] = zz
    term = ((e * e - zz * zz).astype(np.float32) + lat[2][None, :]).astype(np.float32)
    halves = []
    for lo in (0, 16):
        s = np.zeros(BM, np.float32)
        for j in range(lo, lo + 16):
            if j < d.l:
                s = np.where(live, s + term[:, j], s).astype(np.float32)
        halves.append(s)
    lpq = (np.float32(0.5) * (halves[0] + halves[1])).astype(np.float32)
    return z, lpq


def _tile_bce(d: Dims, z, w1, b1, w2, b2, xw):
    """Both GEMMs and the BCE row sums of one tile: (BM,) BCE in nats, rows as the kernel
    sums them."""
    hid = np.zeros((BM, d.hp), np.float32)
    b1p = np.zeros(d.jobs_h * BN, np.float32)
    b1p[:d.h] = b1
    for j in range(d.jobs_h):
        acc, corr = gemm_job(z, w1, j * BN)
        cols = j * BN + np.arange(BN)
        with np.errstate(invalid="ignore"):
            v = (combine(acc, corr) + b1p[cols]).astype(np.float32)
            v = np.where(cols < d.h, np.where(np.isnan(v), v, np.maximum(v, 0)), 0)
        keep = cols < d.hp
        hid[:, cols[keep]] = v[:, keep]
    b2p = np.zeros(d.jobs_d * BN, np.float32)
    b2p[:d.d] = b2
    xp = np.zeros(d.jobs_d * BN, np.float32)
    xp[:d.d] = xw
    rs = np.zeros((BM, 4), np.float32)  # per row, quad lane t
    for j in range(d.jobs_d):
        acc, corr = gemm_job(hid, w2, j * BN)
        cols = j * BN + np.arange(BN)
        lg = (combine(acc, corr) + b2p[cols]).astype(np.float32)
        terms = bce_bits(lg, xp[cols][None, :])
        for jj in range(SLICES):
            for t in range(4):
                for e in range(2):
                    cl = 8 * jj + 2 * t + e
                    if j * BN + cl < d.d:
                        rs[:, t] = (rs[:, t] + terms[:, cl]).astype(np.float32)
    total = ((rs[:, 0] + rs[:, 1]).astype(np.float32) + (rs[:, 2] + rs[:, 3]).astype(np.float32))
    return (total.astype(np.float32) * LN2).astype(np.float32)


def block_partial(d: Dims, params, x_row, mu, lv, eps_b, k_begin: int, k_end: int) -> float:
    """One (image, split) block's partial logsumexp (float32), as iwae_wgmma_kernel forms it.
    params: the decoder's float32 numpy (w1 (H, L), b1, w2 (D, H), b2); eps_b (K, L)."""
    w1, b1, w2, b2 = params
    sig = np.exp(np.float32(0.5) * lv).astype(np.float32)
    xw = np.where((x_row >= 0) & (x_row <= 1), x_row, np.float32(np.nan)).astype(np.float32)
    m_run = np.full(BM, -np.inf, np.float32)
    s_run = np.zeros(BM, np.float32)
    nan_seen = np.zeros(BM, bool)
    for k0 in range(k_begin, k_end, BM):
        rows = k0 + np.arange(BM)
        live = rows < k_end
        eps_tile = np.zeros((BM, d.l), np.float32)
        eps_tile[live] = eps_b[rows[live]]
        z, lpq = _latent_tile(d, mu, sig, lv, eps_tile, live)
        bce = _tile_bce(d, z, w1, b1, w2, b2, xw)
        with np.errstate(invalid="ignore", over="ignore"):
            wgt = (lpq - bce).astype(np.float32)
            isn = live & np.isnan(wgt)
            nan_seen |= isn
            upd = live & ~np.isnan(wgt)
            m_new = np.where(m_run < wgt, wgt, m_run)
            m_ref = np.where(m_new > -np.inf, m_new, 0).astype(np.float32)
            s_new = (s_run * np.exp(m_run - m_ref) + np.exp(wgt - m_ref)).astype(np.float32)
        s_run = np.where(upd, s_new, s_run).astype(np.float32)
        m_run = np.where(upd, m_new, m_run).astype(np.float32)
    if nan_seen.any():
        return float("nan")
    m_all = np.float32(np.max(m_run))
    m_ref = m_all if m_all > -np.inf else np.float32(0)
    s_all = np.float32(0)
    for i in range(BM):  # row order
        s_all = np.float32(s_all + s_run[i] * np.float32(math.exp(float(m_run[i] - m_ref))))
    with np.errstate(divide="ignore"):
        return float(np.float32(m_all + np.float32(np.log(s_all))))


def iwae_model(dims, params, x, mu, lv, eps, k_per_split: int) -> np.ndarray:
    """(B, splits) partials of the whole launch: params (w1, b1, w2, b2) float32 numpy, x (B, D),
    mu / lv (B, L) as the encoder hands them, eps (K, B, L)."""
    d = Dims(*dims)
    samples, batch = eps.shape[0], x.shape[0]
    splits = cdiv(samples, k_per_split)
    part = np.zeros((batch, splits), np.float32)
    for b in range(batch):
        for s in range(splits):
            k_begin = s * k_per_split
            part[b, s] = block_partial(d, params, x[b], mu[b], lv[b], eps[:, b],
                                       k_begin, min(samples, k_begin + k_per_split))
    return part
