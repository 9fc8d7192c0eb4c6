"""Dataset sources behind one interface: images, labels and class names in train/val/test splits.

Three sources: scikit-learn's digits (the embedded default, real and shipped), MedMNIST by flag
through the `medmnist` package (a `<flag>.npz` in `data_root`, downloaded only when asked), and
an image folder with a labels CSV (the HAM10000 layout: an image-id column, a label column and an
optional group column whose groups never straddle two splits). Folder files (PNG, JPEG, BMP, TIFF
or DICOM, a multi-frame DICOM giving one sample per frame) are read by `tafl.imaging.decode_file`,
the service's own decoder, so a file is the same model input at training and at serving time.
Every split is held once, as uint8 (N, H, W, C) already at the run's side and channel count,
produced by the shared `Preprocess.to_uint8`; normalisation happens per batch.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tafl.errors import DataError
from tafl.files import sha256_file
from tafl.imaging import Preprocess, decode_file
from tafl.settings import env_str
from tafl.training.config import RunConfig

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".dcm", ".dicom")
# bump when the decoding of folder files changes, so caches of the old decoding are not reused
DECODER_VERSION = "imaging-1"


@dataclass
class Split:
    images: np.ndarray  # uint8 (N, H, W, C)
    labels: np.ndarray  # int64 (N,)
    ids: np.ndarray  # (N,) sample identifiers in the source (index or file id), for provenance
    sites: np.ndarray | None = None  # int64 (N,): index into Dataset.site_names (folder with --client-column)

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, idx: np.ndarray) -> Split:
        return Split(self.images[idx], self.labels[idx], self.ids[idx],
                     None if self.sites is None else self.sites[idx])


@dataclass
class Dataset:
    name: str
    class_names: list[str]
    train: Split
    val: Split
    test: Split
    preprocess: Preprocess
    provenance: dict[str, Any] = field(default_factory=dict)
    site_names: list[str] | None = None  # the real sites (hospitals), one federated client each (--client-column)
    open_set: np.ndarray | None = None  # uint8 test images of the class left out (--open-set-class)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def load_dataset(cfg: RunConfig) -> Dataset:
    """Load the dataset the config names, resized to the run's input size."""
    name = cfg.dataset.lower()
    if name == "digits":
        raw = _load_digits(cfg)
    elif name == "folder":
        raw = _load_folder(cfg)
    else:
        raw = _load_medmnist(name, cfg)
    splits, class_names, native_channels, provenance = raw
    open_set = None
    if cfg.open_set_class is not None:
        splits, class_names, open_set = _leave_out(splits, class_names, cfg.open_set_class)
        provenance["open_set_class"] = {"name": cfg.open_set_class, "test_images": int(len(open_set))}
    provenance["colour"] = colour_counts(splits["train"].images)  # the input domain's colour (tafl export)
    size = cfg.img_size or splits["train"].images.shape[1]
    channels = cfg.channels or native_channels
    fit = Preprocess(size=size, channels=channels, mean=(0.0,) * channels, std=(1.0,) * channels)
    for key, split in splits.items():
        split.images = _fit_images(split.images, fit)
    if open_set is not None:
        open_set = _fit_images(open_set, fit)
    # one site's rows (a Flower SuperNode's, `site`) need training rows only: a site may lack a class or a test fold
    checked = {"train": splits["train"]} if cfg.site else splits
    for key, split in checked.items():
        if len(split) == 0:
            raise DataError(f"dataset '{cfg.dataset}': the {key} split is empty")
    train = splits["train"]
    for key, split in (splits if not cfg.site else {}).items():  # every class in every split, for a whole CSV
        counts = np.bincount(split.labels, minlength=len(class_names))
        empty = [class_names[c] for c in np.flatnonzero(counts == 0)]
        if empty:
            raise DataError(f"dataset '{cfg.dataset}': class(es) {', '.join(empty)} have no {key} images; every class "
                            "needs images in the train, val and test splits (add images or drop the class)")
    x = train.images.astype(np.float64) / 255.0
    mean = tuple(float(v) for v in x.mean(axis=(0, 1, 2)))
    std = tuple(max(float(v), 1e-3) for v in x.std(axis=(0, 1, 2)))
    pre = Preprocess(size=size, channels=channels, mean=mean, std=std)
    return Dataset(cfg.dataset, class_names, splits["train"], splits["val"], splits["test"], pre, provenance,
                   site_names=provenance.get("site_names"), open_set=open_set)


