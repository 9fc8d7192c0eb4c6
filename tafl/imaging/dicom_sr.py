"""DICOM results a PACS can file: a Comprehensive SR per prediction and the heatmap as a secondary capture.

Built with highdicom, following the IHE AI Results (AIR) conventions:

- the SR is a TID 1500 Measurement Report in the source's study (patient and study modules are copied
  from the source; nothing is invented: an attribute the source lacks stays absent or empty), in a new
  series, and marked UNVERIFIED (VerificationFlag), PARTIAL completion: a radiologist has not signed it;
- one measurement group references the source SOP instance (and frame) it was computed on, names the
  algorithm (model name, version and the package checksum: the sha256 of model.onnx that SHA256SUMS lists)
  in the group's Algorithm Identification, and holds the predicted class as a coded "Finding" with its
  probability (a NUM, unit 1), and each expert's vote as a coded evaluation;
- the heatmap overlay (when asked) is a Secondary Capture Image (RGB, 8 bit) in the same study, and the SR
  references it from the measurement group (an IMAGE item) and lists it in its evidence.

Class codes: a package's metadata may map a class to a code (`class_codes`: one entry per class, in
class order, or a mapping from class name: `{"value": "372244006", "scheme": "SCT", "meaning": "..."}`);
a class without one gets a code in the local coding scheme `99TAFL` (value `class-<index>`, meaning the
class name). The model card states which.

UIDs are derived from the source SOP Instance UID and the package checksum (pydicom's generate_uid with
those as entropy), so scoring the same instance with the same model twice gives the same SR and SC UIDs:
a redelivery after a crash replaces the object at the destination instead of adding a duplicate.

pydicom, highdicom and NumPy only; imports nothing of tafl but `tafl.errors`.
"""

from __future__ import annotations

import copy
import hashlib
import io
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tafl.errors import UnprocessableImage, UnsupportedMedia

LOCAL_SCHEME = "99TAFL"
LOCAL_SCHEME_NAME = "tafl local codes"
MANUFACTURER = "tafl"
NOT_ASSESSED = "Not assessed: outside the model's domain"  # an SR for an image the model abstained on
SR_SERIES_NUMBER = 9901
SC_SERIES_NUMBER = 9902
SR_STORAGE = "1.2.840.10008.5.1.4.1.1.88.33"  # Comprehensive SR
SC_STORAGE = "1.2.840.10008.5.1.4.1.1.7"  # Secondary Capture Image
# non-image objects a router may send with a study: not classified (no pixels to classify)
NOT_IMAGES = ("1.2.840.10008.5.1.4.1.1.88.", "1.2.840.10008.5.1.4.1.1.104.", "1.2.840.10008.5.1.4.1.1.11.",
              "1.2.840.10008.5.1.4.1.1.9.", "1.2.840.10008.5.1.4.1.1.66", "1.2.840.10008.5.1.4.1.1.481.")


# patient and study attributes the SR and SC modules hold (Type 2): an empty value when the source has none
TYPE2_EMPTY = ("PatientName", "PatientID", "PatientBirthDate", "PatientSex", "StudyID", "AccessionNumber",
               "StudyDate", "StudyTime", "ReferringPhysicianName")


@dataclass
class Algorithm:
    """What the SR says about the model that made the finding."""

    name: str
    version: str
    checksum: str  # sha256 of model.onnx (as SHA256SUMS lists it)
    class_names: list[str]
    class_codes: list[dict[str, str]] = field(default_factory=list)  # one per class: value, scheme, meaning

    @classmethod
    def from_metadata(cls, meta: Any, checksum: str) -> Algorithm:
        """From a package's metadata (tafl.packaging.metadata.PackageMetadata, read by its attributes: this leaf
        imports nothing of packaging) and the checksum of its model.onnx."""
        return cls(meta.name, meta.version, checksum, list(meta.class_names),
                   class_codes(meta.class_names, meta.class_codes))


