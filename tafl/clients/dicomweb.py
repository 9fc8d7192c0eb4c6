"""`tafl score --dicomweb URL`: score what a PACS holds and file the results back, over DICOMweb.

    QIDO-RS (--study UID ..., or --since YYYY-MM-DD / --modality XX) -> the image instances, sorted
    WADO-RS, `concurrency` in flight, the next batch fetched while this one is scored
      -> scored in-process (--package) or through the service (--url): the folder job's scorers, so the rows,
         the 4xx reasons and --prior are the same
      -> with --store-sr: the batch's SRs (and heatmap SCs with --dicom-heatmap) in one STOW-RS
      -> the rows appended to the results file (tafl.clients.score.ResultsFile), one line each

A row is written only after its SR was filed (or refused), so a kill at any point loses nothing: `--resume` skips
every instance already in the file and fetches it no more. An SR filed just before a kill is filed again after
`--resume` under the same SOP Instance UID (tafl.imaging.dicom_sr derives it from the source instance and the
model), which a PACS keeps once. Rows are keyed `STUDY/SERIES/SOP` (the UIDs, no patient data).

Failures: a PACS that does not answer at the start stops the job with a clear message before anything is fetched;
a PACS gone mid-run (no answer, 5xx, 429) is retried with exponential backoff, then the job stops, resumable; a
STOW-RS refused (4xx, or instances in the answer's Failed SOP Sequence) marks those rows (`error: SR not stored:
...`) and the job goes on; non-image instances (SR, presentation states, key objects, ...: by SOP class in the
QIDO answer, or no pixel data once fetched) and tafl's own SRs and heatmap captures are skipped, counted and named
in the summary (by SOP class: "not an image instance (Comprehensive SR Storage, 1.2.840.10008.5.1.4.1.1.88.33)");
an instance the decoder refuses (over the service's size limits, corrupt) gets a row with its 4xx reason; one whose
geometry in the QIDO answer is over the decoder's limits is not fetched at all (in-process; through --url the
service's own limits decide). Whatever QIDO declares, a WADO-RS answer is streamed into the spool and read no
further than the upload limit (TAFL_MAX_UPLOAD_MB, default 50 MiB: the service refuses a larger file anyway, and it
is the in-process decoder's own default) and its multipart framing: past it the row is a 413 and the job goes on.

--since asks QIDO for a StudyDate range, which no study without a StudyDate matches (DICOM range matching; an empty
key would match every study, not the empty ones). So the job asks once more without the date (the same --modality;
study level: no instance is listed), and the summary says how many studies have no StudyDate and names them for
`--study UID`. That query stops after UNDATED_SCAN studies (20 QIDO pages) and then says "at least": an archive of
millions is not paged through to count its undated studies.

Authentication never goes on the command line: TAFL_DICOMWEB_TOKEN (a bearer token) or TAFL_DICOMWEB_USER and
TAFL_DICOMWEB_PASSWORD (basic auth), from the environment.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import hashlib
import io
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

from tafl.clients.job import JobPrior, Tally, decided_prior, make_scorer, open_results, summarise, undated_line
from tafl.clients.results import Row
from tafl.errors import ConfigError, DataError, TaflError
from tafl.imaging import dicom_sr
from tafl.settings import dicomweb_credentials

log = logging.getLogger(__name__)

ENV_TOKEN, ENV_USER, ENV_PASSWORD = "TAFL_DICOMWEB_TOKEN", "TAFL_DICOMWEB_USER", "TAFL_DICOMWEB_PASSWORD"
RETRIABLE = {408, 425, 429, 500, 502, 503, 504}
MULTIPART_SLACK = 64 * 2**10  # a WADO-RS answer's delimiters and part headers, over the instance's own bytes
UNDATED_SCAN = 10_000  # studies listed, at most, to count those without a StudyDate (--since): 20 QIDO pages


class PacsUnavailable(TaflError):
    """The DICOMweb server did not answer (or kept answering 5xx) through every retry."""

    status = 503


class TooLarge(TaflError):
    """A WADO-RS answer past the upload limit: its row is a 413, and the job goes on."""

    status = 413


class PacsRefused(TaflError):
    """The DICOMweb server answered a request with a 4xx."""

    status = 400

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, order=True)
class InstanceRef:
    study: str
    series: str
    sop: str
    sop_class: str = ""
    modality: str = ""
    rows: int = 0  # as QIDO declares them (0: not given); checked against the decoder's limits before a fetch
    columns: int = 0
    frames: int = 1
    ours: bool = False  # made by tafl (Manufacturer): its own SR or heatmap capture, never scored

    @property
    def key(self) -> str:
        return f"{self.study}/{self.series}/{self.sop}"


def _value(rec: dict[str, Any], tag: str) -> str:
    v = (rec.get(tag) or {}).get("Value") or [""]
    return str(v[0])


def _int(text: str) -> int:
    try:
        return max(int(float(text)), 0)
    except ValueError:
        return 0


def oversized(ref: InstanceRef) -> str | None:
    """The decoder's 413, from the geometry QIDO declares, so that an instance it would refuse is not fetched at
    all (what bounds the fetch itself is the upload limit: Pacs.fetch)."""
    from tafl.imaging.decode import DEFAULT_MAX_FRAMES, DEFAULT_MAX_PIXELS

    if ref.frames > DEFAULT_MAX_FRAMES:
        return (f"413 PayloadTooLarge: the instance declares {ref.frames} frames, over the {DEFAULT_MAX_FRAMES}-frame "
                "limit (not fetched)")
    if ref.rows * ref.columns * ref.frames > DEFAULT_MAX_PIXELS:
        return (f"413 PayloadTooLarge: the instance declares {ref.frames} frame(s) of {ref.columns}×{ref.rows} "
                f"pixels, over the {DEFAULT_MAX_PIXELS:,}-pixel limit (not fetched)")
    return None


def sop_class_named(uid: str) -> str:
    """"Comprehensive SR Storage, 1.2.840.10008.5.1.4.1.1.88.33": the SOP class's name (pydicom's UID dictionary)
    and UID, the UID alone where the dictionary has no name for it."""
    if not uid:
        return "no SOP Class UID given"
    from pydicom.uid import UID

    name = UID(uid).name
    return f"{name}, {uid}" if name and name != uid else uid


def skip_reason(ref: InstanceRef, sop_class: str | None = None, *, no_pixels: bool = False) -> str:
    """Why an instance was not scored, for the summary: what it is, by SOP class (`sop_class`: the fetched
    instance's own, where QIDO gave none)."""
    named = sop_class_named(sop_class if sop_class is not None else ref.sop_class)
    if ref.ours:
        return f"tafl's own result ({named})"
    return f"not an image instance, no pixel data ({named})" if no_pixels else f"not an image instance ({named})"


def session_from_env():
    """A requests session with the environment's credentials (none when neither is set)."""
    import requests

    s = requests.Session()
    token, user, password = dicomweb_credentials()
    if token and user:
        raise ConfigError(f"set either {ENV_TOKEN} or {ENV_USER}/{ENV_PASSWORD}, not both")
    if token:
        s.headers["Authorization"] = f"Bearer {token}"
    elif user or password:
        if not (user and password):
            raise ConfigError(f"basic auth needs both {ENV_USER} and {ENV_PASSWORD}")
        s.auth = (user, password)
    return s


class Pacs:
    """A DICOMweb server through dicomweb-client: every call retried with exponential backoff on no answer, 5xx
    and 429 (`retries` times), a 4xx raised at once as PacsRefused."""

    def __init__(self, url: str, *, retries: int = 5, backoff: float = 0.5, timeout: float = 60.0):
        from dicomweb_client.api import DICOMwebClient

        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--dicomweb {url!r}: give the server's DICOMweb base URL, e.g. "
                              "http://pacs:8042/dicom-web")
        self.url, self.retries, self.backoff = url.rstrip("/"), retries, backoff
        self.session, self.timeout = session_from_env(), timeout
        self.client = DICOMwebClient(self.url, session=self.session, timeout=timeout)  # QIDO-RS
        self.client.set_http_retry_params(retry=False)  # ours below also covers refused connections

    def call(self, what: str, fn: Callable[[], Any], retries: int | None = None) -> Any:
        import requests

        tries = (self.retries if retries is None else retries) + 1
        last = ""
        for attempt in range(tries):
            try:
                return fn()
            except requests.HTTPError as exc:
                code = exc.response.status_code if exc.response is not None else 0
                detail = (exc.response.text if exc.response is not None else "")[:200].strip()
                if code in (401, 403) and what != "STOW-RS":
                    raise ConfigError(f"{self.url} refused {what} with {code}: check the credentials in "
                                      f"{ENV_TOKEN} or {ENV_USER}/{ENV_PASSWORD}") from None
                if code not in RETRIABLE:
                    raise PacsRefused(f"{what} refused: {code} {detail}".strip(), code) from None
                last = f"{code} {detail}".strip()
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                    ConnectionError) as exc:  # ChunkedEncodingError: the connection dropped mid-answer
                last = type(exc).__name__
            if attempt + 1 < tries:
                time.sleep(min(self.backoff * 2 ** attempt, 15.0))
        raise PacsUnavailable(f"the DICOMweb server at {self.url} did not answer {what} after {tries} attempt(s) "
                              f"({last})")

    # ------------------------------------------------------------------ QIDO, WADO, STOW
    def find(self, studies: list[str], since: str | None, modality: str | None,
             workers: int = 1) -> tuple[list[InstanceRef], list[InstanceRef]]:
        """(image instances, non-image instances), each sorted, for the studies given or matching the filters; the
        studies' instances asked for `workers` at a time (one QIDO-RS a study)."""
        if not studies:
            filters: dict[str, Any] = {}
            if since:
                filters["StudyDate"] = f"{since.replace('-', '')}-"
            if modality:
                filters["ModalitiesInStudy"] = modality
            found = self.pages("QIDO-RS (studies)", lambda **kw: self.client.search_for_studies(
                search_filters=filters, **kw), "0020000D", retries=min(self.retries, 2))
            studies = sorted({_value(r, "0020000D") for r in found} - {""})
        else:
            self.call("QIDO-RS (studies)", lambda: self.client.search_for_studies(limit=1),
                      retries=min(self.retries, 2))  # the server answers at all: fail fast if not
        images, others = [], []

        def instances_of(study: str) -> list[dict[str, Any]]:
            return self.pages("QIDO-RS (instances)", lambda **kw: self.client.search_for_instances(
                study_instance_uid=study, fields=["00080060", "00080070", "00280008", "00280010", "00280011"], **kw),
                "00080018")

        with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(studies)))) as pool:
            found_per_study = list(pool.map(instances_of, studies))
        for study, recs in zip(studies, found_per_study):
            for r in recs:
                ref = InstanceRef(study, _value(r, "0020000E"), _value(r, "00080018"), _value(r, "00080016"),
                                  _value(r, "00080060"), _int(_value(r, "00280010")), _int(_value(r, "00280011")),
                                  max(_int(_value(r, "00280008")), 1))
                if not ref.series or not ref.sop or (modality and ref.modality != modality):
                    continue  # with --modality, an instance that states none is not that modality
                if _value(r, "00080070") == dicom_sr.MANUFACTURER:  # tafl's own SRs and heatmap captures
                    others.append(replace(ref, ours=True))
                else:
                    (others if ref.sop_class.startswith(dicom_sr.NOT_IMAGES) else images).append(ref)
        return sorted(set(images)), sorted(set(others))

    def undated(self, modality: str | None, most: int = 0) -> tuple[list[str], int]:
        """(the UIDs of the studies without a StudyDate, sorted; how many studies were looked at), among the
        studies with `modality` in them (all without): the ones a --since range cannot match. Stops once `most`
        studies (default UNDATED_SCAN) were listed."""
        filters = {"ModalitiesInStudy": modality} if modality else {}
        found = self.pages("QIDO-RS (studies, for those without a StudyDate)", lambda **kw: (
            self.client.search_for_studies(search_filters=filters, fields=["00080020"], **kw)), "0020000D",
            retries=min(self.retries, 2), most=most or UNDATED_SCAN)
        return sorted({_value(r, "0020000D") for r in found if not _value(r, "00080020")} - {""}), len(found)

    def pages(self, what: str, search: Callable[..., list], key: str, page: int = 500,
              retries: int | None = None, most: int = 0) -> list[dict[str, Any]]:
        """Every record of a QIDO search, page by page (servers cap an answer's size: dcm4chee does). Stops at a
        short page, or at a page with nothing new: Orthanc 1.10 ignores `offset` when it filters on
        ModalitiesInStudy, where dicomweb-client's own `get_remaining` would ask forever. With `most`, stops once
        that many records came (the pages hold a few more)."""
        out: dict[str, dict[str, Any]] = {}
        offset = 0
        while True:
            got = self.call(what, lambda o=offset: search(limit=page, offset=o), retries=retries)
            new = {_value(r, key): r for r in got if _value(r, key) not in out}
            out.update(new)
            if len(got) < page or not new or (most and len(out) >= most):
                return list(out.values())
            offset += len(got)

    def fetch(self, ref: InstanceRef, raw: Path, limit: int) -> bytes:
        """The instance's Part 10 bytes as stored (any transfer syntax: no transcoding by the server). The bytes, not
        a dataset: dicomweb-client's `retrieve_instance` parses each answer into a pydicom dataset, which the job
        would only write back to its spool (docs/results.md, "DICOMweb moves bytes": 1.5 ms of CPU an instance, for nothing).

        The answer is streamed into `raw` (a file in the job's spool, removed before this returns) and read no
        further than `limit` bytes (the upload limit) and its multipart framing: a server that sends more, or
        without end, costs TooLarge (a 413 row) once past it, not the job's memory."""
        study, series, sop = (quote(u, safe="") for u in (ref.study, ref.series, ref.sop))  # UIDs from the server
        url = f"{self.url}/studies/{study}/series/{series}/instances/{sop}"
        cap, mib = limit + MULTIPART_SLACK, f"{limit / 2**20:g} MiB"

        def get() -> bytes:
            with self.session.get(url, headers={"Accept": WADO_ACCEPT}, timeout=self.timeout, stream=True) as answer:
                if answer.status_code >= 400:  # call() reports the start of an error page, whatever its size
                    answer._content, answer._content_consumed = answer.raw.read(1024, decode_content=True), True
                    answer.raise_for_status()
                got = 0
                try:
                    with open(raw, "wb") as fh:
                        for chunk in answer.iter_content(256 * 2**10):
                            got += len(chunk)
                            if got > cap:
                                raise TooLarge(f"the WADO-RS answer ran past the {mib} upload limit "
                                               "(TAFL_MAX_UPLOAD_MB); not read further")
                            fh.write(chunk)
                    data = raw.read_bytes()
                finally:
                    raw.unlink(missing_ok=True)  # also the partial answer of a refusal or a dropped connection
                content_type = answer.headers.get("Content-Type", "")
            parts = multipart_parts(content_type, data)
            if len(parts) != 1:
                raise PacsRefused(f"WADO-RS answered {len(parts)} parts for one instance", 502)
            if len(parts[0]) > limit:
                raise TooLarge(f"the instance is {len(parts[0]) / 2**20:.1f} MiB, over the {mib} upload limit "
                               "(TAFL_MAX_UPLOAD_MB)")
            return parts[0]

        return self.call("WADO-RS", get)

    def store(self, parts: list[bytes]) -> set[str]:
        """STOW-RS of Part 10 files as they were written (one multipart/related request); the SOP Instance UIDs the
        server refused in its answer (raises PacsRefused on a 4xx). Bytes again, where dicomweb-client's
        `store_instances` takes datasets and encodes each anew."""
        content_type, body = multipart_body(parts)
        headers = {"Content-Type": content_type, "Accept": "application/dicom+json, application/json"}

        def post():
            answer = self.session.post(f"{self.url}/studies", data=body, headers=headers, timeout=self.timeout)
            answer.raise_for_status()
            return answer

        return refused_in(self.call("STOW-RS", post))


