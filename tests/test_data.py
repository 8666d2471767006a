import gzip
import pickle
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from sparsetrain import data
from sparsetrain.data import (
    DATASETS,
    DatasetUnavailable,
    ShardedLoader,
    dataset_info,
    eval_batches,
    load_dataset,
    random_crop,
)


@pytest.fixture
def no_network(monkeypatch):
    """Make every torchvision download fail as it would offline, without touching the network."""
    import torchvision.datasets.cifar as tv_cifar
    import torchvision.datasets.mnist as tv_mnist

    calls = []

    def offline(url, *args, **kwargs):
        calls.append(url)
        raise urllib.error.URLError("network is unreachable (simulated)")

    monkeypatch.setattr(tv_cifar, "download_and_extract_archive", offline)
    monkeypatch.setattr(tv_mnist, "download_and_extract_archive", offline)
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    return calls


# ------------------------------------------------------------------ info


def test_dataset_info():
    assert set(DATASETS) == {"cifar10", "fashion_mnist", "synthetic"}
    assert dataset_info("cifar10") == (3, 10, 32)
    assert dataset_info("fashion_mnist") == (1, 10, 28)
    assert dataset_info("synthetic") == (3, 10, 32)
    with pytest.raises(ValueError, match="cifar10"):
        dataset_info("imagenet")
    with pytest.raises(ValueError, match="synthetic"):
        load_dataset("imagenet", "/nonexistent")


# ------------------------------------------------------------------ CIFAR-10


