"""The cuda backend's in-kernel noise (backends/cuda/noise.py): torch.randn's numbers and
generator advance, drawn inside the cluster kernels, eagerly and inside CUDA graphs."""
from __future__ import annotations

import warnings

import pytest
import torch

import fastelbo
from fastelbo.backends import torch_ref
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model
from reference import assert_outputs_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Fast-path dims (multiples of 4, H % 32 == 0): C = 16 and C = 8, latent indices absent from
# some blocks (L = 12 over 8), L = 4 over 16 blocks.
FAST_DIMS = [(784, 256, 32), (100, 96, 12), (16, 64, 4)]


def make_params(dims, seed=0) -> VAEParams:
    torch.manual_seed(seed)
    return VAEParams(*(t.detach().cuda() for t in Model(*dims).state_dict().values()))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, (f"{what}: {diff.shape[0]} of {a.numel()} elements differ, first "
                               f"at {diff[0].tolist()}: {a[tuple(diff[0])]} vs {b[tuple(diff[0])]}")


def state() -> torch.Tensor:
    return torch.cuda.default_generators[torch.cuda.current_device()].get_state()


def threads_of_normal(index: int = 0) -> int:
    p = torch.cuda.get_device_properties(index)
    return p.multi_processor_count * p.max_threads_per_multi_processor


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_reproduced_draw_is_torch_randn(cuda, seed):
    """draw_randn(n) (philox.cuh in rows.cu's fill kernel) gives torch.randn(n)'s bits and
    advances the generator by as much, for one element, one round of normal_'s launch, every
    component of a round and several rounds, from a generator that has drawn before."""
    t = threads_of_normal()
    torch.manual_seed(seed)
    torch.randn(1000, device="cuda")  # a non-zero offset
    for n in (1, 5, 4096, t, t + 1, 4 * t + 4099, 9 * t + 17):
        start = state()
        ours = cuda.extension().draw_randn(n, torch.cuda.current_device())
        after = state()
        torch.cuda.default_generators[torch.cuda.current_device()].set_state(start)
        ref = torch.randn(n, device="cuda")
        assert_same_bits(ours, ref, f"n={n}")
        assert torch.equal(after, state()), f"n={n}: the generator advanced differently"


def test_randn_matches_on_this_gpu_and_consumes_nothing(cuda):
    from fastelbo.backends.cuda import noise

    noise._MATCHES.pop(torch.cuda.current_device(), None)
    torch.manual_seed(11)
    before = state()
    assert noise.randn_matches(torch.cuda.current_device())
    assert torch.equal(before, state()), "the first-use check must not consume noise"


def _draws_torch_randn(cuda, path, batch, dims, seed):
    """cuda.forward(path=path, draw=True): eps (poisoned first) becomes torch.randn(B, L)'s
    draw, the outputs are those of the same kernel fed that draw, bit for bit, and the
    generator ends where torch.randn leaves it."""
    params = make_params(dims)
    x = torch.rand(batch, dims[0], device="cuda")
    eps = torch.full((batch, dims[2]), float("nan"), device="cuda")
    torch.manual_seed(seed)
    got = cuda.forward(x, params, eps, path=path, draw=True, _poison=True)
    after = state()
    torch.manual_seed(seed)
    ref_eps = torch.randn(batch, dims[2], device="cuda")
    assert torch.equal(after, state())
    assert_same_bits(eps, ref_eps, "eps")
    assert_outputs_close(got, cuda.forward(x, params, ref_eps, path=path), bits=True)