@dataclass
class Finding:
    """One prediction: the class, its probability, and each expert's vote (name, class index, probability); or,
    for an image outside the model's domain, no class and `not_assessed`, the reason (an SR a site asked for that
    says the image was not assessed)."""

    label: int | None
    probability: float | None
    experts: list[tuple[str, int, float | None]] = field(default_factory=list)
    frame: int | None = None  # 1-based frame number of a multi-frame source; None: single frame
    not_assessed: str | None = None
    plausible: list[int] | None = None  # the conformal prediction set's classes (None: the package has no sets)
    coverage: float | None = None  # the set's level

    @classmethod
    def from_result(cls, result: dict[str, Any], class_names: list[str], frame: int | None = None) -> Finding:
        """From the service's per-frame result (tafl.serving.results.frame_result) or a scoring row's facts."""
        if result.get("abstained"):
            return cls(None, None, [], frame, str(result.get("reason") or NOT_ASSESSED))
        idx = {n: i for i, n in enumerate(class_names)}
        experts = [(e["name"], idx[e["class_name"]], e.get("probability")) for e in result.get("experts", [])]
        ps = result.get("prediction_set")
        return cls(int(result["label"]), float(result["probability"]), experts, frame, None,
                   [int(c) for c in ps["labels"]] if ps else None, float(ps["coverage"]) if ps else None)


def class_codes(class_names: Any, given: Any = None) -> list[dict[str, str]]:
    """The code of each of `class_names`: from `given` (a package's metadata `class_codes`: a mapping from class name,
    or a list in class order) where it gives one, else the local scheme."""
    names = list(class_names)
    given = given or {}
    if isinstance(given, list):
        given = {n: c for n, c in zip(names, given) if c}
    out = []
    for i, n in enumerate(names):
        c = given.get(n) if isinstance(given, dict) else None
        if isinstance(c, dict) and c.get("value") and c.get("scheme"):
            out.append({"value": str(c["value"]), "scheme": str(c["scheme"]), "meaning": str(c.get("meaning") or n)})
        else:
            out.append({"value": f"class-{i}", "scheme": LOCAL_SCHEME, "meaning": n})
    return out


def uid_hash(uid: str) -> str:
    """What logs say about an instance: the first 12 hex digits of the sha256 of its SOP Instance UID."""
    return hashlib.sha256(str(uid).encode()).hexdigest()[:12]


