"""Small image data sets held in memory as tensors, sharded across ranks, augmented per batch.

Data sets (``DATASETS``):
- ``cifar10``: torchvision's CIFAR10 reader on ``root/cifar-10-batches-py``; downloaded into
  ``root`` only when that folder is absent and ``download=True``.
- ``fashion_mnist``: the four IDX ``.gz`` files, looked for in Debian's package folder
  (``apt-get install dataset-fashion-mnist``), then in ``root`` (flat, or torchvision's
  ``FashionMNIST/raw`` layout), then downloaded with torchvision.
- ``synthetic``: generated, CIFAR-shaped (3x32x32, 10 classes), learnable, deterministic from seed.

Images are float32 N,C,H,W, normalised per channel with the mean/std of the full training split
(so a ``train_size`` subset normalises exactly like the full run), less the validation images when
``val_size`` holds some out. The validation split (``val_size`` images of the training split, drawn
once with ``VAL_SPLIT_SEED`` whatever the run's seed, never trained on) is what every choice reads:
tuning, "did not train", budgets and time-to-accuracy targets; the test set is only reported. Augmentation (random crop with
zero padding, horizontal flip) runs as tensor ops on whole batches in ``ShardedLoader``: no
DataLoader workers and no per-sample Python, in the spirit of airbench.

Over 400 lines on purpose: three readers (CIFAR-10, Fashion-MNIST from Debian or torchvision,
synthetic), their one-line errors for a missing set, and the sharded loader they all feed.
"""

from __future__ import annotations

import gzip
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sparsetrain.errors import ConfigError, one_line_error

__all__ = [
    "DATASETS",
    "Dataset",
    "DatasetUnavailable",
    "ShardedLoader",
    "dataset_info",
    "load_dataset",
    "eval_batches",
    "FASHION_MNIST_SYSTEM_DIR",
]

FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
_FASHION_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")

SYNTHETIC_TRAIN_SIZE = 2048
SYNTHETIC_TEST_SIZE = 512
_SYNTHETIC_NOISE = 1.5
# The validation split's draw: one fixed permutation of the training split, the same for every run
# (seed, scheme, commit), so that every run is chosen on the same held-out images.
VAL_SPLIT_SEED = 20261202
_SYNTHETIC_BLOCK = 256  # samples per independently seeded block: the first N never depend on size


class DatasetUnavailable(RuntimeError):
    """A data set is not on disk and cannot be fetched. The message is one line saying how to get it."""


@dataclass(frozen=True)
class _Info:
    in_channels: int
    num_classes: int
    image_size: int
    augment_padding: int
    flip: bool


# Fashion-MNIST is flipped too: its classes (garments, shoes, bags) keep their label when mirrored
# left-right, and the shoe classes point both ways after flipping, which is the point.
_INFO = {
    "cifar10": _Info(3, 10, 32, 4, True),
    "fashion_mnist": _Info(1, 10, 28, 2, True),
    "synthetic": _Info(3, 10, 32, 4, True),
}
DATASETS: tuple[str, ...] = tuple(_INFO)


def dataset_info(name: str) -> tuple[int, int, int]:
    """(in_channels, num_classes, image_size) of a data set, without loading it."""
    info = _info(name)
    return info.in_channels, info.num_classes, info.image_size


def _info(name: str) -> _Info:
    try:
        return _INFO[name]
    except KeyError:
        raise ValueError(f"unknown data set {name!r}; allowed: {', '.join(DATASETS)}") from None


