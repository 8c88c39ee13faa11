"""Datasets for the examples: an offline default that really learns, and real CIFAR-10 on request.

The machines this project runs on may have no internet, so nothing here ever downloads.

* Default: scikit-learn's bundled handwritten digits (1,797 8x8 grey images, shipped inside the
  scikit-learn wheel). They are split train/test deterministically, upsampled to the model's
  input size, repeated to 3 channels and normalized, so the seed models (built for 32x32 or
  14x14 colour images) train on them unchanged. A small CNN reaches well over 90% test accuracy
  in a few hundred steps, which makes "the loss goes down" a meaningful check.
* ``data_dir`` given: torchvision's CIFAR-10 from ``<data_dir>/cifar-10-batches-py`` (the
  layout ``torchvision.datasets.CIFAR10`` unpacks), resized when the model wants another size.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "load_cifar10", "load_datasets", "load_digits"]

# Per-channel statistics of the CIFAR-10 training set (the values used across the literature).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

CIFAR10_FOLDER = "cifar-10-batches-py"


def load_digits(
    image_size: int = 32, test_fraction: float = 0.2, split_seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """The scikit-learn digits as ``(train, test)`` TensorDatasets of 3 x image_size x image_size.

    The split is stratified and fixed by ``split_seed``, so every rank and every run sees the
    same partition. Normalization uses the training split's mean and std only (no test leakage).
    Labels are int64 class indices 0-9.
    """
    # Imported here: scikit-learn is only needed for this dataset and takes a while to import.
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    digits = sk_load_digits()
    idx_train, idx_test = train_test_split(
        range(len(digits.target)),
        test_size=test_fraction,
        random_state=split_seed,
        stratify=digits.target,
    )
    # Pixel values are 0..16; scale to 0..1 before resizing so interpolation stays in range.
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                           align_corners=False)
    images = images.expand(-1, 3, -1, -1).contiguous()  # the seed models expect RGB input
    labels = torch.as_tensor(digits.target, dtype=torch.int64)

    x_train, y_train = images[list(idx_train)], labels[list(idx_train)]
    x_test, y_test = images[list(idx_test)], labels[list(idx_test)]
    mean, std = x_train.mean(), x_train.std()
    return (TensorDataset((x_train - mean) / std, y_train),
            TensorDataset((x_test - mean) / std, y_test))


def load_cifar10(data_dir: str, image_size: int = 32) -> tuple[Dataset, Dataset]:
    """CIFAR-10 ``(train, test)`` from ``data_dir``, never downloading.

    ``data_dir`` must contain ``cifar-10-batches-py/`` (``data_batch_1`` .. ``data_batch_5``,
    ``test_batch``, ``batches.meta``), e.g. after ``tar xzf cifar-10-python.tar.gz -C data_dir``.
    Images are resized to ``image_size`` when it is not 32, then normalized.
    Raises FileNotFoundError naming the folder when the data is missing or incomplete.
    """
    import torchvision.datasets as datasets
    import torchvision.transforms as T

    folder = os.path.join(os.path.abspath(data_dir), CIFAR10_FOLDER)
    if not os.path.isdir(folder):
        raise FileNotFoundError(_missing_cifar_message(data_dir, f"{folder} does not exist"))

    steps: list = [T.ToTensor()]
    if image_size != 32:
        steps.append(T.Resize((image_size, image_size), antialias=True))
    steps.append(T.Normalize(CIFAR10_MEAN, CIFAR10_STD))
    transform = T.Compose(steps)
    try:
        train = datasets.CIFAR10(data_dir, train=True, download=False, transform=transform)
        test = datasets.CIFAR10(data_dir, train=False, download=False, transform=transform)
    except RuntimeError as err:  # torchvision's "Dataset not found or corrupted"
        raise FileNotFoundError(_missing_cifar_message(data_dir, str(err))) from err
    return train, test


def _missing_cifar_message(data_dir: str, reason: str) -> str:
    return (
        f"CIFAR-10 not found in --data-dir {data_dir!r} ({reason}). Expected the layout "
        f"torchvision unpacks: {data_dir}/{CIFAR10_FOLDER}/ with data_batch_1 .. data_batch_5, "
        f"test_batch and batches.meta (from cifar-10-python.tar.gz). Nothing is downloaded; "
        f"omit --data-dir to train on the bundled scikit-learn digits instead."
    )


def load_datasets(image_size: int, data_dir: str | None = None) -> tuple[Dataset, Dataset]:
    """``(train, test)`` for a model taking 3 x image_size x image_size input and 10 classes.

    CIFAR-10 from ``data_dir`` when given, otherwise the offline digits.
    """
    if data_dir:
        return load_cifar10(data_dir, image_size)
    return load_digits(image_size)