WADO_ACCEPT = 'multipart/related; type="application/dicom"; transfer-syntax=*'


def multipart_body(parts: list[bytes]) -> tuple[str, bytes]:
    """(Content-Type, body) of a multipart/related request of DICOM files (RFC 2387, as STOW-RS takes it)."""
    boundary = uuid.uuid4().hex
    while any(boundary.encode() in p for p in parts):  # a random 128-bit boundary inside a file: never, but it is
        boundary = uuid.uuid4().hex                  # cheap to be sure
    sep = b"--" + boundary.encode()
    body = b"".join(sep + b"\r\nContent-Type: application/dicom\r\n\r\n" + p + b"\r\n" for p in parts)
    return f'multipart/related; type="application/dicom"; boundary={boundary}', body + sep + b"--\r\n"


def multipart_parts(content_type: str, body: bytes) -> list[bytes]:
    """The bodies of a multipart/related answer (RFC 2387), in order; the whole body when the server answered a
    single part without multipart (some do for one instance)."""
    media, _, params = content_type.partition(";")
    if media.strip().lower() != "multipart/related":
        return [body]
    boundary = None
    for item in params.split(";"):
        key, _, value = item.partition("=")
        if key.strip().lower() == "boundary":
            boundary = value.strip().strip('"').encode()
    if not boundary:
        return [body]
    parts = []
    for piece in (b"\r\n" + body).split(b"\r\n--" + boundary)[1:]:  # [0]: the preamble
        if piece.startswith(b"--"):
            break  # the close delimiter; what follows is the epilogue
        line_end = piece.find(b"\r\n")  # the rest of the delimiter's line (transport padding)
        if line_end < 0:
            continue
        piece = piece[line_end + 2:]
        if piece.startswith(b"\r\n"):  # a part without headers
            parts.append(piece[2:])
            continue
        head_end = piece.find(b"\r\n\r\n")
        if head_end >= 0:  # else no blank line after the part's headers: not a part
            parts.append(piece[head_end + 4:])
    return parts


