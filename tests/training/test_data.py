"""Dataset sources: digits, MedMNIST npz, image folder + CSV; grey/RGB and any size."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from PIL import Image

from tafl.errors import DataError
from tafl.imaging import Preprocess
from tafl.training.config import RunConfig
from tafl.training.data import load_dataset
from tests.conftest import shared


def test_digits_default_splits_and_resizing():
    ds = load_dataset(RunConfig(dataset="digits", img_size=16).validate())
    assert ds.class_names == [str(i) for i in range(10)]
    total = len(ds.train) + len(ds.val) + len(ds.test)
    assert total == 1797
    assert ds.train.images.shape[1:] == (16, 16, 1) and ds.train.images.dtype == np.uint8
    assert abs(len(ds.test) / total - 0.2) < 0.01
    ids = [set(s.ids.tolist()) for s in (ds.train, ds.val, ds.test)]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert ds.preprocess.channels == 1 and len(ds.preprocess.mean) == 1
    rgb = load_dataset(RunConfig(dataset="digits", img_size=12, channels=3).validate())
    assert rgb.train.images.shape[1:] == (12, 12, 3)


def test_medmnist_from_shared_npz():
    root = shared("medmnist")
    ds = load_dataset(RunConfig(dataset="dermamnist", data_root=str(root)).validate())
    assert len(ds.class_names) == 7 and "melanoma" in ds.class_names
    assert (len(ds.train), len(ds.val), len(ds.test)) == (7007, 1003, 2005)
    assert np.bincount(ds.train.labels).tolist() == [228, 359, 769, 80, 779, 4693, 99]
    assert ds.train.images.shape[1:] == (28, 28, 3)
    assert ds.provenance["sha256"] and len(ds.provenance["sha256"]) == 64
    grey = load_dataset(RunConfig(dataset="pneumoniamnist", data_root=str(root), img_size=32, channels=3).validate())
    assert grey.train.images.shape[1:] == (32, 32, 3)


def test_missing_npz_and_unknown_dataset(tmp_path):
    with pytest.raises(DataError, match="dermamnist.npz not found"):
        load_dataset(RunConfig(dataset="dermamnist", data_root=str(tmp_path)).validate())
    with pytest.raises(DataError, match="unknown dataset 'cifar99'"):
        load_dataset(RunConfig(dataset="cifar99", data_root=str(tmp_path)).validate())
    with pytest.raises(DataError, match="multi-label"):
        load_dataset(RunConfig(dataset="chestmnist", data_root=str(tmp_path)).validate())


def test_corrupt_npz_is_a_clear_error(tmp_path):
    (tmp_path / "breastmnist.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DataError, match="could not load MedMNIST 'breastmnist'"):
        load_dataset(RunConfig(dataset="breastmnist", data_root=str(tmp_path)).validate())


def _make_folder(tmp_path, n_groups=40, per_group=3):
    img_dir = tmp_path / "images"
    img_dir.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for g in range(n_groups):
        label = ["nevus", "melanoma", "bcc"][g % 3]
        for j in range(per_group):
            name = f"img_{g}_{j}"
            h, w = int(rng.integers(20, 90)), int(rng.integers(20, 90))
            if (g + j) % 2:
                Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), "RGB").save(img_dir / f"{name}.jpg")
            else:
                Image.fromarray(rng.integers(0, 255, (h, w), dtype=np.uint8), "L").save(img_dir / f"{name}.png")
            rows.append({"image_id": name, "dx": label, "lesion": f"L{g}"})
    with open(tmp_path / "labels.csv", "w", newline="") as fh:
        wr = csv.DictWriter(fh, ["image_id", "dx", "lesion"])
        wr.writeheader()
        wr.writerows(rows)
    return tmp_path


def _folder_cfg(root, **kw):
    base = dict(dataset="folder", data_root=str(root), labels="labels.csv", label_column="dx",
                group_column="lesion", img_size=24)
    base.update(kw)
    return RunConfig(**base).validate()


def test_folder_with_groups_never_splits_a_group(tmp_path):
    root = _make_folder(tmp_path)
    ds = load_dataset(_folder_cfg(root))
    assert ds.class_names == ["bcc", "melanoma", "nevus"]
    assert ds.train.images.shape[1:] == (24, 24, 3)
    groups = [{i.rsplit("_", 1)[0] for i in s.ids} for s in (ds.train, ds.val, ds.test)]
    assert not (groups[0] & groups[1]) and not (groups[0] & groups[2]) and not (groups[1] & groups[2])
    assert len(ds.train) + len(ds.val) + len(ds.test) == 120
    again = load_dataset(_folder_cfg(root))  # second load comes from the cache, identical
    assert np.array_equal(again.train.images, ds.train.images)


def test_runs_decoding_the_same_folder_at_once_share_one_cache(tmp_path):
    """Seeds started side by side all miss the cache and all write it: each through its own temporary file
    (one shared temporary name made the losers of the race fail with FileNotFoundError)."""
    import threading

    from tafl.training.data import write_cache

    cache = tmp_path / "c" / "folder-x.npz"
    arrays = {"images": np.arange(3 * 64 * 64 * 3, dtype=np.uint8).reshape(3, 64, 64, 3), "rows": np.arange(3)}
    start, results = threading.Barrier(8), []

    def writer():
        start.wait()
        results.append(write_cache(cache, **arrays))

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8
    with np.load(cache) as z:
        assert np.array_equal(z["images"], arrays["images"]) and np.array_equal(z["rows"], arrays["rows"])
    assert sorted(p.name for p in cache.parent.iterdir()) == ["folder-x.npz"]  # no temporary file left behind


def test_a_cache_that_cannot_be_written_does_not_fail_the_load(tmp_path, caplog):
    root = _make_folder(tmp_path)
    (tmp_path / "not-a-dir").write_text("a file where the cache folder should be")
    with caplog.at_level("WARNING", logger="tafl.training.data"):
        ds = load_dataset(_folder_cfg(root, cache_dir=str(tmp_path / "not-a-dir" / "cache")))
    assert len(ds.train) + len(ds.val) + len(ds.test) == 120
    assert "could not write the decoded-image cache" in caplog.text


def test_folder_missing_images_and_columns(tmp_path):
    root = _make_folder(tmp_path, n_groups=6)
    (root / "images" / "img_0_0.png").unlink()
    with pytest.raises(DataError, match="1 image\\(s\\) named in the labels CSV are missing.*img_0_0"):
        load_dataset(_folder_cfg(root))
    with pytest.raises(DataError, match="no column 'diagnosis'"):
        load_dataset(_folder_cfg(root, label_column="diagnosis"))


def test_folder_corrupt_image(tmp_path):
    root = _make_folder(tmp_path, n_groups=6)
    (root / "images" / "img_1_1.jpg").write_bytes(b"\xff\xd8 truncated")
    with pytest.raises(DataError, match="cannot read image .*img_1_1.jpg"):
        load_dataset(_folder_cfg(root, cache_dir=""))


def test_ham10000_layout_from_shared_data(tmp_path):
    root = shared("ham10000")
    rows, per_class = [], {}
    for r in csv.DictReader(open(root / "metadata.csv")):
        if per_class.get(r["dx"], 0) < 40:  # 40 rows of each of the 7 classes
            per_class[r["dx"]] = per_class.get(r["dx"], 0) + 1
            rows.append(r)
    sub = tmp_path / "ham.csv"
    with open(sub, "w", newline="") as fh:
        wr = csv.DictWriter(fh, list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    cfg = RunConfig(dataset="folder", data_root=str(root), labels=str(sub), label_column="dx",
                    group_column="lesion_id", img_size=32).validate()
    ds = load_dataset(cfg)
    lesion = {r["image_id"]: r["lesion_id"] for r in rows}
    sets = [{lesion[i] for i in s.ids} for s in (ds.train, ds.val, ds.test)]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert ds.train.images.shape[1:] == (32, 32, 3)


@pytest.mark.parametrize("arr", [np.zeros((50, 40), np.uint8), np.zeros((50, 40, 3), np.uint8),
                                 np.zeros((50, 40, 4), np.uint8), np.arange(2000, dtype=np.uint16).reshape(50, 40)])
@pytest.mark.parametrize("channels", [1, 3])
def test_preprocess_any_input_to_spec(arr, channels):
    pre = Preprocess(size=28, channels=channels, mean=(0.5,) * channels, std=(0.25,) * channels)
    out = pre.to_uint8(arr)
    assert out.shape == (28, 28, channels) and out.dtype == np.uint8
    x = pre(arr)
    assert x.shape == (1, channels, 28, 28) and x.dtype == np.float32


def test_preprocess_normalize_formula():
    pre = Preprocess(size=2, channels=3, mean=(0.1, 0.2, 0.3), std=(0.5, 0.5, 0.25))
    batch = np.full((1, 2, 2, 3), 255, np.uint8)
    x = pre.normalize(batch)
    assert np.allclose(x[0, :, 0, 0], [(1 - 0.1) / 0.5, (1 - 0.2) / 0.5, (1 - 0.3) / 0.25])
    assert pre == Preprocess.from_dict(pre.to_dict())
