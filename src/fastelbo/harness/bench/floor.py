"""The physics floor of a timed row: no forward beats max(FLOPs / peak, bytes / bandwidth).

FLOPs are counted on the reference's eager forward (torch.utils.flop_counter: matmuls and
convolutions; other ops add none, so the count is a lower bound). Bytes are the inputs read and
the outputs written once, at DRAM bandwidth: with the L2 flushed before the call (the cold
column) nothing of either can come from a cache. The peaks are the chip's fastest math (FP8
tensor cores, dense) and its DRAM bandwidth, both above anything a float32 kernel reaches, so
the floor is a strict lower bound: a row below it timed something other than the work. Warm and
graph columns may read inputs from the L2, so they are held to the FLOP floor alone.
"""
from __future__ import annotations

import os

# GPU name fragment -> (FLOP/s of its fastest dense math, DRAM bytes/s), from the data sheets.
GPU_PEAKS = {
    "H200": (1979e12, 4.8e12), "H100": (1979e12, 3.35e12), "H800": (1979e12, 3.35e12),
    "GH200": (1979e12, 4.9e12), "B200": (4500e12, 8.0e12), "A100": (624e12, 2.04e12),
    "L40S": (733e12, 0.864e12), "L4": (242e12, 0.3e12), "A10": (250e12, 0.6e12),
    "RTX 4090": (661e12, 1.01e12), "RTX 3090": (284e12, 0.936e12), "T4": (130e12, 0.32e12),
}
UNKNOWN_GPU = (10e15, 16e12)  # above every chip's peaks: a floor that only catches the absurd
CPU_CORE_FLOPS, CPU_BYTES = 1e12, 1e12  # per core, and in all: above any CPU's


def peaks(device_type: str, device_name: str) -> tuple[float, float, str]:
    """(FLOP/s, bytes/s, where they come from) for the device."""
    if device_type != "cuda":
        cores = os.cpu_count() or 1
        return cores * CPU_CORE_FLOPS, CPU_BYTES, f"CPU bound ({cores} cores x 1 TFLOP/s)"
    for name, (flops, bw) in GPU_PEAKS.items():
        if name in device_name:
            return flops, bw, f"{name} data sheet"
    return (*UNKNOWN_GPU, "unknown GPU: generous bound")


def floors(flops: int | None, io_bytes: int, device_type: str,
           device_name: str) -> dict:
    """{floor_ms (cold), floor_warm_ms (FLOPs only), floor_source}."""
    peak_flops, peak_bw, source = peaks(device_type, device_name)
    compute = (flops or 0) / peak_flops * 1e3
    return {"floor_ms": max(compute, io_bytes / peak_bw * 1e3), "floor_warm_ms": compute,
            "floor_source": source, "flops": flops, "io_bytes": io_bytes}