@dataclass
class Dataset:
    """One data set in memory: normalised float32 images (N,C,H,W) and int64 labels.

    ``mean``/``std`` are the per-channel statistics used to normalise, in raw units (0-255 pixel
    values for CIFAR-10 and Fashion-MNIST). ``augment_padding`` and ``flip`` are the defaults for
    ``ShardedLoader``'s random crop and horizontal flip.
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    in_channels: int
    num_classes: int
    image_size: int
    augment_padding: int
    flip: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # held out of the training split (``val_size``); empty when there is no validation split
    val_x: torch.Tensor | None = None
    val_y: torch.Tensor | None = None

    @property
    def has_validation(self) -> bool:
        return self.val_y is not None and len(self.val_y) > 0


def load_dataset(
    name: str,
    root: str | os.PathLike,
    *,
    download: bool = True,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
    val_size: int = 0,
) -> Dataset:
    """Load ``name`` into memory. ``val_size`` images of the training split are held out as the
    validation split (``split_validation``); ``train_size``/``test_size`` then keep the first N
    samples of the rest and of the test split (deterministic), for quick runs. ``seed`` only
    matters for ``synthetic`` (the validation draw never depends on it). ``synthetic`` (tests and
    smoke runs) generates ``train_size`` images and holds the validation split out of those: it
    trains on ``train_size - val_size``, and its validation images change with ``train_size``;
    kept so, since the pinned tests' numbers rest on it.

    Raises ``DatasetUnavailable`` when the data are missing and cannot be fetched.
    """
    info = _info(name)
    root = Path(root).expanduser()
    if name == "cifar10":
        train_x, train_y, test_x, test_y = _load_cifar10(root, download)
    elif name == "fashion_mnist":
        train_x, train_y, test_x, test_y = _load_fashion_mnist(root, download)
    else:
        n_train = SYNTHETIC_TRAIN_SIZE if train_size is None else train_size
        n_test = SYNTHETIC_TEST_SIZE if test_size is None else test_size
        train_x, train_y, test_x, test_y = _make_synthetic(seed, n_train, n_test)

    val_x, val_y = train_x[:0], train_y[:0]
    if val_size:
        train_x, train_y, val_x, val_y = split_validation(train_x, train_y, val_size)
    # Statistics of the whole training split (less the validation images), before any subsetting.
    # For synthetic data, the population statistics, so they too are the same whatever train_size is.
    if name == "synthetic":
        mean, std = _synthetic_stats(seed)
    else:
        mean, std = _channel_stats(train_x)
    train_x, train_y = _first(train_x, train_y, train_size)
    test_x, test_y = _first(test_x, test_y, test_size)
    return Dataset(
        name=name,
        train_x=_normalise(train_x, mean, std),
        train_y=torch.as_tensor(train_y, dtype=torch.int64),
        test_x=_normalise(test_x, mean, std),
        test_y=torch.as_tensor(test_y, dtype=torch.int64),
        in_channels=info.in_channels,
        num_classes=info.num_classes,
        image_size=info.image_size,
        augment_padding=info.augment_padding,
        flip=info.flip,
        mean=tuple(mean.tolist()),
        std=tuple(std.tolist()),
        val_x=_normalise(val_x, mean, std),
        val_y=torch.as_tensor(val_y, dtype=torch.int64),
    )


def split_validation(x, y, val_size: int):
    """``(train_x, train_y, val_x, val_y)``: ``val_size`` samples drawn from ``x, y`` by one fixed
    permutation (``VAL_SPLIT_SEED``), each split kept in its original order. The draw depends only
    on the split's length, so every run holds out the same images."""
    n = len(y)
    if not 0 < val_size < n:
        raise ConfigError(f"data.val_size={val_size} is not allowed: it must be in [0, {n}) "
                         f"(the training split holds {n} examples)")
    order = np.random.default_rng(VAL_SPLIT_SEED).permutation(n)
    held = np.zeros(n, dtype=bool)
    held[order[:val_size]] = True
    keep = np.flatnonzero(~held)
    out = np.flatnonzero(held)
    return x[keep], y[keep], x[out], y[out]


def _first(x, y, n: int | None):
    if n is None:
        return x, y
    if n <= 0:
        raise ValueError(f"subset size must be positive, got {n}")
    return x[:n], y[:n]


