// The deferred value check on the device (binding ForwardOptions::deferred; elbo.h
// DeferredRecord): the forward's own kernels check x (every value in [0, 1], NaN not:
// elbo_math.cuh outside_unit), make every output of a call with a bad x NaN, and note the bad
// values in the device's record, which the host reads only when asked (fastelbo.check_errors).
// So no forward waits for a check on the host. Only the slow path (a bad value found) notes
// anything: a good x costs the scan and nothing else. No torch types; included by .cu files.
#pragma once

#include <cuda_runtime.h>

#include "elbo.h"
#include "elbo_math.cuh"

namespace fastelbo {

// The record's key of position (row, col) (both < 2^32): the earlier the position, the larger
// the key, and never 0 (the record's "none"); the binding reads the position back as ~key.
__host__ __device__ __forceinline__ unsigned long long deferred_key(long long row, long long col) {
  return ~((static_cast<unsigned long long>(row) << 32) | static_cast<unsigned long long>(col));
}

// Notes `count` bad values, the earliest of them at (row, col) holding v: the count added, and
// the record's first position replaced where this one is earlier (a 16-byte compare-and-swap
// loop, so the position and its value always belong together).
__device__ __forceinline__ void deferred_note(DeferredRecord* rec, unsigned long long count,
                                              long long row, long long col, float v) {
  atomicAdd(&rec->count, count);
  const unsigned long long key = deferred_key(row, col);
  const DeferredFirst mine = {key, static_cast<unsigned long long>(__float_as_uint(v))};
  // A torn first read only costs a failed swap, which returns the current value.
  DeferredFirst cur;
  cur.key = *reinterpret_cast<volatile unsigned long long*>(&rec->first.key);
  cur.value = *reinterpret_cast<volatile unsigned long long*>(&rec->first.value);
  while (key > cur.key) {
    const DeferredFirst old = atomicCAS(&rec->first, cur, mine);
    if (old.key == cur.key && old.value == cur.value) break;
    cur = old;
  }
}

// Notes the bad values of one row of x (n floats at xr, the call's row `row`), read serially by
// the calling thread: the slow path of a row already known to be bad.
__device__ __forceinline__ void deferred_note_row(DeferredRecord* rec, const float* xr, int n,
                                                  long long row) {
  unsigned long long count = 0;
  int first = -1;
  for (int c = 0; c < n; ++c) {
    if (outside_unit(xr[c])) {
      if (first < 0) first = c;
      ++count;
    }
  }
  if (count) deferred_note(rec, count, row, first, xr[first]);
}

// The cluster kernels' scan of all of x (n floats, row-major, D per row): part `part` of
// `parts` (a block's rank in its cluster), strided over the block's threads. Where x is 16-byte
// aligned, the parts split its float4s and the last part also takes the n % 4 tail; else they
// split the elements. Each thread visits its elements in increasing order.
// (Host and device: tests/test_cuda_deferred.py runs the share arithmetic on the CPU.)
struct DeferredShare {
  long long lo4, hi4;  // float4 indices [lo4, hi4) (vec), or elements [lo4, hi4) (not vec)
  long long tail;      // vec and the last part: elements [tail, n), else tail = n
  bool vec;
};
__host__ __device__ __forceinline__ DeferredShare deferred_share(const float* x, long long n,
                                                                 int part, int parts) {
  DeferredShare s;
  s.vec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const long long units = s.vec ? n / 4 : n;
  s.lo4 = units * part / parts;
  s.hi4 = units * (part + 1) / parts;
  s.tail = s.vec && part == parts - 1 ? units * 4 : n;
  return s;
}

// Calls f(e) for each element e of share s that thread t of `threads` visits, in increasing
// order: deferred_scan's loads and deferred_note_share's reads, element by element. (f is a
// device lambda in the kernels and a host one in the CPU test: no execution-space check.)
#pragma nv_exec_check_disable
template <class F>
__host__ __device__ __forceinline__ void deferred_visit(const DeferredShare& s, long long n,
                                                        long long t, long long threads, F f) {
  const int w = s.vec ? 4 : 1;
  for (long long i = s.lo4 + t; i < s.hi4; i += threads)
    for (int j = 0; j < w; ++j) f(i * w + j);
  for (long long i = s.tail + t; i < n; i += threads) f(i);
}

// Whether any of this thread's elements of its block's share lies outside [0, 1] or is NaN.
// The loads are independent (8 in flight per thread), so the scan costs about one round trip
// per 8 x 4 x blockDim floats of the share.
__device__ __forceinline__ bool deferred_scan(const float* x, long long n, int part, int parts) {
  const DeferredShare s = deferred_share(x, n, part, parts);
  const long long step = blockDim.x;
  bool bad = false;
  if (s.vec) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll 8
    for (long long i = s.lo4 + threadIdx.x; i < s.hi4; i += step) {
      const float4 v = __ldg(x4 + i);
      bad |= outside_unit(v.x) | outside_unit(v.y) | outside_unit(v.z) | outside_unit(v.w);
    }
  } else {
#pragma unroll 8
    for (long long i = s.lo4 + threadIdx.x; i < s.hi4; i += step) bad |= outside_unit(__ldg(x + i));
  }
  for (long long i = s.tail + threadIdx.x; i < n; i += step) bad |= outside_unit(__ldg(x + i));
  return bad;
}

// The slow path of deferred_scan: each thread notes its own bad elements of the share (their
// count and the earliest) in *rec. Called by the blocks of one cluster only, whose shares
// cover x once, so that every bad value is counted once.
__device__ __forceinline__ void deferred_note_share(DeferredRecord* rec, const float* x,
                                                    long long n, int D, int part, int parts) {
  unsigned long long count = 0;
  long long first = -1;
  deferred_visit(deferred_share(x, n, part, parts), n, threadIdx.x, blockDim.x,
                 [&](long long e) {
                   if (outside_unit(x[e])) {
                     if (first < 0) first = e;  // visited in increasing order
                     ++count;
                   }
                 });
  if (count) deferred_note(rec, count, first / D, first % D, x[first]);
}

// A block barrier that also ORs `bad` over the block where the deferred check is on (`on`,
// uniform over the block); a plain __syncthreads otherwise.
__device__ __forceinline__ bool deferred_block_or(bool on, bool bad) {
  if (on) return __syncthreads_or(bad) != 0;
  __syncthreads();
  return false;
}

}  // namespace fastelbo