def read_header(data: bytes):
    """The source's dataset without pixel data (patient, study and instance identity), or a 4xx."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True, force=True)
    except (InvalidDicomError, ValueError, EOFError, OSError, KeyError, TypeError) as exc:
        raise UnsupportedMedia(f"format=sr needs a DICOM input: the header could not be read ({type(exc).__name__})") \
            from None
    check_source(ds)
    return ds


def check_source(ds) -> None:
    missing = [k for k in ("SOPClassUID", "SOPInstanceUID", "StudyInstanceUID") if not str(ds.get(k, "") or "")]
    if missing:
        raise UnprocessableImage(f"the DICOM lacks {', '.join(missing)}: a structured report must reference its "
                                 "source instance and study; export the image from the PACS again and resend it")


def is_image_object(ds) -> bool:
    """Whether an instance holds pixels to classify (not an SR, presentation state, waveform, RT plan ...)."""
    sop = str(ds.get("SOPClassUID", ""))
    return not sop.startswith(NOT_IMAGES) and ("PixelData" in ds or "FloatPixelData" in ds
                                              or "DoubleFloatPixelData" in ds)


def _uid(*parts: str) -> str:
    from pydicom.uid import generate_uid

    return generate_uid(entropy_srcs=[str(p) for p in parts])


def pydicom_dataset():
    import pydicom

    return pydicom.Dataset()


def _code(c: dict[str, str]):
    from highdicom.sr import CodedConcept

    return CodedConcept(c["value"], c["scheme"], c["meaning"][:64])


def _local(value: str, meaning: str):
    from highdicom.sr import CodedConcept

    return CodedConcept(value, LOCAL_SCHEME, meaning[:64])


def _evidence(ds):
    """The copy of the source highdicom reads patient, study and reference facts from (no pixels needed)."""
    import pydicom

    src = pydicom.Dataset()
    for elem in ds:
        if elem.tag.group in (0x7FE0, 0x0002):
            continue
        if elem.VR in ("DA", "TM") and isinstance(elem.value, str) and elem.value:
            # ACR-NEMA style dates and times (1993.11.02, 15:18:59), legal in old files, that highdicom's
            # strict parsing refuses: the same value in today's form; one still unreadable is left out
            fixed = elem.value.replace(".", "") if elem.VR == "DA" else elem.value.replace(":", "")
            if not re.fullmatch(r"\d{8}" if elem.VR == "DA" else r"\d{2,6}(\.\d{1,6})?", fixed.strip()):
                continue
            elem = pydicom.DataElement(elem.tag, elem.VR, fixed.strip())
        src.add(copy.deepcopy(elem))  # its own elements: a change to the copy must not reach the caller's source
    for key in TYPE2_EMPTY:  # Type 2 (may be empty) attributes highdicom reads: absent in the source means unknown
        if key not in src:
            setattr(src, key, "")
    return src


def secondary_capture(source, rgb: np.ndarray, algo: Algorithm):
    """The heatmap overlay (H, W, 3) uint8 as a Secondary Capture Image in the source's study."""
    from highdicom.sc import SCImage

    src_uid = str(source.SOPInstanceUID)
    rgb = np.ascontiguousarray(np.asarray(rgb, np.uint8))
    sc = SCImage.from_ref_dataset(
        ref_dataset=_evidence(source), pixel_array=rgb, photometric_interpretation="RGB", bits_allocated=8,
        coordinate_system="PATIENT", series_instance_uid=_uid(source.StudyInstanceUID, algo.checksum, "sc-series"),
        series_number=SC_SERIES_NUMBER, sop_instance_uid=_uid(src_uid, algo.checksum, "sc"), instance_number=1,
        manufacturer=MANUFACTURER, patient_orientation=("L", "P"),
        series_description=f"tafl heatmap {algo.name} {algo.version}"[:64],
    )
    sc.ImageType = ["DERIVED", "SECONDARY"]
    sc.BurnedInAnnotation = "NO"
    sc.SeriesDescription = f"AI heatmap {algo.name} {algo.version} (unverified)"[:64]
    return sc