def _channel_stats(x) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of an N,C,H,W array (uint8 or float), in float64."""
    x = x.numpy() if isinstance(x, torch.Tensor) else x
    c = x.shape[1]
    mean = np.empty(c)
    std = np.empty(c)
    for i in range(c):  # one channel at a time keeps the float64 copy small
        ch = x[:, i].astype(np.float64)
        mean[i] = ch.mean()
        std[i] = ch.std()
    return mean, np.maximum(std, 1e-12)


def _normalise(x, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    t = torch.as_tensor(x).to(torch.float32)
    m = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return t.sub_(m).div_(s).contiguous()


# --------------------------------------------------------------------------- CIFAR-10


def _cifar10_classes():
    from torchvision.datasets import CIFAR10

    class _CIFAR10Unverified(CIFAR10):
        """torchvision's reader without the md5 check, for a folder whose checksums differ from
        the published ones (e.g. a small hand-written CIFAR-format folder in tests)."""

        def _check_integrity(self) -> bool:
            return all(
                os.path.isfile(os.path.join(self.root, self.base_folder, f))
                for f, _ in self.train_list + self.test_list
            )

        def _load_meta(self) -> None:
            import pickle

            path = os.path.join(self.root, self.base_folder, self.meta["filename"])
            with open(path, "rb") as f:
                self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    return CIFAR10, _CIFAR10Unverified


def _load_cifar10(root: Path, download: bool):
    CIFAR10, CIFAR10Unverified = _cifar10_classes()
    folder = root / _CIFAR_FOLDER
    missing = [f for f in _CIFAR_FILES if not (folder / f).is_file()]
    if not missing:
        # The folder is there: read it, never touch the network. torchvision checks md5 on every
        # load; a folder with other checksums is read as-is, with a warning.
        try:
            splits = [CIFAR10(str(root), train=t, download=False) for t in (True, False)]
        except RuntimeError:
            warnings.warn(
                f"CIFAR-10 files in {folder} do not match the published md5 checksums; "
                "loading them as they are",
                stacklevel=3,
            )
            splits = [CIFAR10Unverified(str(root), train=t, download=False) for t in (True, False)]
    elif not download:
        raise DatasetUnavailable(
            f"CIFAR-10 not found: {folder} lacks {', '.join(missing)}; set data.download=true on a "
            "machine with internet, or unpack cifar-10-python.tar.gz "
            "(https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz) into that folder's parent"
        )
    else:
        try:
            splits = [CIFAR10(str(root), train=t, download=True) for t in (True, False)]
        except Exception as e:  # URLError, OSError, md5 failure: all mean "cannot fetch"
            raise DatasetUnavailable(
                f"CIFAR-10 not found in {folder} and the download failed "
                f"({one_line_error(e)}); unpack cifar-10-python.tar.gz "
                "(https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz) into that folder's parent"
            ) from e
    out = []
    for ds in splits:
        x = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2)  # NHWC -> NCHW
        out += [x, torch.as_tensor(ds.targets, dtype=torch.int64)]
    return tuple(out)


# --------------------------------------------------------------------------- Fashion-MNIST


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) of unsigned bytes: images (magic 2051,
    N x rows x cols) or labels (magic 2049, N)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[0:4], "big")
    if magic not in (2049, 2051):
        raise ValueError(f"{path}: not an unsigned-byte IDX label/image file (magic {magic})")
    ndim = magic & 0xFF
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    data = np.frombuffer(raw, dtype=np.uint8, offset=offset)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: expected {dims} bytes of data, found {data.size}")
    return data.reshape(dims)


def _find_idx(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def _fashion_folder(folders: list[Path]) -> dict[str, Path] | None:
    for folder in folders:
        found = {k: _find_idx(folder, stem) for k, stem in _FASHION_FILES.items()}
        if all(found.values()):
            return found  # type: ignore[return-value]
    return None


def _load_fashion_mnist(root: Path, download: bool):
    folders = [FASHION_MNIST_SYSTEM_DIR, root, root / "FashionMNIST" / "raw"]
    files = _fashion_folder(folders)
    if files is None and download:
        from torchvision.datasets import FashionMNIST

        try:
            FashionMNIST(str(root), train=True, download=True)
        except Exception as e:
            raise DatasetUnavailable(
                f"Fashion-MNIST not found in {', '.join(map(str, folders))} and the download "
                f"failed ({one_line_error(e)}); "
                "install it with `apt-get install dataset-fashion-mnist`"
            ) from e
        files = _fashion_folder([root / "FashionMNIST" / "raw"])
    if files is None:
        raise DatasetUnavailable(
            f"Fashion-MNIST not found in {', '.join(map(str, folders))}"
            + ("" if download else " (download disabled)")
            + "; install it with `apt-get install dataset-fashion-mnist`"
        )
    arrays = {k: read_idx(p) for k, p in files.items()}
    for split in ("train", "test"):
        if len(arrays[f"{split}_x"]) != len(arrays[f"{split}_y"]):
            raise ValueError(f"Fashion-MNIST {split} images and labels differ in count")
    return (
        torch.from_numpy(arrays["train_x"].copy()).unsqueeze(1),
        torch.from_numpy(arrays["train_y"].astype(np.int64)),
        torch.from_numpy(arrays["test_x"].copy()).unsqueeze(1),
        torch.from_numpy(arrays["test_y"].astype(np.int64)),
    )


# --------------------------------------------------------------------------- synthetic


def synthetic_templates(seed: int, num_classes: int = 10, channels: int = 3, size: int = 32):
    """Fixed class templates: smooth random patterns (8x8 noise upsampled), unit scale.
    Smooth, so that a few pixels of random crop do not wipe out the class signal."""
    g = torch.Generator().manual_seed(_mix(seed, 0x5EED))
    coarse = torch.randn(num_classes, channels, 8, 8, generator=g)
    t = torch.nn.functional.interpolate(
        coarse, size=(size, size), mode="bilinear", align_corners=False
    )
    return t / t.flatten(1).std(dim=1).view(-1, 1, 1, 1)


def _synthetic_stats(seed: int, noise: float = _SYNTHETIC_NOISE) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean/std of the synthetic distribution (uniform classes plus noise)."""
    t = synthetic_templates(seed).double().transpose(0, 1).flatten(1)  # C, classes*H*W
    mean = t.mean(dim=1)
    var = (t**2).mean(dim=1) - mean**2 + noise**2
    return mean.numpy(), var.sqrt().numpy()


