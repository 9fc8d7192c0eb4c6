"""`tafl score SRC --out OUT --package PKG --engine ray [--address auto|ray://HOST:10001] [--workers N]`.

The scoring of a folder spread over a Ray cluster with Ray Data: the paths still to score become a
Dataset, a pool of actors (each with one ONNX Runtime session of the package: CUDA when Ray gave the
actor a GPU, CPU otherwise) reads, decodes and scores them in batches with exactly the in-process
`LocalScorer` (the product's one image path, its limits and its error rows), and the driver streams the
finished rows out of the Dataset (`iter_batches`) into the results file. The driver is the only
writer, so `score_folder` keeps everything it does for the other engines: the columns, the label
rules, the prior options (adaptive re-decides from the stored posteriors at the end), resume (the
paths already in OUT are never handed to Ray; a torn last line is dropped and scored again) and the
summary. An actor whose process dies is restarted by Ray and its batch run again (Ray Data's actor
pools retry without limit); rows reach the file only when the driver receives them, so a retried
batch writes each of its rows once.

Files are read by the actors, not by a Ray Data read task: a file that cannot be read must become a
row with its error (as in-process), where `read_binary_files` fails the whole job; and the bytes then
cross no object store. The driver lists and sniffs the folder (as in-process: the summary counts the
skipped files), so SRC and PKG must be paths that every node of the cluster sees (shared storage),
and every node needs tafl installed (`pip install 'tafl[ray]'`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from tafl.clients.results import Row
from tafl.clients.scorers import LocalScorer
from tafl.errors import ConfigError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tafl[ray]'"


def import_ray():
    """`ray` with its Data library, or a ConfigError naming the extra that brings them."""
    try:
        import ray
        import ray.data  # noqa: F401 - needs pyarrow and pandas besides ray itself
    except ImportError as exc:
        raise ConfigError(f"--engine ray needs Ray Data, which is not installed here ({exc.name or exc}): "
                          f"{INSTALL_HINT}") from None
    return ray


class ScoreBatch:
    """One actor of the pool: a LocalScorer (one ORT session) that turns a batch of paths into result rows."""

    def __init__(self, package: str, batch_size: int, threads: int, ratio: list[float] | None):
        import ray

        gpu = bool(ray.get_gpu_ids())
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if gpu else ["CPUExecutionProvider"]
        self.scorer = LocalScorer(package, batch_size, threads=threads,
                                  ratio=None if ratio is None else np.asarray(ratio, np.float64), providers=providers)
        self.providers = self.scorer.session.get_providers()
        log.info("tafl score actor pid %d: %s", os.getpid(), self.providers)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rels = [str(r) for r in batch["rel"]]
        paths = [Path(str(p)) for p in batch["path"]]
        by_path = dict(zip(paths, rels))
        rows = [json.dumps(dataclasses.asdict(row)) for row in self.scorer.score(paths, by_path.__getitem__)]
        return {"row": np.array(rows, dtype=object)}


class RayScorer:
    """The `scorer` of `score_folder` for --engine ray: `score(paths, rel)` yields Rows as the cluster finishes them
    (in no fixed order). Ray starts at the first `score` (connecting to `address`, or to the instance this process
    already has, or starting a local one that `close` stops)."""

    def __init__(self, package: str, batch_size: int, *, address: str | None = None, workers: int | None = None,
                 gpus_per_worker: float = 0.0, ratio: np.ndarray | None = None):
        from tafl.packaging import load_package

        import_ray()  # fail before anything is read or written when the extra is missing
        if workers is not None and workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {workers}")
        pkg = load_package(package)  # verified here once, and again in every actor
        pkg.release_model_bytes()
        self.meta = pkg.meta
        self.package = str(Path(package).resolve())
        self.batch_size = max(1, batch_size)
        self.address, self.workers, self.gpus_per_worker = address, workers, gpus_per_worker
        self.ratio = ratio
        self._owns_ray = False

    def _start(self):
        ray = import_ray()
        # Ray's tip that a later Ray will stop hiding the GPUs from actors that asked for none (ScoreBatch picks
        # its provider from the GPUs Ray gave it, so either way is right)
        warnings.filterwarnings("ignore", message=".*RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO.*", category=FutureWarning)
        if not ray.is_initialized():
            kw: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
            if self.address:
                ray.init(address=self.address, **kw)
            else:  # "local": a new instance for this job, never one that `ray start` left running
                ray.init(address="local", include_dashboard=False, **kw)
            self._owns_ray = True
        ctx = ray.data.DataContext.get_current()
        logging.getLogger("ray.data").setLevel(logging.ERROR)  # its tips about progress bars and memory shares
        ctx.enable_progress_bars = False  # score_folder draws its own
        ctx.print_on_execution_start = False
        return ray

    def score(self, paths: list[Path], rel: Callable[[Path], str]) -> Iterator[Row]:
        if not paths:
            return
        ray = self._start()
        res = ray.cluster_resources()
        # default: one actor per CPU, or as many as the cluster's GPUs hold at --gpus-per-worker each
        fit = res.get("GPU", 0) / self.gpus_per_worker if self.gpus_per_worker else res.get("CPU", 1)
        workers = self.workers or max(1, int(fit))
        items = [{"path": os.path.abspath(p), "rel": rel(p)} for p in paths]
        # enough blocks that every actor has work and a dead actor's retry is small; few enough to stay cheap
        blocks = max(1, min(len(items), max(4 * workers, len(items) // 512)))
        # an actor call takes several ORT batches (of the in-process size): Ray's cost per call is then paid
        # once per 64 or more images (2,000 HAM10000 JPEGs here: 16 a call 271 img/s, 64 a call 341 img/s)
        per_call = self.batch_size * max(1, 64 // self.batch_size)
        ds = ray.data.from_items(items, override_num_blocks=blocks)
        ds = ds.map_batches(
            ScoreBatch, batch_size=per_call, batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1, num_gpus=self.gpus_per_worker or None,
            fn_constructor_kwargs={"package": self.package, "batch_size": self.batch_size, "threads": 1,
                                   "ratio": None if self.ratio is None else [float(v) for v in self.ratio]})
        seen: set[str] = set()
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for text in batch["row"]:
                row = Row(**json.loads(text))
                if row.path in seen:  # a retried batch whose first output also arrived: keep one row per input
                    log.warning("dropped a second row for %s (a retried batch)", row.path)
                    continue
                seen.add(row.path)
                yield row

    def close(self) -> None:
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False
