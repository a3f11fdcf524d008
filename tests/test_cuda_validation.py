"""fastelbo.validation's value check on CUDA: the cuda backend's one-launch range check."""
from __future__ import annotations

import pytest
import torch

import fastelbo
from fastelbo.validation import check_values

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
    assert cuda.x_in_unit_range(x) is True
    n = x.numel()
    positions = sorted({0, n - 1, n // 2, n - n % 4 if n % 4 else n - 1,
                        int(torch.randint(n, (1,), generator=g, device="cuda"))})
    for value in (1.0000001, -1e-30, float("nan"), float("inf"), -float("inf"), 2.0):
        for pos in positions:
            y = x.clone()
            y.view(-1)[pos] = value
            assert cuda.x_in_unit_range(y) is False, (value, pos)
            with pytest.raises(ValueError, match="must lie in"):
                check_values(y)
    y = x.clone()
    y.view(-1)[n // 2] = -0.0
    assert cuda.x_in_unit_range(y) is True  # -0.0 >= 0


def test_range_check_on_an_unaligned_view(cuda):
    """x one float past a 16-byte boundary: the scalar path, every element seen."""
    cuda = runs(cuda)
    base = torch.rand(1 + 37 * 29, device="cuda")
    x = base[1:].view(37, 29)
    assert x.data_ptr() % 16 and x.is_contiguous()
    assert cuda.x_in_unit_range(x) is True
    for pos in (0, 17, x.numel() - 1):
        y_base = base.clone()
        y_base[1 + pos] = 1.5
        assert cuda.x_in_unit_range(y_base[1:].view(37, 29)) is False, pos


def test_models_forward_refuses_bad_x_through_the_fast_check(cuda):
    cuda = runs(cuda)
    model = fastelbo.ModelNew(784, 256, 32, backend="cuda").cuda()
    x = torch.rand(128, 784, device="cuda")
    x[100, 700] = float("nan")
    with torch.no_grad(), fastelbo.validation(True), pytest.raises(ValueError, match="x\\[100, 700\\]"):
        model(x)