def _leave_out(splits: dict[str, Split], class_names: list[str], name: str):
    """(splits without class `name`, labels renumbered; the other class names; the left-out class's test images)."""
    if name not in class_names:
        raise DataError(f"--open-set-class {name!r} is not a class of this dataset; its classes are "
                        f"{', '.join(class_names)}")
    if len(class_names) < 3:
        raise DataError(f"--open-set-class {name!r}: leaving a class out of {len(class_names)} leaves fewer than two "
                        "to train on")
    c = class_names.index(name)
    held = splits["test"].images[splits["test"].labels == c]
    out = {}
    for key, split in splits.items():
        keep = np.flatnonzero(split.labels != c)
        sub = split.subset(keep)
        sub.labels = np.where(sub.labels > c, sub.labels - 1, sub.labels)
        out[key] = sub
    return out, [n for n in class_names if n != name], held


COLOUR_SPREAD = 4.0  # mean spread between an image's channels (0-255) above which it is a colour image


def colour_counts(images: np.ndarray, chunk: int = 512) -> dict[str, int]:
    """How many of `images` (uint8 (N, H, W, C)) are colour and how many greyscale: an image is colour where its
    channels differ by more than COLOUR_SPREAD on average (a greyscale image stored as RGB, or a JPEG's chroma
    noise on one, stays greyscale)."""
    if images.ndim < 4 or images.shape[-1] == 1:
        return {"colour": 0, "greyscale": int(len(images))}
    n_colour = 0
    for start in range(0, len(images), chunk):
        part = images[start:start + chunk]
        spread = (part.max(axis=-1) - part.min(axis=-1)).reshape(len(part), -1).mean(axis=1)
        n_colour += int((spread > COLOUR_SPREAD).sum())
    return {"colour": n_colour, "greyscale": int(len(images)) - n_colour}


def _fit_images(images: np.ndarray, pre: Preprocess) -> np.ndarray:
    if images.ndim == 3:
        images = images[..., None]
    if images.shape[1:] == (pre.size, pre.size, pre.channels):
        return np.ascontiguousarray(images)
    out = np.empty((len(images), pre.size, pre.size, pre.channels), np.uint8)
    for i, im in enumerate(images):
        out[i] = pre.to_uint8(im)
    return out


# ---------------------------------------------------------------- digits
def digits_u8(images: np.ndarray) -> np.ndarray:
    """scikit-learn's digits (0-16) as uint8 images (0-255): the training data and the far-out-of-domain set alike."""
    return np.round(images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)


def _load_digits(cfg: RunConfig):
    from sklearn.datasets import load_digits

    d = load_digits()
    images = digits_u8(d.images)  # (1797, 8, 8)
    labels = d.target.astype(np.int64)
    ids = np.arange(len(labels))
    splits = _split(images, labels, ids, None, cfg)
    prov = {"source": "sklearn.datasets.load_digits", "n_images": int(len(labels))}
    return splits, [str(i) for i in range(10)], 1, prov