@pytest.mark.parametrize("dims", FAST_DIMS, ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("batch", [81, 128, 140, 141, 384])
def test_fast_kernel_draws_torch_randn(cuda, batch, dims):
    """path='fast' (elbo_fast.cu draws its eps window in the kernel)."""
    _draws_torch_randn(cuda, "fast", batch, dims, seed=5)


# General cluster kernel dims: odd sizes, latent 1 (absent from most blocks), hidden 1024.
CLUSTER_DIMS = [(784, 256, 32), (33, 20, 5), (7, 9, 1), (50, 1024, 17)]


@pytest.mark.parametrize("dims", CLUSTER_DIMS, ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("batch", [1, 7, 33, 80, 200])
def test_cluster_kernel_draws_torch_randn(cuda, batch, dims):
    """path='cluster' (elbo.cu draws its own elements of the noise in the reparameterization)."""
    _draws_torch_randn(cuda, "cluster", batch, dims, seed=6)


@pytest.mark.parametrize("path", ["cluster", "rows", "auto"])
@pytest.mark.parametrize("batch", [7, 128, 1000])
def test_every_path_draws_torch_randn(cuda, path, batch):
    dims = (784, 256, 32)
    params = make_params(dims)
    x = torch.rand(batch, dims[0], device="cuda")
    eps = torch.empty(batch, dims[2], device="cuda")
    torch.manual_seed(9)
    got = cuda.forward(x, params, eps, path=path, draw=True)
    torch.manual_seed(9)
    ref_eps = torch.randn(batch, dims[2], device="cuda")
    assert_same_bits(eps, ref_eps, "eps")
    assert_outputs_close(got, cuda.forward(x, params, ref_eps, path=path), bits=True)


@pytest.mark.parametrize("batch", [1, 128, 300, 1000])
def test_model_without_autograd_matches_reference_model(cuda, batch):
    """ModelNew under no_grad takes the drawing path (fastelbo.ops) and keeps the RNG
    contract: the reference Model's results for the same seeds, forward after forward."""
    from fastelbo.backends.cuda import noise

    torch.manual_seed(3)
    ref = Model(784, 256, 32).cuda()
    new = fastelbo.ModelNew(784, 256, 32, backend="cuda").cuda()
    new.load_state_dict(ref.state_dict())
    x = torch.rand(batch, 784, device="cuda")
    with torch.no_grad():
        for seed in (0, 1234):
            torch.manual_seed(seed)
            want = [ref(x) for _ in range(3)]
            torch.manual_seed(seed)
            got = [new(x) for _ in range(3)]
            for i, (gs, ws) in enumerate(zip(got, want)):
                assert_outputs_close(gs, ws, what=f"seed {seed}, forward {i}")
    assert noise._MATCHES[torch.cuda.current_device()] is True


def test_graph_replays_draw_what_eager_calls_draw(cuda):
    """Captured forwards read the generator's seed and offset at replay: after the same
    manual_seed, a replay of 3 forwards gives the 3 eager forwards' results bit for bit (and
    so does torch.randn captured the same way: the premise)."""
    dims = (784, 256, 32)
    params = make_params(dims)
    x = torch.rand(128, dims[0], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):  # warm up: build, first-use check, plan
            fastelbo.elbo(x, params, backend="cuda")
    torch.cuda.current_stream().wait_stream(side)
    graph, control = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(graph):
            outs = [fastelbo.elbo(x, params, backend="cuda") for _ in range(3)]
        with torch.cuda.graph(control):
            noise = [torch.randn(128, dims[2], device="cuda") for _ in range(3)]
    torch.manual_seed(21)
    graph.replay()
    torch.manual_seed(21)
    control.replay()
    torch.cuda.synchronize()
    torch.manual_seed(21)
    eager_eps = [torch.randn(128, dims[2], device="cuda") for _ in range(3)]
    for c, e in zip(noise, eager_eps):
        assert_same_bits(c, e, "captured torch.randn")
    assert len(outs) == len(eager_eps) == 3
    for o, e in zip(outs, eager_eps):
        assert_outputs_close(o, cuda.forward(x, params, e), bits=True)
    assert not torch.equal(outs[0][0], outs[1][0])


def test_a_mismatch_falls_back_to_torch_randn(cuda, monkeypatch):
    """A reproduction that disagrees with torch.randn is caught at first use: a warning, the
    generator untouched by the check, and forwards that draw with torch.randn (the reference's
    results for the same seed)."""
    from fastelbo.backends.cuda import noise

    index = torch.cuda.current_device()
    ext = cuda.extension()
    real = ext.draw_randn
    monkeypatch.setattr(ext, "draw_randn", lambda n, dev: real(n, dev) * 1.0000001)
    monkeypatch.setitem(noise._MATCHES, index, None)
    noise._MATCHES.pop(index)
    torch.manual_seed(4)
    before = state()
    with pytest.warns(RuntimeWarning, match="does not reproduce"):
        assert not noise.randn_matches(index)
    assert torch.equal(before, state())
    dims = (784, 256, 32)
    params = make_params(dims)
    x = torch.rand(128, dims[0], device="cuda")
    torch.manual_seed(8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fastelbo.elbo(x, params, backend="cuda")
    torch.manual_seed(8)
    eps = torch.randn(128, dims[2], device="cuda")
    assert_outputs_close(got, torch_ref.forward(x, params, eps))