def refused_in(answer) -> set[str]:
    """The SOP Instance UIDs of a STOW-RS answer's Failed SOP Sequence (DICOM JSON, or the XML of PS3.19)."""
    if not answer.content:
        return set()
    kind = answer.headers.get("Content-Type", "").lower()
    if "xml" in kind:
        from xml.etree import ElementTree

        try:
            root = ElementTree.fromstring(answer.content)
        except ElementTree.ParseError:
            return set()  # as for JSON below
        return {v.text or "" for seq in root.iter() if seq.get("tag") == "00081198"
                for attr in seq.iter() if attr.get("tag") == "00081155" for v in attr.iter() if v.tag.endswith("Value")}
    try:
        record = answer.json()
    except ValueError:
        return set()  # an answer we cannot read says nothing was refused; the 2xx said it was stored
    if isinstance(record, list):
        record = record[0] if record else {}
    failed = ((record or {}).get("00081198") or {}).get("Value") or []
    return {_value(item, "00081155") for item in failed if isinstance(item, dict)}


def _since(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return dt.date.fromisoformat(value).isoformat()
    except ValueError:
        raise ConfigError(f"--since {value!r}: write the date as YYYY-MM-DD") from None


def _header(data: bytes):
    """The instance's data set up to its pixels' values (deferred): enough to tell an image from a non-image."""
    import pydicom

    from tafl.imaging.decode import is_dicom

    if not is_dicom(data):
        raise ValueError("no DICM marker, and it does not start as a data set does")
    return pydicom.dcmread(io.BytesIO(data), defer_size=1024, force=data[128:132] != b"DICM")


# ------------------------------------------------------------------ the job
def score_dicomweb(dicomweb: str, out: str | Path, *, url: str | None = None, package: str | None = None,
                   token: str | None = None, model: str | None = None, studies: list[str] | None = None,
                   since: str | None = None, modality: str | None = None, store_sr: bool = False,
                   heatmap: bool = False, concurrency: int = 4, batch_size: int = 16, resume: bool = False,
                   force: bool = False, progress: bool | None = None, on_row: Callable[[Any], None] | None = None,
                   prior: str = "train", retries: int = 5, backoff: float = 0.5,
                   sr_processes: int | None = 0, site_mix: str | None = None,
                   prior_adaptive: str | None = None, not_assessed_sr: bool = False) -> dict[str, Any]:
    """Score the instances QIDO finds on `dicomweb` into `out` (see the module's text); the folder job's summary,
    plus `stored_sr` (instances whose SR was filed) and `sr_refused`. `sr_processes`, `site_mix` and
    `prior_adaptive` as for tafl.clients.score.score_folder (None: min(2, cores) for 16 instances or more, as
    `tafl score` does)."""
    from tafl.clients.dicom_out import DicomWriter, processes_for
    from tafl.settings import upload_limit

    out = Path(out)
    studies = _check_options(url, package, studies, since, modality, heatmap, store_sr, concurrency, batch_size)
    job = JobPrior.read(prior, site_mix, prior_adaptive)  # a bad TAFL_PRIOR_ADAPTIVE fails before anything is fetched
    # what bounds a WADO-RS answer: the service's upload limit, which also refuses any larger file sent through --url,
    # and in-process the same 50 MiB as the decoder's own max_bytes, unless TAFL_MAX_UPLOAD_MB says otherwise
    limit = upload_limit()
    pacs = Pacs(dicomweb, retries=retries, backoff=backoff)
    images, others, undated = _find(pacs, dicomweb, studies, since, modality.upper() if modality else None,
                                    concurrency)
    scorer = make_scorer(url, package, token, model, concurrency, batch_size, job)
    explicit = decided_prior(scorer, job)
    results = open_results(out, scorer, job, resume=resume, force=force)
    todo = [r for r in images if r.key not in results.done]
    writer = None
    if store_sr:
        procs = processes_for(len(todo)) if sr_processes is None else sr_processes
        writer = DicomWriter(None, None, scorer, heatmap=heatmap, processes=procs, not_assessed=not_assessed_sr)
    tally = Tally(dict(results.done_counts))
    skipped = [r.key for r in others]
    skipped_why = {r.key: skip_reason(r) for r in others}  # what each is, for the summary
    batches = _Batches(pacs, scorer, results, writer, tally, limit=limit, in_process=package is not None,
                       concurrency=concurrency, on_row=on_row, skipped=skipped, skipped_why=skipped_why)
    from tqdm.auto import tqdm

    try:
        with tqdm(total=len(images), initial=len(images) - len(todo), unit="img", desc="scoring",
                  disable=(not progress) if progress is not None else None, dynamic_ncols=True) as bar:
            batches.run([todo[i:i + batch_size] for i in range(0, len(todo), batch_size)], bar)
    finally:
        batches.shutdown()
        results.close()
        scorer.close()
        if writer is not None:
            writer.close()
        batches.spool.cleanup()
    summary = summarise(scorer.meta, tally, out, images=len(images), todo=len(todo), skipped=skipped,
                        explicit=explicit, job=job)
    summary.update(source=pacs.url, non_image=len(skipped), skipped_why=skipped_why)
    if undated is not None:
        summary["undated_studies"] = undated
    if store_sr:
        summary.update(stored_sr=batches.stored, sr_refused=batches.refused)
    return summary


def _check_options(url: str | None, package: str | None, studies: list[str] | None, since: str | None,
                   modality: str | None, heatmap: bool, store_sr: bool, concurrency: int, batch_size: int) -> list[str]:
    """The options that go together, checked before the PACS is asked anything; the --study UIDs, stripped."""
    if (url is None) == (package is None):
        raise ConfigError("give exactly one of --url URL (score through the service) or --package PKG_DIR")
    studies = [s.strip() for s in (studies or []) if s.strip()]
    if not (studies or since or modality):
        raise ConfigError("--dicomweb needs --study UID (repeatable), --since YYYY-MM-DD or --modality XX: tafl "
                          "does not score a whole archive by accident")
    if studies and since:
        raise ConfigError("give --study UID or --since DATE, not both (--modality narrows either)")
    if heatmap and not store_sr:
        raise ConfigError("--dicom-heatmap with --dicomweb goes with --store-sr (the heatmap is filed as a "
                          "secondary capture)")
    if concurrency < 1 or batch_size < 1:
        raise ConfigError("--concurrency and --batch-size must be at least 1")
    return studies


def _find(pacs: Pacs, dicomweb: str, studies: list[str], since: str | None, modality: str | None,
          concurrency: int) -> tuple[list[InstanceRef], list[InstanceRef], dict[str, Any] | None]:
    """(image instances, non-image instances, the studies --since could not see or None); DataError naming the
    server as given (`dicomweb`) without an image instance."""
    images, others = pacs.find(studies, _since(since), modality, concurrency)
    undated = None
    if since:  # the studies a date range cannot match: counted, so that the job does not miss them in silence
        uids, looked_at = pacs.undated(modality)
        # a study whose instances disagree on its date can be listed undated and still match the range: it was found
        uids = [u for u in uids if u not in {r.study for r in images + others}]
        undated = {"count": len(uids), "uids": uids, "looked_at": looked_at, "complete": looked_at < UNDATED_SCAN}
    if not images:
        raise DataError(f"{dicomweb} holds no image instance for this query ({len(others)} non-image instance(s))"
                        + (f"; {undated_line(undated)}" if undated and undated["count"] else ""))
    return images, others, undated


class _Batches:
    """The job's instances, batch by batch: the next batch is fetched (WADO-RS, `concurrency` instances at once,
    into a spool folder) while this one is scored, and this batch's SRs are made and filed (one STOW-RS) while the
    next is scored. Rows are written in order, each after its SR was filed (or refused), so a kill loses nothing."""

    def __init__(self, pacs: Pacs, scorer: Any, results: Any, writer: Any, tally: Tally, *, limit: int,
                 in_process: bool, concurrency: int, on_row: Callable[[Any], None] | None, skipped: list[str],
                 skipped_why: dict[str, str]):
        self.pacs, self.scorer, self.results, self.writer, self.tally = pacs, scorer, results, writer, tally
        self.limit, self.in_process, self.on_row = limit, in_process, on_row
        self.skipped, self.skipped_why = skipped, skipped_why
        self.stored = self.refused = 0  # SRs filed, and refused by the PACS
        self.spool = tempfile.TemporaryDirectory(prefix="tafl-dicomweb-")
        self.fetchers = concurrent.futures.ThreadPoolExecutor(concurrency)
        self.stage = concurrent.futures.ThreadPoolExecutor(2)  # the next batch's fetch and this batch's STOW

    def run(self, chunks: list[list[InstanceRef]], bar) -> None:
        next_fetch = self.stage.submit(self.fetch, chunks[0]) if chunks else None
        filing = None
        for i in range(len(chunks)):
            fetched = next_fetch.result()
            next_fetch = self.stage.submit(self.fetch, chunks[i + 1]) if i + 1 < len(chunks) else None
            rows = self.score(fetched)
            # with processes, this batch's SRs are built while the last batch's are still being filed
            making = self.make_srs(rows) if self.writer is not None and self.writer.pool is not None else None
            if filing is not None:
                self.emit(filing.result(), bar)
            filing = self.stage.submit(self.file_and_clean, rows, making)
        if filing is not None:
            self.emit(filing.result(), bar)

    def shutdown(self) -> None:
        self.fetchers.shutdown(wait=True, cancel_futures=True)
        self.stage.shutdown(wait=True, cancel_futures=True)

    def fetch(self, chunk: list[InstanceRef]) -> list[tuple[InstanceRef, Path | None, str]]:
        """(ref, spooled file or None, why skipped) per instance; raises PacsUnavailable."""
        return list(self.fetchers.map(self.fetch_one, chunk))

    def fetch_one(self, ref: InstanceRef) -> tuple[InstanceRef, Path | None, str]:
        too_big = oversized(ref) if self.in_process else None  # through --url the service's own limits decide
        if too_big:
            return ref, None, "error:" + too_big
        path = Path(self.spool.name) / f"{hashlib.sha256(ref.key.encode()).hexdigest()}.dcm"  # not the UID: a path
        try:
            data = self.pacs.fetch(ref, path.with_suffix(".wado"), self.limit)
        except TooLarge as exc:
            return ref, None, f"error:413 PayloadTooLarge: {exc.message}"
        except PacsRefused as exc:
            return ref, None, f"error:{exc.message}"  # PacsRefused names the request (WADO-RS ...) itself
        try:
            ds = _header(data)
        except Exception as exc:  # pydicom raises many kinds on a damaged file
            return ref, None, (f"error:422 UnprocessableImage: the WADO-RS answer is not a DICOM instance "
                               f"({type(exc).__name__}: {str(exc)[:120]})")
        if str(ds.get("Manufacturer", "")) == dicom_sr.MANUFACTURER:  # a heatmap tafl filed itself
            return ref, None, "skip:" + skip_reason(replace(ref, ours=True), str(ds.get("SOPClassUID", "")))
        if not dicom_sr.is_image_object(ds):
            return ref, None, "skip:" + skip_reason(ref, str(ds.get("SOPClassUID", "")), no_pixels=True)
        path.write_bytes(data)
        return ref, path, ""

    def score(self, fetched: list[tuple[InstanceRef, Path | None, str]]) -> list[tuple[Any, Path | None]]:
        """The batch's rows, in order, each with its spooled file (None for a row that is an error)."""
        keys = {p: ref.key for ref, p, _ in fetched if p is not None}
        scored = {}
        paths = list(keys)
        if paths:
            for row in self.scorer.score(paths, lambda p: keys[p]):
                scored[row.path] = row
        out_rows = []
        for ref, path, why in fetched:
            if why.startswith("skip:"):
                self.skipped.append(ref.key)
                self.skipped_why[ref.key] = why[5:]
            elif why.startswith("error:"):
                out_rows.append((Row(ref.key, error=why[6:]), None))
            else:
                out_rows.append((scored[ref.key], path))
        return out_rows

    def make_srs(self, rows: list[tuple[Any, Path | None]]) -> dict[int, Any]:
        """Start building the batch's SRs (side by side in the writer's processes, when it has them)."""
        return {i: self.writer.submit(path.read_bytes(), row) for i, (row, path) in enumerate(rows)
                if self.writer.wants(row) and path is not None}

    def file(self, rows: list[tuple[Any, Path | None]], making: dict[int, Any] | None) -> list[Any]:
        """STOW the batch's SRs (one request), then mark what was refused; the rows, in order."""
        if self.writer is None:
            return [r for r, _ in rows]
        making = self.make_srs(rows) if making is None else making
        objects: dict[int, list[bytes]] = {}
        for i, made in making.items():
            try:
                objects[i] = made.result()
            except TaflError as exc:
                rows[i][0].error = f"SR not made: {exc.message}"
        if objects:
            uids = {i: [dicom_sr.sop_instance_uid(b) for b in parts] for i, parts in objects.items()}
            try:
                refused = self.pacs.store([b for parts in objects.values() for b in parts])
                why = "refused in the STOW-RS answer"
            except PacsRefused as exc:
                refused = {u for us in uids.values() for u in us}
                why = exc.message
            for i in objects:
                row = rows[i][0]
                if any(u in refused for u in uids[i]):
                    row.error = f"SR not stored: {why}"
                    self.refused += 1
                else:
                    self.stored += 1
        return [r for r, _ in rows]

    def file_and_clean(self, rows: list[tuple[Any, Path | None]], making: dict[int, Any] | None) -> list[Any]:
        try:
            return self.file(rows, making)
        finally:
            for _, path in rows:
                if path is not None:
                    path.unlink(missing_ok=True)

    def emit(self, rows: list[Any], bar) -> None:
        for row in rows:
            self.results.write(row)
            # a scored row counts in the class mix even where its SR was refused (the error says so)
            self.tally.add(row, predicted=row.label is not None)
            if self.on_row:
                self.on_row(row)
            bar.update(1)