def _make_synthetic(seed: int, n_train: int, n_test: int, noise: float = _SYNTHETIC_NOISE):
    """x = template[y] + noise * N(0, 1). Per-pixel SNR is low (noise 1.5 vs signal 1), so no
    single pixel tells the class, but the whole image does: a nearest-template classifier is
    nearly perfect and a small CNN learns it within a few dozen steps. Samples come in blocks,
    each from its own generator seeded by (seed, split, block), so the first N samples are the
    same whatever the requested size."""
    templates = synthetic_templates(seed)
    out = []
    for split, n in ((1, n_train), (2, n_test)):
        if n <= 0:
            raise ValueError(f"synthetic split size must be positive, got {n}")
        xs, ys = [], []
        for block in range((n + _SYNTHETIC_BLOCK - 1) // _SYNTHETIC_BLOCK):
            g = torch.Generator().manual_seed(_mix(seed, split, block))
            y = torch.randint(0, templates.shape[0], (_SYNTHETIC_BLOCK,), generator=g)
            x = templates[y] + noise * torch.randn(
                (_SYNTHETIC_BLOCK, *templates.shape[1:]), generator=g
            )
            xs.append(x)
            ys.append(y)
        out += [torch.cat(xs)[:n], torch.cat(ys)[:n]]
    return tuple(out)


# --------------------------------------------------------------------------- loading batches


def _mix(*values: int) -> int:
    """Combine integers into one 63-bit generator seed (SeedSequence hashing: no collisions
    between e.g. (seed=1, epoch=0) and (seed=0, epoch=1))."""
    state = np.random.SeedSequence([int(v) & 0xFFFFFFFFFFFFFFFF for v in values]).generate_state(2)
    return (int(state[0]) << 31 ^ int(state[1])) & 0x7FFFFFFFFFFFFFFF


def random_crop(x: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Pad each image with ``padding`` zeros and cut a random HxW window per sample, by
    advanced indexing with per-sample row/column index grids (no loop over samples)."""
    if padding <= 0:
        return x
    b, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    offsets = torch.randint(0, 2 * padding + 1, (2, b), generator=generator).to(x.device)
    rows = (offsets[0].view(b, 1) + torch.arange(h, device=x.device)).view(b, 1, h, 1)
    cols = (offsets[1].view(b, 1) + torch.arange(w, device=x.device)).view(b, 1, 1, w)
    bi = torch.arange(b, device=x.device).view(b, 1, 1, 1)
    ci = torch.arange(c, device=x.device).view(1, c, 1, 1)
    return padded[bi, ci, rows, cols]


def random_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Mirror each image left-right with probability 1/2."""
    mask = (torch.rand(x.shape[0], generator=generator) < 0.5).to(x.device)
    return torch.where(mask.view(-1, 1, 1, 1), x.flip(3), x)


class ShardedLoader:
    """This rank's batches of an in-memory training set.

    Every epoch, all ranks draw the same permutation of the whole set (generator seeded by
    (seed, epoch)); rank r takes ``perm[r::world_size]`` after trimming the set to a multiple of
    ``world_size``, so shards are disjoint and every rank has the same number of batches. The last
    incomplete batch is dropped. Augmentation draws from a generator seeded by
    (seed, rank, epoch, batch index), so ``batches(epoch, start_batch=k)`` yields exactly the
    batches k, k+1, ... that an uninterrupted epoch yields: resuming a checkpoint is bit-exact.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        augment: bool = True,
        padding: int = 4,
        flip: bool = True,
    ) -> None:
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.augment, self.padding, self.flip = augment, padding, flip
        # Zero batches per epoch is possible (too few samples per rank); callers check len().
        self.shard_size = len(x) // world_size

    def __len__(self) -> int:
        return self.shard_size // self.batch_size

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices for ``epoch``, in order (before dropping the last batch)."""
        g = torch.Generator().manual_seed(_mix(self.seed, epoch))
        perm = torch.randperm(len(self.x), generator=g)[: self.shard_size * self.world_size]
        return perm[self.rank :: self.world_size]

    def batches(
        self, epoch: int, start_batch: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.indices(epoch).to(self.x.device)
        for i in range(start_batch, len(self)):
            sel = idx[i * self.batch_size : (i + 1) * self.batch_size]
            xb, yb = self.x[sel], self.y[sel]
            if self.augment:
                g = torch.Generator().manual_seed(_mix(self.seed, self.rank, epoch, i))
                xb = random_crop(xb, self.padding, g)
                if self.flip:
                    xb = random_flip(xb, g)
            yield xb, yb

    def __iter__(self):  # an epoch-0 pass, for casual use
        return self.batches(0)


def eval_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive evaluation batches, no shuffling or augmentation; the last one may be short."""
    for i in range(0, len(x), batch_size):
        yield x[i : i + batch_size], y[i : i + batch_size]


