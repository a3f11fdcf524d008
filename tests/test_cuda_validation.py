"""The ops' value check on CUDA (fastelbo.ops.checks): the cuda backend's one-launch range check."""
from __future__ import annotations

import pytest
import torch

import fastelbo
from fastelbo.backends import GIVEN_PLAIN
from fastelbo.ops.checks import check_values
from reference import assert_outputs_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = [(1, 1), (3, 5), (7, 33), (128, 784), (1000, 781), (8193, 784)]


def runs(cuda):
    cuda.unavailable_reason(torch.device("cuda", torch.cuda.current_device()))  # registers it
    return cuda


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_range_check_agrees_with_torch(cuda, shape):
    cuda = runs(cuda)
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = torch.rand(*shape, device="cuda", generator=g)
    x.view(-1)[0], x.view(-1)[-1] = 0.0, 1.0  # the interval's ends are inside
    assert cuda.in_unit_range(x) is True
    n = x.numel()
    positions = sorted({0, n - 1, n // 2, n - n % 4 if n % 4 else n - 1,
                        int(torch.randint(n, (1,), generator=g, device="cuda"))})
    for value in (1.0000001, -1e-30, float("nan"), float("inf"), -float("inf"), 2.0):
        for pos in positions:
            y = x.clone()
            y.view(-1)[pos] = value
            assert cuda.in_unit_range(y) is False, (value, pos)
            with pytest.raises(ValueError, match="must lie in"):
                check_values(y)
    y = x.clone()
    y.view(-1)[n // 2] = -0.0
    assert cuda.in_unit_range(y) is True  # -0.0 >= 0


def test_range_check_on_an_unaligned_view(cuda):
    """x one float past a 16-byte boundary: the scalar path, every element seen."""
    cuda = runs(cuda)
    base = torch.rand(1 + 37 * 29, device="cuda")
    x = base[1:].view(37, 29)
    assert x.data_ptr() % 16 and x.is_contiguous()
    assert cuda.in_unit_range(x) is True
    for pos in (0, 17, x.numel() - 1):
        y_base = base.clone()
        y_base[1 + pos] = 1.5
        assert cuda.in_unit_range(y_base[1:].view(37, 29)) is False, pos


def test_models_forward_refuses_bad_x_through_the_fast_check(cuda):
    cuda = runs(cuda)
    model = fastelbo.ModelNew(784, 256, 32, backend="cuda").cuda()
    x = torch.rand(128, 784, device="cuda")
    x[100, 700] = float("nan")
    with (torch.no_grad(), fastelbo.validation(True),
          pytest.raises(ValueError, match="x\\[100, 700\\]")):
        model(x)


def test_started_checks_give_the_same_verdicts(cuda):
    """start_value_check and its RangeCheck's wait() (the check fastelbo.ops overlaps with its
    own work) agree with in_unit_range; a check started and never waited for (an exception
    between the two) is waited out by the next start, which then gives its own verdict."""
    cuda = runs(cuda)
    g = torch.Generator(device="cuda").manual_seed(11)
    good = torch.rand(1000, 781, device="cuda", generator=g)
    bad = good.clone()
    bad[999, 780] = float("nan")
    for x, want in ((good, True), (bad, False), (good, True)):
        check = cuda.start_value_check(x)
        assert isinstance(check, cuda.RangeCheck) and check.in_flight and check.checked
        assert _passes(check) is want
    for first, second, want in ((bad, good, True), (good, bad, False)):
        cuda.start_value_check(first)  # abandoned
        assert _passes(cuda.start_value_check(second)) is want
    big = torch.rand(8193, 784, device="cuda", generator=g)  # more blocks than the others
    cuda.start_value_check(big)
    small = torch.rand(3, 5, device="cuda", generator=g)
    small[2, 4] = -1.0
    check = cuda.start_value_check(small)  # its one flag, not big's stale ones, decides
    with pytest.raises(ValueError, match=r"x\[2, 4\] = -1"):
        check.wait()
    assert _passes(cuda.start_value_check(big)) is True


def _passes(check) -> bool:
    """A started check's verdict: whether its wait() returns (False: it raised the contract's
    ValueError)."""
    try:
        check.wait()
    except ValueError:
        return False
    return True


def test_checks_of_two_threads_do_not_mix(cuda):
    """Each thread has its own check in flight: two threads alternating starts and finishes
    on different x (one good, one bad) each get their own verdict."""
    import threading

    cuda = runs(cuda)
    dev = torch.device("cuda", torch.cuda.current_device())
    good = torch.rand(128, 784, device="cuda")
    bad = good.clone()
    bad[64, 3] = 1.5
    barrier = threading.Barrier(2)
    verdicts = {True: [], False: []}

    def worker(x, want):
        torch.cuda.set_device(dev)
        for _ in range(50):
            check = cuda.start_value_check(x)
            barrier.wait()  # both started before either finishes
            verdicts[want].append(_passes(check))
            barrier.wait()

    threads = [threading.Thread(target=worker, args=a) for a in ((good, True), (bad, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert verdicts == {True: [True] * 50, False: [False] * 50}


@pytest.mark.parametrize("batch", [7, 128, 1000])
def test_a_refused_x_launches_nothing_and_draws_nothing(cuda, batch):
    """ModelNew with validation on: a bad x raises the value error with the generator's state
    as before the call (no noise drawn, no forward run); a good x afterwards gives the same
    numbers as with validation off, for the same seed."""
    cuda = runs(cuda)
    model = fastelbo.ModelNew(784, 256, 32, backend="cuda").cuda()
    x = torch.rand(batch, 784, device="cuda")
    bad = x.clone()
    bad[batch - 1, 783] = float("inf")
    with torch.no_grad(), fastelbo.validation(True):
        model(x)  # first use: builds, checks the in-kernel draw
        state = torch.cuda.get_rng_state()
        with pytest.raises(ValueError, match=f"x\\[{batch - 1}, 783\\] = inf"):
            model(bad)
        assert torch.equal(torch.cuda.get_rng_state(), state)
        torch.cuda.manual_seed(3)
        checked = model(x)
        torch.cuda.manual_seed(3)
        with fastelbo.validation(False):
            unchecked = model(x)
    assert_outputs_close(checked, unchecked, bits=True)


def _plain_inputs(batch=6, dims=(33, 20, 5)):
    from fastelbo.params import VAEParams
    from fastelbo.problems.vae_elbo import Model

    params = VAEParams(*(t.detach().cuda() for t in Model(*dims).state_dict().values()))
    x = torch.rand(batch, dims[0], device="cuda")
    return x, params, torch.randn(batch, dims[2], device="cuda")


def test_start_checks_takes_the_plain_case_and_starts_the_value_check(cuda):
    """start_checks' lane in one binding call: plain inputs pass (a plain RangeCheck in
    flight, or GIVEN_PLAIN without a value check), and the verdict is the value check's."""
    cuda = runs(cuda)
    x, params, eps = _plain_inputs()
    for e in (None, eps):
        check = cuda.start_checks(x, params, e, True)
        assert isinstance(check, cuda.RangeCheck) and check.plain and _passes(check) is True
        assert cuda.start_checks(x, params, e, False) is GIVEN_PLAIN
    x[5, 32] = float("nan")
    assert _passes(cuda.start_checks(x, params, None, True)) is False


def test_start_checks_runs_no_value_check_inside_a_capture(cuda):
    cuda = runs(cuda)
    x, params, eps = _plain_inputs()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        verdict = cuda.start_checks(x, params, eps, True)
    assert verdict is GIVEN_PLAIN


_MUTATIONS = {
    "float64": lambda t: t.double(),
    "one more row": lambda t: torch.cat([t, t[:1]]),
    "non-contiguous": lambda t: t.t().contiguous().t() if t.dim() == 2 and t.shape[0] > 1
    and t.shape[1] > 1 else t.repeat_interleave(2)[::2],
    "on the CPU": lambda t: t.cpu(),
    "a Parameter subclass": lambda t: type("Sub", (torch.nn.Parameter,), {})(t),
}


@pytest.mark.parametrize("mutation", list(_MUTATIONS))
@pytest.mark.parametrize("name", ["x", "eps", "enc_w", "enc_b", "mu_w", "mu_b", "lv_w", "lv_b",
                                  "dec_w1", "dec_b1", "dec_w2", "dec_b2"])
def test_start_checks_leaves_everything_else_to_the_python_checks(cuda, name, mutation):
    """Any tensor off the plain case gives None (nothing started), so that the ops' own checks
    (ops.checks.start, by the contract) decide: they raise its precise error, or accept it for
    another path."""
    from fastelbo.ops.checks import start

    def check_inputs(x, params, eps):
        start("auto", x, params, eps)[0].wait()

    cuda = runs(cuda)
    x, params, eps = _plain_inputs()
    named = {"x": x, "eps": eps, **params._asdict()}
    named[name] = _MUTATIONS[mutation](named[name])
    x, eps = named.pop("x"), named.pop("eps")
    params = type(params)(**named)
    assert cuda.start_checks(x, params, eps, True) is None
    with fastelbo.validation(False):
        if mutation in ("non-contiguous", "a Parameter subclass"):
            check_inputs(x, params, eps)  # valid: fastelbo.ops makes it contiguous
        else:
            with pytest.raises((TypeError, ValueError)):
                check_inputs(x, params, eps)


def test_start_checks_refuses_a_batch_of_zero_and_one_dimensional_x(cuda):
    cuda = runs(cuda)
    x, params, _ = _plain_inputs()
    assert cuda.start_checks(x[:0], params, None, True) is None
    assert cuda.start_checks(x[0], params, None, True) is None
    assert cuda.start_checks(x[:, :-1].contiguous(), params, None, True) is None


def test_auto_takes_the_graph_rules_inside_a_capture_and_the_eager_ones_outside(cuda,
                                                                               monkeypatch):
    """ops hands choose() capturing=False only while its value check is in flight (started
    outside any capture); inside a capture it asks CUDA, which says True."""
    from fastelbo import backends
    from fastelbo.model import ModelNew

    cuda = runs(cuda)
    seen, real = [], backends.choose

    def spy(device, batch, dtype=torch.float32, capturing=None):
        got = real(device, batch, dtype, capturing)
        seen.append((capturing, backends._capturing(), got))
        return got

    monkeypatch.setattr(backends, "choose", spy)
    model = ModelNew(784, 256, 32).cuda()
    x = torch.rand(64, 784, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        model(x)
        with torch.cuda.stream(stream):
            model(x)  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = model(x)
        graph.replay()
        torch.cuda.synchronize()
    assert seen[0] == (False, False, "cuda")
    assert seen[-1][:2] == (None, True)
    assert seen[-1][2] == real(x.device, 64, torch.float32, True)
    assert torch.isfinite(out[0]).all()