# ---------------------------------------------------------------- MedMNIST
def _load_medmnist(flag: str, cfg: RunConfig):
    import medmnist

    info = medmnist.INFO.get(flag)
    if info is None:
        flags = sorted(k for k in medmnist.INFO if not k.endswith("3d"))
        raise DataError(f"unknown dataset '{flag}': use digits, folder, or a MedMNIST flag ({', '.join(flags)})")
    if flag.endswith("3d"):
        raise DataError(f"'{flag}' is a 3D MedMNIST set; tafl trains 2D image classifiers")
    if "multi-label" in info["task"]:
        raise DataError(f"'{flag}' is a multi-label task ({info['task']}); tafl trains single-label classifiers")
    root = Path(cfg.data_root).expanduser() if cfg.data_root else Path(medmnist.info.DEFAULT_ROOT)
    npz = root / f"{flag}.npz"
    if not npz.is_file():
        if not cfg.download:
            raise DataError(f"{npz} not found: put {flag}.npz in --data-root, or pass --download where a network is "
                            "available")
        root.mkdir(parents=True, exist_ok=True)
    cls = getattr(medmnist, info["python_class"])
    splits = {}
    try:
        for split in ("train", "val", "test"):
            ds = cls(split=split, root=str(root), download=cfg.download and not npz.is_file())
            labels = np.asarray(ds.labels).reshape(-1).astype(np.int64)
            splits[split] = Split(np.asarray(ds.imgs), labels, np.arange(len(labels)))
    except DataError:
        raise
    except Exception as exc:  # medmnist raises RuntimeError/URLError/zip errors; name the file either way
        raise DataError(f"could not load MedMNIST '{flag}' from {root} ({type(exc).__name__}: {exc}); "
                        f"check that {npz.name} is a complete MedMNIST npz or that the network is reachable") from exc
    names = [info["label"][str(i)] for i in range(len(info["label"]))]
    channels = int(info["n_channels"])
    prov = {"source": f"medmnist:{flag}", "file": str(npz), "sha256": sha256_file(npz),
            "medmnist_version": getattr(medmnist, "__version__", "unknown")}
    return splits, names, channels, prov


# ---------------------------------------------------------------- image folder + CSV
def _csv_path(cfg: RunConfig) -> tuple[Path, Path]:
    root = Path(cfg.data_root).expanduser()
    if not root.is_dir():
        raise DataError(f"--data-root {root} is not a folder")
    csv_path = Path(cfg.labels)
    if not csv_path.is_absolute():
        csv_path = root / csv_path if (root / csv_path).is_file() else csv_path
    if not csv_path.is_file():
        raise DataError(f"labels CSV not found: {cfg.labels} (looked in {root} and the working folder)")
    return root, csv_path


def folder_site_names(cfg: RunConfig) -> list[str]:
    """The sites --client-column names (sorted), from the labels CSV alone: how many clients a run will have
    before its images are read (Flower starts one SuperNode per site)."""
    root, csv_path = _csv_path(cfg)
    names, _ = _sites(csv_path, [r[3] for r in _read_csv(csv_path, cfg)], cfg)
    return names or []


