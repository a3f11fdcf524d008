"""Programmatic dependent launch of the cluster kernels, the fast one (elbo_fast.cu) and the
general one (elbo.cu), through binding_forward.cpp pdl_launch_allowed: a forward may start
staging its weights while the previous forward finishes, never when those weights are that
forward's outputs, and every result stays the spec's."""
from __future__ import annotations

import pytest
import torch

from fastelbo.model import ModelNew
from fastelbo.params import VAEParams
from fastelbo.problems.vae_elbo import Model
from reference import assert_outputs_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DIMS = (784, 256, 32)


def _params(seed: int = 0) -> VAEParams:
    torch.manual_seed(seed)
    return VAEParams(*(t.detach().cuda() for t in Model(*DIMS).state_dict().values()))


@pytest.mark.parametrize("batch", [7, 32, 81, 128, 384])  # auto: general kernel up to 80
def test_back_to_back_forwards_in_a_graph_are_the_spec(cuda, batch):
    """Ten forwards captured in one graph (each a programmatic dependent of the one before,
    x changing between them through a copy) equal the torch backend's forwards after the same
    seed, element for element at 1e-4; the later ones were launched with PDL."""
    ext = cuda.extension()
    torch.manual_seed(0)
    ref = ModelNew(*DIMS, backend="torch").cuda()
    new = ModelNew(*DIMS, backend="cuda").cuda()
    new.load_state_dict(ref.state_dict())
    xs = [torch.rand(batch, DIMS[0], device="cuda") for _ in range(10)]
    xbuf = xs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    outs = []
    with torch.no_grad():
        with torch.cuda.stream(stream):
            new(xbuf)
        graph = torch.cuda.CUDAGraph()
        before = ext.pdl_launches()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(10):
                outs.append(new(xbuf))
                if i % 3 == 2:  # some forwards follow a copy kernel, the rest each other
                    xbuf.copy_(xs[(i + 1) % 10])
        assert ext.pdl_launches() > before
        torch.manual_seed(11)
        graph.replay()
        torch.cuda.synchronize()
        torch.manual_seed(11)
        x = xs[0]
        for i, out in enumerate(outs):
            assert_outputs_close(out, ref(x), what=f"forward {i}")
            if i % 3 == 2:
                x = xs[(i + 1) % 10]


@pytest.mark.parametrize("path", ["fast", "cluster"])
def test_no_pdl_where_a_weight_is_the_previous_forwards_output(cuda, path):
    """dec_b1 of the second forward IS the first forward's kl output (B = H = 256): the second
    launch goes without PDL and reads the finished values, bit for bit those of the same
    forward with a copy of them."""
    ext = cuda.extension()
    params = _params()
    x = torch.rand(256, DIMS[0], device="cuda")
    eps1, eps2 = torch.randn(256, DIMS[2], device="cuda"), torch.randn(256, DIMS[2], device="cuda")
    cuda.forward(x, params, eps1, path=path)  # this stream has a launch on record
    first = cuda.forward(x, params, eps1, path=path)
    aliased = params._replace(dec_b1=first[2])
    before = ext.pdl_launches()
    got = cuda.forward(x, aliased, eps2, path=path)
    assert ext.pdl_launches() == before, "PDL with a weight that the previous launch writes"
    torch.cuda.synchronize()
    want = cuda.forward(x, params._replace(dec_b1=first[2].clone()), eps2, path=path)
    assert_outputs_close(got, want, bits=True)
    before = ext.pdl_launches()
    cuda.forward(x, params, eps2, path=path)  # weights apart from the outputs: PDL again
    assert ext.pdl_launches() == before + 1
