"""The offline digits dataset and the CIFAR-10 loader (with a fake, download-free CIFAR folder)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from mini_ddp.training.data import CIFAR10_FOLDER, load_cifar10, load_datasets, load_digits


@pytest.mark.parametrize("size", [32, 14])
def test_digits_shapes_labels_and_normalization(size):
    train, test = load_digits(size)
    x, y = train.tensors
    assert x.shape == (1437, 3, size, size) and x.dtype == torch.float32
    assert test.tensors[0].shape == (360, 3, size, size)
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1) < 1e-4
    assert torch.equal(x[:, 0], x[:, 2])  # grey digits repeated into 3 channels


def test_digits_split_is_deterministic_disjoint_and_stratified():
    train_a, test_a = load_digits(14)
    train_b, test_b = load_digits(14)
    assert torch.equal(train_a.tensors[0], train_b.tensors[0])
    assert torch.equal(test_a.tensors[1], test_b.tensors[1])
    counts = torch.bincount(test_a.tensors[1], minlength=10)
    assert counts.min() >= 33 and counts.max() <= 38  # ~36 per class out of 360
    flat_train = {tuple(r.tolist()) for r in train_a.tensors[0][:, 0].flatten(1)}
    overlap = sum(tuple(r.tolist()) in flat_train for r in test_a.tensors[0][:, 0].flatten(1))
    assert overlap <= 2  # the raw digits data has a couple of exact duplicate images


def test_digits_are_learnable_by_a_linear_model():
    train, test = load_digits(14)
    x, y = train.tensors[0].flatten(1), train.tensors[1]
    torch.manual_seed(0)
    lin = torch.nn.Linear(x.shape[1], 10)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(lin(x), y).backward()
        opt.step()
    acc = (lin(test.tensors[0].flatten(1)).argmax(1) == test.tensors[1]).float().mean()
    assert acc > 0.9


def test_missing_cifar_names_the_folder_and_layout(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_datasets(32, data_dir=str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message and CIFAR10_FOLDER in message and "data_batch_1" in message


def test_incomplete_cifar_folder_names_the_folder(tmp_path):
    (tmp_path / CIFAR10_FOLDER).mkdir()
    with pytest.raises(FileNotFoundError, match=CIFAR10_FOLDER):
        load_cifar10(str(tmp_path))


def _write_fake_cifar(root: str, per_batch: int = 4) -> None:
    """Write the cifar-10-batches-py pickles torchvision reads (random pixels, tiny)."""
    folder = os.path.join(root, CIFAR10_FOLDER)
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": list(rng.integers(0, 10, per_batch))}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch, f)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)


@pytest.mark.parametrize("size", [32, 14])
def test_cifar_loads_from_data_dir_and_resizes(tmp_path, monkeypatch, size):
    import torchvision.datasets.cifar as cifar

    _write_fake_cifar(str(tmp_path))
    # Our fake files cannot match the real archive's MD5 sums; everything else is real.
    monkeypatch.setattr(cifar, "check_integrity", lambda *args, **kwargs: True)
    train, test = load_datasets(size, data_dir=str(tmp_path))
    assert len(train) == 20 and len(test) == 4
    x, y = train[0]
    assert x.shape == (3, size, size) and x.dtype == torch.float32 and 0 <= y < 10
