"""DistributedSampler shards, set_epoch, padding vs drop_last, Join with uneven inputs, and the real dataset loaders."""
import hashlib
import pickle

import numpy as np
import pytest
import torch

from labsrc import data, sampling
from labsrc.testing import run_ranks


@pytest.mark.parametrize("size, world_size", [(10, 2), (10, 3), (12, 4)])
def test_one_epoch_is_a_disjoint_cover_with_padding(size, world_size):
    orders = sampling.epoch_orders(size, world_size, epochs=1)
    read = [i for order in orders.values() for i in order[0]]
    assert set(read) == set(range(size))
    per_rank = -(-size // world_size)
    assert all(len(order[0]) == per_rank for order in orders.values())
    assert len(read) - size == sampling.coverage(size, world_size, drop_last=False)["duplicates"]


def test_drop_last_drops_instead_of_duplicating():
    padded, dropped = sampling.coverage(10, 3, False), sampling.coverage(10, 3, True)
    assert (padded["read"], padded["duplicates"], padded["dropped"]) == (12, 2, 0)
    assert (dropped["read"], dropped["duplicates"], dropped["dropped"]) == (9, 0, 1)


def test_without_set_epoch_every_epoch_repeats():
    with_epochs = sampling.epoch_orders(20, 2, epochs=3, set_epoch=True)
    without = sampling.epoch_orders(20, 2, epochs=3, set_epoch=False)
    for rank in range(2):
        assert without[rank][0] == without[rank][1] == without[rank][2]
        assert with_epochs[rank][0] != with_epochs[rank][1]


def test_join_lets_uneven_ranks_finish_in_step():
    results = run_ranks(sampling.train_uneven_with_join, 2, args=([2, 4],), timeout_s=60)
    assert [r["steps"] for r in results] == [2, 4]
    torch.testing.assert_close(results[0]["weight"], results[1]["weight"])


def test_slow_transform_makes_the_loader_the_bottleneck():
    dataset = sampling.SlowTransform(data.synthetic_images(64, 8), cost_s=0.002)
    timing = sampling.time_batches(sampling.loader(dataset, 8, 0, False), 3, torch.device("cpu"))
    assert timing["data_s"] >= 8 * 0.002


def test_image_folder_loads_a_folder_of_pngs(tmp_path):
    from PIL import Image
    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        for index in range(3):
            Image.fromarray(np.full((20, 24, 3), 40 * index, dtype=np.uint8)).save(tmp_path / label / f"{index}.png")
    dataset = data.image_folder(tmp_path, image_size=16)
    images, label = dataset[4]
    assert len(dataset) == 6 and dataset.classes == ["cat", "dog"]
    assert images.shape == (3, 16, 16) and label == 1


def _write_fake_cifar(root):
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {"data": rng.integers(0, 255, (4, 3072), dtype=np.uint8), "labels": list(range(4))}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{i}" for i in range(10)]}))
    return {path.name: hashlib.md5(path.read_bytes()).hexdigest() for path in folder.iterdir()}


def test_cifar10_through_torchvision_on_files_we_made(tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10
    md5 = _write_fake_cifar(tmp_path)
    monkeypatch.setattr(CIFAR10, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)])
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names", "md5": md5["batches.meta"]})
    train, test = data.cifar10(tmp_path, train=True), data.cifar10(tmp_path, train=False)
    assert len(train) == 20 and len(test) == 4
    image, label = train[0]
    assert image.shape == (3, 32, 32) and label == 0 and train.classes[3] == "class3"


def test_cifar10_is_none_when_absent(tmp_path):
    assert data.cifar10(tmp_path) is None