def write_tiny_cifar(root: Path, n_per_batch=4, n_test=6, seed=0):
    """A CIFAR-10 python-format folder: rows are 1024 R, 1024 G, 1024 B bytes of a 32x32 image."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    images, labels = {}, {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = n_test if name == "test_batch" else n_per_batch
        rows = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        ys = rng.integers(0, 10, size=n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "data": rows, "labels": ys, "filenames": []}, f)
        images[name], labels[name] = rows.reshape(n, 3, 32, 32), ys
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)], "num_vis": 3072}, f)
    train_x = np.concatenate([images[n] for n in names[:5]])
    train_y = sum((labels[n] for n in names[:5]), [])
    return train_x, np.array(train_y), images["test_batch"], np.array(labels["test_batch"])


def unnormalise(ds, x):
    mean = torch.tensor(ds.mean).view(1, -1, 1, 1)
    std = torch.tensor(ds.std).view(1, -1, 1, 1)
    return (x.double() * std + mean).round().to(torch.uint8)


@pytest.mark.parametrize("download", [False, True])
def test_cifar10_from_written_folder(tmp_path, no_network, download):
    train_x, train_y, test_x, test_y = write_tiny_cifar(tmp_path)
    # Our folder's checksums differ from the published ones: read as-is, with a warning.
    with pytest.warns(UserWarning, match="md5"):
        ds = load_dataset("cifar10", tmp_path, download=download)
    assert no_network == []  # files present: no download attempted
    assert ds.train_x.shape == (20, 3, 32, 32) and ds.train_x.dtype == torch.float32
    assert ds.test_x.shape == (6, 3, 32, 32)
    assert ds.train_y.dtype == torch.int64
    assert ds.train_y.tolist() == train_y.tolist() and ds.test_y.tolist() == test_y.tolist()
    # Normalised per channel over the training split, and channel/pixel order preserved.
    assert ds.train_x.mean(dim=(0, 2, 3)).abs().max() < 1e-4
    assert (ds.train_x.std(dim=(0, 2, 3)) - 1).abs().max() < 1e-3
    assert torch.equal(unnormalise(ds, ds.train_x), torch.from_numpy(train_x))
    assert torch.equal(unnormalise(ds, ds.test_x), torch.from_numpy(test_x))
    assert (ds.in_channels, ds.num_classes, ds.image_size) == (3, 10, 32)
    assert ds.augment_padding == 4 and ds.flip is True


def test_cifar10_subset_takes_first_n(tmp_path, no_network):
    write_tiny_cifar(tmp_path)
    with pytest.warns(UserWarning):
        full = load_dataset("cifar10", tmp_path, download=False)
        small = load_dataset("cifar10", tmp_path, download=False, train_size=7, test_size=3)
    assert torch.equal(small.train_x, full.train_x[:7]) and torch.equal(
        small.test_y, full.test_y[:3]
    )


def test_cifar10_missing_and_no_internet(tmp_path, no_network):
    with pytest.raises(DatasetUnavailable) as err:
        load_dataset("cifar10", tmp_path, download=True)
    assert no_network, "the download should have been tried (and failed offline)"
    msg = str(err.value)
    assert "\n" not in msg and "CIFAR-10" in msg and str(tmp_path) in msg
    assert "cifar-10-python.tar.gz" in msg
    assert isinstance(err.value, RuntimeError)


def test_cifar10_missing_without_download(tmp_path, no_network):
    write_tiny_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(DatasetUnavailable, match="test_batch") as err:
        load_dataset("cifar10", tmp_path, download=False)
    assert "\n" not in str(err.value)
    assert no_network == []


# ------------------------------------------------------------------ Fashion-MNIST


def write_idx(path: Path, array: np.ndarray, compress=True):
    magic = 2051 if array.ndim == 3 else 2049
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        with gzip.open(path.with_name(path.name + ".gz"), "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


@pytest.mark.parametrize("layout", ["flat", "torchvision"])
@pytest.mark.parametrize("compress", [True, False])
def test_fashion_mnist_from_root(tmp_path, monkeypatch, no_network, layout, compress):
    monkeypatch.setattr(data, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "no-system-copy")
    rng = np.random.default_rng(0)
    folder = tmp_path if layout == "flat" else tmp_path / "FashionMNIST" / "raw"
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 12),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 5),
    }
    for name, a in arrays.items():
        write_idx(folder / name, a, compress)
    ds = load_dataset("fashion_mnist", tmp_path, download=True)
    assert no_network == []
    assert ds.train_x.shape == (12, 1, 28, 28) and ds.test_x.shape == (5, 1, 28, 28)
    assert ds.train_y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert torch.equal(
        unnormalise(ds, ds.test_x)[:, 0],
        torch.from_numpy(arrays["t10k-images-idx3-ubyte"].astype(np.uint8)),
    )
    assert ds.augment_padding == 2 and ds.in_channels == 1


def test_idx_rejects_bad_magic(tmp_path):
    (tmp_path / "bad").write_bytes((1234).to_bytes(4, "big") + bytes(8))
    with pytest.raises(ValueError, match="magic"):
        data.read_idx(tmp_path / "bad")


def test_fashion_mnist_missing_and_no_internet(tmp_path, monkeypatch, no_network):
    monkeypatch.setattr(data, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "no-system-copy")
    with pytest.raises(DatasetUnavailable) as err:
        load_dataset("fashion_mnist", tmp_path / "root", download=True)
    assert no_network, "the download should have been tried (and failed offline)"
    msg = str(err.value)
    assert "\n" not in msg and "apt-get install dataset-fashion-mnist" in msg
    assert "no-system-copy" in msg and str(tmp_path / "root") in msg
    with pytest.raises(DatasetUnavailable, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion_mnist", tmp_path / "root", download=False)


@pytest.mark.skipif(
    not (data.FASHION_MNIST_SYSTEM_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason=f"Debian's Fashion-MNIST files are not in {data.FASHION_MNIST_SYSTEM_DIR} "
    "(apt-get install dataset-fashion-mnist)",
)
def test_fashion_mnist_from_debian_package(tmp_path, no_network):
    ds = load_dataset("fashion_mnist", tmp_path, download=False)
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    assert sorted(ds.train_y.unique().tolist()) == list(range(10))
    assert sorted(ds.test_y.unique().tolist()) == list(range(10))
    assert torch.bincount(ds.train_y).tolist() == [6000] * 10
    assert abs(ds.train_x.mean().item()) < 1e-3 and abs(ds.train_x.std().item() - 1) < 1e-3


# ------------------------------------------------------------------ synthetic


def test_synthetic_is_deterministic_and_prefix_stable():
    a = load_dataset("synthetic", "/nonexistent", seed=1)
    b = load_dataset("synthetic", "/nonexistent", seed=1)
    c = load_dataset("synthetic", "/nonexistent", seed=2)
    assert a.train_x.shape == (data.SYNTHETIC_TRAIN_SIZE, 3, 32, 32)
    assert a.test_x.shape == (data.SYNTHETIC_TEST_SIZE, 3, 32, 32)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert not torch.equal(a.train_x, c.train_x)
    small = load_dataset("synthetic", "/nonexistent", seed=1, train_size=300, test_size=40)
    assert torch.equal(small.train_x, a.train_x[:300]) and torch.equal(small.test_y, a.test_y[:40])
    big = load_dataset("synthetic", "/nonexistent", seed=1, train_size=3000)
    assert big.train_x.shape[0] == 3000 and torch.equal(big.train_x[:2048], a.train_x)
    assert not torch.equal(a.train_x[:512], a.test_x)  # test split is not a copy of train
    assert sorted(a.train_y.unique().tolist()) == list(range(10))
    assert abs(a.train_x.mean().item()) < 0.02 and abs(a.train_x.std().item() - 1) < 0.02


def test_synthetic_is_learnable_but_not_trivial():
    ds = load_dataset("synthetic", "/nonexistent", seed=0)
    # Nearest class mean, estimated from the training split, classifies the test split well...
    means = torch.stack([ds.train_x[ds.train_y == k].mean(0) for k in range(10)]).flatten(1)
    dist = torch.cdist(ds.test_x.flatten(1), means)
    assert (dist.argmin(1) == ds.test_y).float().mean() > 0.95
    # ...while a single pixel carries little of it.
    pixel = ds.train_x[:, 0, 16, 16]
    pixel_means = torch.stack([pixel[ds.train_y == k].mean() for k in range(10)])
    pred = (ds.test_x[:, 0, 16, 16, None] - pixel_means).abs().argmin(1)
    assert (pred == ds.test_y).float().mean() < 0.5


# ------------------------------------------------------------------ ShardedLoader


def labelled(n=64, c=3, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, size, size, generator=g), torch.arange(n)  # label = sample id


@pytest.mark.parametrize("n,world,batch", [(64, 2, 8), (67, 4, 4), (50, 3, 16)])
def test_shards_are_disjoint_and_cover(n, world, batch):
    x, y = labelled(n)
    loaders = [
        ShardedLoader(x, y, batch, rank=r, world_size=world, seed=5, augment=False)
        for r in range(world)
    ]
    assert len({len(ld) for ld in loaders}) == 1  # same number of steps on every rank
    assert len(loaders[0]) == (n // world) // batch
    seen = [torch.cat([yb for _, yb in ld.batches(3)]) for ld in loaders]
    everything = torch.cat(seen)
    assert len(everything) == world * len(loaders[0]) * batch
    assert len(everything.unique()) == len(everything)  # disjoint, no repeats
    shards = torch.cat([ld.indices(3) for ld in loaders])
    assert len(shards.unique()) == len(shards) == (n // world) * world
    # Unaugmented batches are exactly the indexed samples.
    for ld in loaders:
        for xb, yb in ld.batches(3):
            assert torch.equal(xb, x[yb])


def test_shards_cover_everything_when_sizes_divide():
    x, y = labelled(48)
    ranks = [ShardedLoader(x, y, 6, rank=r, world_size=4, seed=0, augment=False) for r in range(4)]
    got = torch.cat([yb for ld in ranks for _, yb in ld.batches(0)])
    assert sorted(got.tolist()) == list(range(48))


def test_same_seed_and_epoch_same_batches_new_epoch_new_order():
    x, y = labelled(64)

    def run(seed, epoch):
        ld = ShardedLoader(x, y, 8, rank=1, world_size=2, seed=seed, padding=2, flip=True)
        return list(ld.batches(epoch))

    a, b = run(7, 2), run(7, 2)
    assert all(
        torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True)
    )
    assert not torch.equal(torch.cat([yb for _, yb in run(7, 3)]), torch.cat([yb for _, yb in a]))
    assert not torch.equal(torch.cat([yb for _, yb in run(8, 2)]), torch.cat([yb for _, yb in a]))


def test_resume_reproduces_the_tail_exactly():
    x, y = labelled(80)
    ld = ShardedLoader(x, y, 8, rank=0, world_size=2, seed=3, padding=4, flip=True)
    full = list(ld.batches(epoch=1))
    fresh = ShardedLoader(x, y, 8, rank=0, world_size=2, seed=3, padding=4, flip=True)
    tail = list(fresh.batches(epoch=1, start_batch=2))
    assert len(tail) == len(full) - 2 == 3
    for (xa, ya), (xb, yb) in zip(full[2:], tail, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert list(fresh.batches(epoch=1, start_batch=len(fresh))) == []


def test_random_crop_is_a_shifted_window_per_sample():
    x, _ = labelled(32, c=2, size=6)
    p = 2
    out = random_crop(x, p, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (p, p, p, p))
    offsets = set()
    for i in range(len(x)):  # reference check, one sample at a time
        matches = [
            (dy, dx)
            for dy in range(2 * p + 1)
            for dx in range(2 * p + 1)
            if torch.equal(out[i], padded[i, :, dy : dy + 6, dx : dx + 6])
        ]
        assert len(matches) == 1
        offsets.add(matches[0])
    assert len(offsets) > 5  # offsets differ between samples
    assert random_crop(x, 0, torch.Generator()) is x


def test_loader_applies_crop_and_flip():
    x, y = labelled(64, size=8)
    flip_only = ShardedLoader(x, y, 32, seed=1, padding=0, flip=True)
    kinds = []
    for xb, yb in flip_only.batches(0):
        assert xb.shape == (32, 3, 8, 8)
        for xi, i in zip(xb, yb, strict=True):
            same, mirrored = torch.equal(xi, x[i]), torch.equal(xi, x[i].flip(2))
            assert same or mirrored
            kinds.append(mirrored)
    assert 10 < sum(kinds) < 54  # roughly half flipped

    crop_only = ShardedLoader(x, y, 32, seed=1, padding=2, flip=False)
    changed = [
        not torch.equal(xi, x[i])
        for xb, yb in crop_only.batches(0)
        for xi, i in zip(xb, yb, strict=True)
    ]
    assert sum(changed) > 40  # a (0, 0) shift (prob 1/25) leaves a sample unchanged

    none = ShardedLoader(x, y, 32, seed=1, augment=False)
    assert all(torch.equal(xb, x[yb]) for xb, yb in none.batches(0))


def test_augmentation_differs_across_ranks_and_batches():
    x = torch.randn(1, 3, 8, 8).expand(64, 3, 8, 8).contiguous()  # identical samples
    y = torch.zeros(64, dtype=torch.long)
    r0 = list(ShardedLoader(x, y, 16, rank=0, world_size=2, seed=0, padding=3).batches(0))
    r1 = list(ShardedLoader(x, y, 16, rank=1, world_size=2, seed=0, padding=3).batches(0))
    assert not torch.equal(r0[0][0], r1[0][0])
    assert not torch.equal(r0[0][0], r0[1][0])


def test_loader_rejects_bad_arguments():
    x, y = labelled(16)
    with pytest.raises(ValueError):
        ShardedLoader(x, y, 4, rank=2, world_size=2)
    with pytest.raises(ValueError):
        ShardedLoader(x, y[:8], 4)
    with pytest.raises(ValueError):
        ShardedLoader(x, y, 0)
    too_big = ShardedLoader(x, y, 16, rank=0, world_size=2)  # 8 per rank: no full batch
    assert len(too_big) == 0 and list(too_big.batches(0)) == []


def test_test_batches_cover_in_order():
    x, y = labelled(21)
    got = list(eval_batches(x, y, 8))
    assert [len(yb) for _, yb in got] == [8, 8, 5]
    assert torch.equal(torch.cat([xb for xb, _ in got]), x)
    assert torch.equal(torch.cat([yb for _, yb in got]), y)