def _load_folder(cfg: RunConfig):
    root, csv_path = _csv_path(cfg)
    image_dir = Path(cfg.image_dir) if cfg.image_dir else (root / "images" if (root / "images").is_dir() else root)
    if not image_dir.is_absolute() and cfg.image_dir:
        image_dir = root / image_dir
    rows = _read_csv(csv_path, cfg)
    class_names = sorted({r[1] for r in rows})  # the whole CSV's classes, also where one site's rows are read
    if len(class_names) < 2:
        raise DataError(f"{csv_path}: column '{cfg.label_column}' holds {len(class_names)} class(es); need at least 2")
    site_names, sites = _sites(csv_path, [r[3] for r in rows], cfg)
    if cfg.site is not None:  # one site's rows only (a Flower SuperNode's own data)
        if cfg.site not in site_names:
            raise DataError(f"{csv_path}: column '{cfg.client_column}' has no site {cfg.site!r} (sites: "
                            f"{', '.join(site_names)})")
        mine = sites == site_names.index(cfg.site)
        rows, sites = [r for r, m in zip(rows, mine) if m], sites[mine]
    ids = np.array([r[0] for r in rows])
    label_names = [r[1] for r in rows]
    groups = np.array([r[2] for r in rows]) if cfg.group_column else None
    folds = _folds(csv_path, [r[4] for r in rows], cfg)
    index = {n: i for i, n in enumerate(class_names)}
    labels = np.array([index[n] for n in label_names], np.int64)
    files = _resolve_files(image_dir, ids)

    csv_sha = sha256_file(csv_path)
    side = cfg.img_size or 64
    channels = cfg.channels or 3
    cache = _cache_path(cfg, f"{csv_sha}:{image_dir.resolve()}:{side}:{channels}:{cfg.folder_frames}:{DECODER_VERSION}"
                             ":headers"
                             + (f":site={cfg.site}" if cfg.site is not None else ""))
    if cache is not None and cache.is_file():
        with np.load(cache) as z:
            images, rows, headers = z["images"], z["rows"], json.loads(str(z["headers"]))
        log.info("loaded %d decoded images from cache %s", len(images), cache)
    else:
        images, rows, headers = read_folder_images(files, side, channels, cfg.folder_frames)
        if cache is not None:
            write_cache(cache, images=images, rows=rows, headers=np.array(json.dumps(headers)))
    if len(rows) != len(ids):  # multi-frame files: one sample per frame, all frames of a file in one split
        per_file = np.bincount(rows, minlength=len(ids))
        frame_no = np.concatenate([np.arange(n) for n in per_file])
        if groups is None:
            groups = ids.copy()
        ids = np.array([f"{ids[r]}#{k}" if per_file[r] > 1 else ids[r] for r, k in zip(rows, frame_no)])
        labels, groups = labels[rows], groups[rows]
        sites = None if sites is None else sites[rows]
        folds = None if folds is None else folds[rows]
    if folds is not None:
        splits = _split_by_column(images, labels, ids, groups, sites, folds, cfg)
    else:
        splits = _split(images, labels, ids, groups, cfg, sites)
    prov = {"source": "folder", "labels_csv": str(csv_path), "sha256": csv_sha, "image_dir": str(image_dir),
            "n_images": int(len(ids))}
    if headers["files"]:
        prov["dicom"] = headers
    if site_names is not None:
        prov.update(client_column=cfg.client_column, site_names=site_names)
    if cfg.site is not None:
        prov["site"] = cfg.site
    if folds is not None:
        prov["split_column"] = cfg.split_column
    return splits, class_names, channels, prov


def _sites(path: Path, values: list[str], cfg: RunConfig) -> tuple[list[str] | None, np.ndarray | None]:
    """--client-column: the sorted site names and each row's site index. One site is no federation."""
    if not cfg.client_column:
        return None, None
    names = sorted(set(values))
    if len(names) < 2:
        raise DataError(f"{path}: column '{cfg.client_column}' holds one value ({names[0]!r}), so --client-column "
                        "would make a single client; federated training needs at least two sites")
    index = {n: i for i, n in enumerate(names)}
    return names, np.array([index[v] for v in values], np.int64)


SPLIT_VALUES = {"train": "train", "test": "test", "val": "val", "valid": "val", "validation": "val"}


def _folds(path: Path, values: list[str], cfg: RunConfig) -> np.ndarray | None:
    """--split-column: each row's split (train, val or test), read from the column; other values are errors."""
    if not cfg.split_column:
        return None
    folds = [SPLIT_VALUES.get(v.lower()) for v in values]
    unknown = sorted({v for v, f in zip(values, folds) if f is None})
    if unknown:
        raise DataError(f"{path}: column '{cfg.split_column}' holds {', '.join(map(repr, unknown[:5]))}; each row must "
                        f"be one of train, val or test")
    need = ("train",) if cfg.site is not None else ("train", "test")  # one site may hold no test rows
    if any(f not in folds for f in need):
        missing = next(f for f in need if f not in folds)
        raise DataError(f"{path}: column '{cfg.split_column}' names no {missing} rows")
    return np.array(folds)