def structured_report(source, finding: Finding, algo: Algorithm, heatmap_sc=None):
    """A Comprehensive SR (TID 1500) of one finding on `source` (a pydicom Dataset, pixels not needed)."""
    import highdicom as hd
    from highdicom.sr import (AlgorithmIdentification, CodedConcept, DeviceObserverIdentifyingAttributes,
                              ImageContentItem, Measurement, MeasurementReport,
                              MeasurementsAndQualitativeEvaluations, ObservationContext, ObserverContext,
                              QualitativeEvaluation, RelationshipTypeValues, SourceImageForMeasurementGroup,
                              TrackingIdentifier)
    from pydicom.sr.codedict import codes

    check_source(source)
    src_uid = str(source.SOPInstanceUID)
    codes_ = [_code(c) for c in algo.class_codes] or [_local(f"class-{i}", n) for i, n in enumerate(algo.class_names)]
    algo_id = AlgorithmIdentification(name=algo.name[:64], version=algo.version[:64],
                                      parameters=[f"model.onnx sha256 {algo.checksum}"])
    device = ObserverContext(
        observer_type=codes.cid270.Device,
        observer_identifying_attributes=DeviceObserverIdentifyingAttributes(
            uid=_uid(algo.checksum, "device"), name=f"{algo.name} {algo.version}"[:64], manufacturer_name=MANUFACTURER,
            model_name=algo.name[:64], serial_number=algo.checksum[:16]))
    evaluations = []  # the predicted class is the group's Finding (121071, TID 1501's finding type)
    measurements = []
    if finding.label is None:  # not assessed: no finding, the reason as the group's evaluation
        evaluations.append(QualitativeEvaluation(_local("assessment", "Assessment"),
                                                 _local("not-assessed", NOT_ASSESSED)))
    else:
        measurements.append(Measurement(name=_local("probability", "Probability of the finding"),
                                        value=float(finding.probability), unit=CodedConcept("1", "UCUM", "no units"),
                                        algorithm_id=algo_id))
    for name, lab, prob in finding.experts:
        evaluations.append(QualitativeEvaluation(_local(f"expert-vote:{name}"[:16], f"Expert vote: {name}"),
                                                 codes_[lab]))
        if prob is not None:
            measurements.append(Measurement(name=_local(f"expert-prob:{name}"[:16], f"Expert probability: {name}"),
                                            value=float(prob), unit=CodedConcept("1", "UCUM", "no units"),
                                            algorithm_id=algo_id))
    if finding.plausible is not None and finding.coverage is not None:  # the set: one item per class, and its level
        level = f"{100 * finding.coverage:g}%"
        for c in finding.plausible:
            evaluations.append(QualitativeEvaluation(_local("set-member", f"In the {level} prediction set"),
                                                     codes_[c]))
        measurements.append(Measurement(name=_local("set-coverage", "Prediction set coverage, per class"),
                                        value=float(finding.coverage), unit=CodedConcept("1", "UCUM", "no units"),
                                        algorithm_id=algo_id))
        measurements.append(Measurement(name=_local("set-size", "Prediction set size"),
                                        value=float(len(finding.plausible)), unit=CodedConcept("1", "UCUM", "no units"),
                                        algorithm_id=algo_id))
    frames = [finding.frame] if finding.frame else None
    group = MeasurementsAndQualitativeEvaluations(
        tracking_identifier=TrackingIdentifier(uid=_uid(src_uid, algo.checksum, "tracking"),
                                               identifier=f"tafl {algo.name} classification"[:64]),
        finding_type=None if finding.label is None else codes_[finding.label], algorithm_id=algo_id,
        measurements=measurements or None, qualitative_evaluations=evaluations or None,
        source_images=[SourceImageForMeasurementGroup(str(source.SOPClassUID), src_uid, frames)])
    if heatmap_sc is not None:
        group[0].ContentSequence.append(ImageContentItem(
            name=_local("heatmap", "Heatmap of the finding"), referenced_sop_class_uid=str(heatmap_sc.SOPClassUID),
            referenced_sop_instance_uid=str(heatmap_sc.SOPInstanceUID),
            relationship_type=RelationshipTypeValues.CONTAINS))
    report = MeasurementReport(observation_context=ObservationContext(observer_device_context=device),
                               procedure_reported=CodedConcept("363679005", "SCT", "Imaging procedure"),
                               imaging_measurements=[group])
    from highdicom._standard_utils import get_sop_class_iod_map  # no public name for it

    ev = _evidence(source)
    retired = str(ev.SOPClassUID) not in get_sop_class_iod_map()  # e.g. the retired US Image Storage
    if retired:  # highdicom copies the patient and study modules by the IOD: read them as a secondary capture's
        ev.SOPClassUID = SC_STORAGE
    evidence = [ev] + ([heatmap_sc] if heatmap_sc is not None else [])
    sr = hd.sr.ComprehensiveSR(
        evidence=evidence, content=report[0], series_instance_uid=_uid(source.StudyInstanceUID, algo.checksum,
                                                                       "sr-series"),
        series_number=SR_SERIES_NUMBER, sop_instance_uid=_uid(src_uid, algo.checksum, "sr"), instance_number=1,
        manufacturer=MANUFACTURER, is_complete=False, is_final=False, is_verified=False,
        series_description=(f"AI result {algo.name} {algo.version} (unverified)" if finding.label is not None else
                            f"AI {algo.name} {algo.version}: not assessed")[:64])
    scheme = pydicom_dataset()
    scheme.CodingSchemeDesignator, scheme.CodingSchemeName = LOCAL_SCHEME, LOCAL_SCHEME_NAME
    scheme.CodingSchemeResponsibleOrganization = MANUFACTURER
    sr.CodingSchemeIdentificationSequence = [*sr.get("CodingSchemeIdentificationSequence", []), scheme]
    if retired:  # the evidence names the source's own SOP class
        for study in sr.get("CurrentRequestedProcedureEvidenceSequence", []):
            for series in study.get("ReferencedSeriesSequence", []):
                for ref in series.get("ReferencedSOPSequence", []):
                    if ref.ReferencedSOPInstanceUID == src_uid:
                        ref.ReferencedSOPClassUID = str(source.SOPClassUID)
    return sr


