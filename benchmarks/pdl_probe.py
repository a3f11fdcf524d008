"""Does programmatic dependent launch (PDL) shorten back-to-back cluster-kernel forwards? (#3:
the 10 us graph target; NOTES "Next, from the tenth session's evidence". B <= 80 runs elbo.cu's
general kernel, larger B elbo_fast.cu's.)

    FASTELBO_PDL=0|1 python benchmarks/pdl_probe.py [--batches 32 128 256 384] [--forwards 100]

The binding launches either cluster kernel as a programmatic dependent of the previous one
(unless FASTELBO_PDL=0, or a weight is the previous launch's output): it stages its
weights, waits for the previous grid (griddepcontrol.wait), lets the next forward launch
(griddepcontrol.launch_dependents), and only then reads x, eps or the RNG state or writes
anything. Per batch: `forwards` forwards (backend cuda, in-kernel noise) captured in
one CUDA graph; after manual_seed the replay's outputs must equal the torch backend's eager
forwards after the same manual_seed (the RNG contract, 1e-4) for every forward of the graph;
then us per forward over 20 replays (median). Run once with each setting and compare.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from fastelbo.model import ModelNew


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 256, 384])
    ap.add_argument("--forwards", type=int, default=100)
    args = ap.parse_args()
    dev = torch.device("cuda")
    dims = (784, 256, 32)
    torch.manual_seed(0)
    ref = ModelNew(*dims, backend="torch").to(dev)
    new = ModelNew(*dims, backend="cuda").to(dev)
    new.load_state_dict(ref.state_dict())
    print(f"{torch.cuda.get_device_name()}, FASTELBO_PDL={os.environ.get('FASTELBO_PDL', '0')}")
    for batch in args.batches:
        x = torch.rand(batch, dims[0], device=dev)
        outs = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            with torch.cuda.stream(stream):
                new(x)  # warm-up: builds, plans
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(args.forwards):
                    outs.append(new(x))
            torch.cuda.synchronize()
            torch.manual_seed(123)
            graph.replay()
            torch.cuda.synchronize()
            got = [tuple(t.clone() for t in o) for o in outs]
            torch.manual_seed(123)
            want = [ref(x) for _ in range(args.forwards)]
        worst = 0.0
        for g, w in zip(got, want):
            for a, b in zip(g, w):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
                worst = max(worst, float((a - b).abs().max()))
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / args.forwards)
        print(f"B={batch}: {statistics.median(times):.2f} us per forward (graph of "
              f"{args.forwards}, min {min(times):.2f}); {args.forwards} forwards match the "
              f"torch backend, max |diff| {worst:.2e}", flush=True)


if __name__ == "__main__":
    main()