def read_folder_images(files: list[Path], side: int, channels: int, frames: str = "each"
                       ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Every file through the service's decoder and the shared preprocessing: uint8 (N, side, side, channels);
    per sample, the index of the file it came from (a multi-frame DICOM gives several); and what the DICOM files'
    headers say, counted per value: {"files": n, "modalities": {...}, "sop_classes": {...}, "photometric": {...}}
    (the input domain a package records, tafl.packaging.metadata.InputDomain)."""
    pre = Preprocess(size=side, channels=channels, mean=(0.0,) * channels, std=(1.0,) * channels)
    images, rows = [], []
    headers: dict[str, Any] = {"files": 0, "modalities": {}, "sop_classes": {}, "photometric": {}}
    for i, f in enumerate(files):
        decoded = decode_file(f, frames=frames)
        if decoded.kind == "dicom":
            headers["files"] += 1
            for key, fact in (("modalities", "modality"), ("sop_classes", "sop_class"), ("photometric", "photometric")):
                value = decoded.info.get(fact)
                if value:
                    headers[key][value] = headers[key].get(value, 0) + 1
        for frame in decoded.frames:
            images.append(pre.to_uint8(frame))
            rows.append(i)
    out = np.stack(images) if images else np.empty((0, side, side, channels), np.uint8)
    return out, np.asarray(rows, np.int64), headers


def _read_csv(path: Path, cfg: RunConfig) -> list[tuple[str, str, str, str, str]]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            for col in (cfg.image_column, cfg.label_column, cfg.group_column, cfg.client_column, cfg.split_column):
                if col and col not in header:
                    raise DataError(f"{path}: no column '{col}' (columns: {', '.join(header)})")
            rows = []
            for line, r in enumerate(reader, start=2):
                img, lab = (r.get(cfg.image_column) or "").strip(), (r.get(cfg.label_column) or "").strip()
                if not img or not lab:
                    raise DataError(f"{path}:{line}: empty '{cfg.image_column}' or '{cfg.label_column}'")
                grp = (r.get(cfg.group_column) or img).strip() if cfg.group_column else ""
                site, fold = ((r.get(c) or "").strip() if c else "" for c in (cfg.client_column, cfg.split_column))
                for col, val in ((cfg.client_column, site), (cfg.split_column, fold)):
                    if col and not val:
                        raise DataError(f"{path}:{line}: empty '{col}'")
                rows.append((img, lab, grp, site, fold))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not a UTF-8 text CSV ({exc})") from exc
    except csv.Error as exc:
        raise DataError(f"{path}: malformed CSV ({exc})") from exc
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _resolve_files(image_dir: Path, ids: np.ndarray) -> list[Path]:
    if not image_dir.is_dir():
        raise DataError(f"image folder not found: {image_dir}")
    by_stem: dict[str, Path] = {}
    by_name: dict[str, Path] = {}
    for entry in os.scandir(image_dir):
        if entry.is_file():
            p = Path(entry.path)
            by_name[p.name] = p
            if p.suffix.lower() in IMAGE_EXTENSIONS:
                by_stem.setdefault(p.stem, p)
    files, missing = [], []
    for i in ids:
        f = by_name.get(i) or by_stem.get(i)
        if f is None:
            missing.append(i)
        files.append(f)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise DataError(f"{len(missing)} image(s) named in the labels CSV are missing from {image_dir}: {shown}")
    return files


def write_cache(cache: Path, **arrays: np.ndarray) -> bool:
    """Write decoded images to the cache atomically. Runs that decode the same folder at once (seeds side by
    side) each write their own temporary file and rename it over the cache; the last rename wins, with the same
    bytes. A cache that cannot be written costs a warning, never the run: the images are decoded already."""
    tmp: str | None = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f"{cache.stem}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, cache)
        return True
    except OSError as e:
        log.warning("could not write the decoded-image cache %s (%s); this run goes on without it", cache, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False


def _cache_path(cfg: RunConfig, key: str) -> Path | None:
    if cfg.cache_dir == "":
        return None
    base = Path(cfg.cache_dir or env_str("TAFL_CACHE", "~/.cache/tafl")).expanduser()
    return base / f"folder-{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"


# ---------------------------------------------------------------- splitting
def _split(images: np.ndarray, labels: np.ndarray, ids: np.ndarray, groups: np.ndarray | None,
           cfg: RunConfig, sites: np.ndarray | None = None) -> dict[str, Split]:
    """Stratified train/val/test split; with groups, no group appears in two splits."""
    idx = np.arange(len(labels))
    test_idx, rest = _holdout(idx, labels, groups, cfg.test_fraction, cfg.seed)
    val_frac = cfg.val_fraction / (1.0 - cfg.test_fraction)
    val_rel, train_rel = _holdout(np.arange(len(rest)), labels[rest], None if groups is None else groups[rest],
                                  val_frac, cfg.seed + 1)
    val_idx, train_idx = rest[val_rel], rest[train_rel]
    return _splits(images, labels, ids, sites, train_idx, val_idx, test_idx)


def _splits(images, labels, ids, sites, train_idx, val_idx, test_idx) -> dict[str, Split]:
    return {name: Split(images[i], labels[i], ids[i], None if sites is None else sites[i]) for name, i in
            (("train", np.sort(train_idx)), ("val", np.sort(val_idx)), ("test", np.sort(test_idx)))}


def _split_by_column(images: np.ndarray, labels: np.ndarray, ids: np.ndarray, groups: np.ndarray | None,
                     sites: np.ndarray | None, folds: np.ndarray, cfg: RunConfig) -> dict[str, Split]:
    """The splits a column names (--split-column). Without val rows, validation is carved from the training rows,
    each site's from its own (by group, so a lesion stays on one side) and val_fraction of them; never from test."""
    idx = np.arange(len(labels))
    test_idx, val_idx, train_idx = idx[folds == "test"], idx[folds == "val"], idx[folds == "train"]
    if len(val_idx) == 0:
        held, kept = [], []
        for site in (np.unique(sites[train_idx]) if sites is not None else [None]):
            part = train_idx if site is None else train_idx[sites[train_idx] == site]
            h, k = _holdout_or_none(part, labels[part], None if groups is None else groups[part], cfg.val_fraction,
                                    cfg.seed + 1)
            held.append(h)
            kept.append(k)
        val_idx, train_idx = np.concatenate(held), np.concatenate(kept)
    return _splits(images, labels, ids, sites, train_idx, val_idx, test_idx)


def _holdout_or_none(idx: np.ndarray, labels: np.ndarray, groups: np.ndarray | None, frac: float, seed: int):
    """`_holdout` of one site's rows; a site too small to hold any out (fewer than 2 rows, or too few groups)
    keeps them all for training."""
    try:
        if len(idx) < 2:
            raise DataError("too few rows")
        local_held, local_kept = _holdout(np.arange(len(idx)), labels, groups, frac, seed)
    except DataError:
        return idx[:0], idx
    return idx[local_held], idx[local_kept]


def _holdout(idx: np.ndarray, labels: np.ndarray, groups: np.ndarray | None, frac: float, seed: int):
    from sklearn.model_selection import StratifiedGroupKFold, train_test_split

    if groups is None:
        try:
            kept, held = train_test_split(idx, test_size=frac, stratify=labels, random_state=seed)
        except ValueError:  # a class with a single image cannot be stratified
            kept, held = train_test_split(idx, test_size=frac, random_state=seed)
        return np.asarray(held), np.asarray(kept)
    n_splits = max(2, int(round(1.0 / frac)))
    if len(np.unique(groups)) < n_splits:
        raise DataError(f"only {len(np.unique(groups))} groups: too few to hold out {frac:.0%} by group")
    sgkf = StratifiedGroupKFold(n_splits=n_splits, shuffle=True, random_state=seed)
    kept, held = next(sgkf.split(idx, labels, groups))
    return idx[held], idx[kept]


def index_hash(name: str, ids: np.ndarray, labels: np.ndarray) -> str:
    """sha256 of a training index (the sample ids and labels in order): the data's fingerprint."""
    h = hashlib.sha256(name.encode())
    h.update(np.asarray([str(i) for i in ids]).astype("U").tobytes())
    h.update(np.asarray(labels, np.int64).tobytes())
    return h.hexdigest()
