"""Batch scoring of an image folder: `tafl score FOLDER --out results.csv|.jsonl (--url URL | --package PKG)`.

The folder is walked recursively; DICOM (by its "DICM" marker or a .dcm name), PNG and JPEG (by
their magic bytes) are scored, anything else is listed as skipped (tafl.clients.results). Remote scoring keeps a
bounded number of requests in flight through the retrying `Client`; in-process scoring decodes
with the service's own decoder and runs the package in ONNX Runtime in batches, so both give
the same labels (tafl.clients.scorers). Each result is one line of the results file, valid at every instant;
`--resume` continues it. The summary compares the predicted class mix with the training mix (tafl.clients.job,
which a PACS's job, tafl.clients.dicomweb, shares).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, Callable

from tafl.clients.job import (JobPrior, Tally, decided_prior, make_scorer, open_results, print_summary, summarise,
                              with_graph_prior)
from tafl.clients.results import ResultsFile, Row, csv_cell, csv_uncell, sniff, walk
from tafl.clients.scorers import LocalScorer, RemoteScorer
from tafl.errors import ConfigError, DataError

__all__ = ["LocalScorer", "RemoteScorer", "ResultsFile", "Row", "csv_cell", "csv_uncell", "print_summary",
           "score_folder", "sniff", "walk"]


def score_folder(folder: str | Path, out: str | Path, *, url: str | None = None, package: str | None = None,
                 token: str | None = None, model: str | None = None, concurrency: int = 4, batch_size: int = 16,
                 resume: bool = False, force: bool = False, progress: bool | None = None,
                 on_row: Callable[[Row], None] | None = None, prior: str = "train", engine: str = "local",
                 address: str | None = None, workers: int | None = None, gpus_per_worker: float = 0.0,
                 dicom_out: str | Path | None = None, dicom_heatmap: bool = False,
                 sr_processes: int | None = 0, site_mix: str | None = None,
                 prior_adaptive: str | None = None, not_assessed_sr: bool = False) -> dict[str, Any]:
    """`engine`: local (this process) or ray (tafl.clients.ray_engine: a pool of `workers` actors on the Ray cluster
    at `address`, or on a local instance started for the job, each with `gpus_per_worker` GPUs; needs --package).
    `prior`: train (the model's own rule); adaptive (each row keeps its calibrated posteriors; at the end the
    folder's class mix is estimated from all of them and every row is re-decided for it, without a second
    inference: the file gains adaptive_label and adaptive_class_name); or comma-separated class probabilities
    (the graph decides for that prior). `site_mix`: with adaptive, this site's own class counts
    (tafl.prior.parse_site_mix), the centre of a model whose estimator is centred on the site's mix.
    `sr_processes`: processes that build the --dicom-out SRs while this one scores (None: min(2, cores) for 16
    inputs or more, as `tafl score` does; 0: built here). They are spawned, so a script that passes one must
    start its work under `if __name__ == "__main__":`. `prior_adaptive`: TAFL_PRIOR_ADAPTIVE's mode for --prior
    adaptive (None: read from the environment)."""
    folder, out = Path(folder), Path(out)
    if (url is None) == (package is None):
        raise ConfigError("give exactly one of --url URL (remote scoring) or --package PKG_DIR (in-process)")
    job = JobPrior.read(prior, site_mix, prior_adaptive)
    _check_engine(engine, url, address, workers, gpus_per_worker, dicom_out)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder")
    images, skipped = walk(folder)
    if not images:
        raise DataError(f"{folder} holds no DICOM, PNG or JPEG files ({len(skipped)} other file(s) skipped)")
    if engine == "ray":
        from tafl.clients.ray_engine import RayScorer

        scorer: Any = with_graph_prior(RayScorer(package, batch_size, address=address, workers=workers,
                                                 gpus_per_worker=gpus_per_worker), job)
    else:
        scorer = make_scorer(url, package, token, model, concurrency, batch_size, job)
    explicit = decided_prior(scorer, job)
    results = open_results(out, scorer, job, resume=resume, force=force)

    def rel(p: Path) -> str:
        return p.relative_to(folder).as_posix()

    todo = [p for p in images if rel(p) not in results.done]
    dicom = None
    if dicom_out is not None:  # SR (+ heatmap SC) per DICOM input, written before its row: tafl.clients.dicom_out
        from tafl.clients.dicom_out import DicomWriter, processes_for

        procs = processes_for(len(todo)) if sr_processes is None else sr_processes
        dicom = DicomWriter(dicom_out, folder, scorer, heatmap=dicom_heatmap, processes=procs,
                            not_assessed=not_assessed_sr)
    tally = Tally(dict(results.done_counts))  # the class mix of the whole file, earlier rows too
    try:
        _score_rows(scorer, todo, rel, results, dicom, tally, total=len(images), progress=progress, on_row=on_row)
    finally:
        results.close()
        scorer.close()
        if dicom is not None:
            dicom.close()
    summary = summarise(scorer.meta, tally, out, images=len(images), todo=len(todo),
                        skipped=[rel(p) for p in skipped], explicit=explicit, job=job)
    if dicom is not None:
        summary.update(dicom_written=dicom.written, dicom_failed=dicom.failed)
    return summary


def _check_engine(engine: str, url: str | None, address: str | None, workers: int | None, gpus_per_worker: float,
                  dicom_out: Any) -> None:
    """--engine and the options that go with it."""
    if engine not in ("local", "ray"):
        raise ConfigError(f"--engine must be local or ray, got {engine!r}")
    if engine == "ray" and url:
        raise ConfigError("--engine ray runs the package on the cluster: give --package PKG_DIR, not --url")
    if engine == "local" and (address or workers or gpus_per_worker):
        raise ConfigError("--address, --workers and --gpus-per-worker go with --engine ray")
    if engine == "ray" and dicom_out is not None:
        raise ConfigError("--dicom-out is not supported with --engine ray yet (the SRs are written by the scoring "
                          "process); score with the local engine or --url")


def _score_rows(scorer: Any, todo: list[Path], rel: Callable[[Path], str], results: ResultsFile, dicom: Any,
                tally: Tally, *, total: int, progress: bool | None, on_row: Callable[[Row], None] | None) -> None:
    """Score `todo` and append each row to `results`, in order; with --dicom-out a row is written after its SR (so
    --resume never skips an input without one), the SRs made while the next inputs are scored."""
    from tqdm.auto import tqdm

    with tqdm(total=total, initial=total - len(todo), unit="img", desc="scoring",
              disable=(not progress) if progress is not None else None, dynamic_ncols=True) as bar:
        def emit(row: Row) -> None:
            results.write(row)
            tally.add(row, predicted=not row.error)
            if on_row:
                on_row(row)
            bar.update(1)

        making: collections.deque = collections.deque()
        for row in scorer.score(todo, rel):
            if dicom is None:
                emit(row)
                continue
            making.append((row, dicom.start(row)))
            while making and (len(making) > dicom.window or making[0][1] is None or making[0][1].done()):
                done, made = making.popleft()
                dicom.finish(done, made)
                emit(done)
        while making:
            done, made = making.popleft()
            dicom.finish(done, made)
            emit(done)