def build(source, finding: Finding, algo: Algorithm, overlay_rgb: np.ndarray | None = None):
    """(SR, SC or None): the SC when an overlay is given, referenced from the SR."""
    with warnings.catch_warnings():  # highdicom's warnings quote tag values (a patient's name): never logged
        warnings.simplefilter("ignore")
        try:
            sc = secondary_capture(source, overlay_rgb, algo) if overlay_rgb is not None else None
            return structured_report(source, finding, algo, sc), sc
        except (ValueError, TypeError, AttributeError) as exc:  # a source attribute highdicom refuses
            raise UnprocessableImage("the DICOM's header could not be carried into a structured report "
                                     f"({type(exc).__name__}); check that its study and patient modules are "
                                     "standard, export it again and resend it") from None


# what a caller that runs `encoded` in a worker process (tafl.imaging.pool) says when it fails there
BUILD_LATE = "building the structured report took too long"
BUILD_CRASHED = "building the structured report made its process fail"


def encoded(source, finding: Finding, algo: Algorithm, overlay_rgb: np.ndarray | None = None) -> list[bytes]:
    """[SR] or [SR, SC] as Part 10 files (`build`, then `to_bytes`). A plain function of picklable arguments, so
    it can run in another process: with highdicom it costs tens of milliseconds of pure Python (holding the GIL)
    per SR on a small core."""
    sr, sc = build(source, finding, algo, overlay_rgb)
    return [to_bytes(sr)] + ([to_bytes(sc)] if sc is not None else [])


def warm() -> int:
    """Build one SR of a made-up source: highdicom's first SR in a process costs about half a second (its
    IOD and code tables), which a service or listener pays at start instead of on its first instance."""
    import os

    ds = pydicom_dataset()
    ds.SOPClassUID, ds.SOPInstanceUID, ds.StudyInstanceUID = "1.2.840.10008.5.1.4.1.1.7", "1.2.3.4", "1.2.3"
    ds.SeriesInstanceUID, ds.Modality = "1.2.3.5", "OT"
    encoded(ds, Finding(0, 1.0), Algorithm("warm-up", "0", "0" * 64, ["a"]))
    return os.getpid()


def sop_instance_uid(data: bytes) -> str:
    """A DICOM file's SOP Instance UID, read no further than that element (what is filed needs naming in a STOW-RS
    answer's Failed SOP Sequence without parsing the whole report again)."""
    from pydicom.filereader import read_partial
    from pydicom.tag import Tag

    after = Tag(0x0008, 0x0018)
    ds = read_partial(io.BytesIO(data), stop_when=lambda tag, vr, length: tag > after)
    return str(ds.get("SOPInstanceUID", ""))


def to_bytes(ds) -> bytes:
    """A Part 10 file of `ds` (preamble, file meta, explicit VR little endian)."""
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()
