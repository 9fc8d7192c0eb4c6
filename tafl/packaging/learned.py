"""The records of a package's learned parts (tafl.packaging.metadata reads them into PackageMetadata): the in-domain
detector (`domain.detector`) and the conformal prediction sets (`sets`). Each is carried whole as training and export
wrote it (tafl.packaging.records.Record); its properties are what tafl reads of it. Standard library only."""

from __future__ import annotations

from typing import Any

from tafl.packaging.records import NUMBER, Reader, Record


class Detector(Record):
    """The learned in-domain detector as training recorded it (tafl.training.detector): fitted (or why not), its
    threshold on the graph's `domain_distance`, the validation share it keeps, what it refused of the test split."""

    @property
    def fitted(self) -> bool:
        return self._get("fitted") is True

    @property
    def threshold(self) -> float | None:
        t = self._get("threshold")
        return float(t) if self.fitted and isinstance(t, NUMBER) and not isinstance(t, bool) else None

    @property
    def keep(self) -> float:
        return _number(self._get("keep"), 0.95)

    @property
    def kind(self) -> str:
        """`mahalanobis`, or `mahalanobis+energy` where the score is the larger of the distance and the head's
        energy on the distance's scale."""
        return str(self._get("kind") or "mahalanobis")

    @property
    def test_refused(self) -> float | None:
        t = self._get("test")
        return _number(t.get("refused"), None) if isinstance(t, dict) else None

    @property
    def why(self) -> str:
        return str(self._get("why") or "not fitted")

    @property
    def detection(self) -> dict[str, dict[str, float]]:
        """Per far-out-of-domain set (and `unseen_class`), as training measured it: auroc, fpr95 (pytorch-ood's
        convention), accepted (the share the threshold lets through), images."""
        d = self._get("detection")
        if not isinstance(d, dict):
            return {}
        return {str(k): {m: float(x) for m, x in v.items() if isinstance(x, NUMBER) and not isinstance(x, bool)}
                for k, v in d.items() if isinstance(v, dict)}


class Sets(Record):
    """Conformal prediction sets (tafl.packaging.sets): fitted (or why not), the coverage the graph's
    `prediction_set` answers (chosen at export), the class thresholds of every level a request may ask for
    (`levels`: {"0.9": [C thresholds on 1 − p]}), the kind (class-conditional), the calibration images per class and
    where they came from, and what the test split measured."""

    @property
    def fitted(self) -> bool:
        return self._get("fitted") is True and self.coverage is not None

    @property
    def why(self) -> str:
        return str(self._get("why") or "not fitted")

    @property
    def coverage(self) -> float | None:
        c = _number(self._get("coverage"), None)
        return c if c is not None and 0 < c < 1 else None

    @property
    def kind(self) -> str:
        return str(self._get("kind") or "class-conditional")

    @property
    def confidence(self) -> float | None:
        """The probability over the calibration draw with which each class's coverage reaches its level (the
        training-conditional guarantee, tafl.conformal.rank); None: the coverage holds on average over draws."""
        c = _number(self._get("confidence"), None)
        return c if c is not None and 0 < c < 1 else None

    @property
    def thresholds(self) -> dict[float, tuple[float, ...]]:
        lv = self._get("levels")
        if not isinstance(lv, dict):
            return {}
        out = {}
        for k, v in lv.items():
            level = _number(_float(k), None)
            if level is not None and isinstance(v, list) and all(_number(t, None) is not None for t in v):
                out[level] = tuple(float(t) for t in v)
        return out

    @property
    def sites(self) -> dict[str, dict[float, tuple[float, ...]]]:
        """Each training site's own class thresholds per level (a service at that site answers with them)."""
        raw = self._get("sites")
        if not isinstance(raw, dict):
            return {}
        return {str(n): Sets({"levels": v.get("levels")}).thresholds for n, v in raw.items() if isinstance(v, dict)}

    @property
    def calibration_images(self) -> int | None:
        return _number(self._get("calibration_images"), None)

    @property
    def source(self) -> str | None:
        """Where the calibration images came from (the clients' held-out rows, the server's validation split)."""
        v = self._get("source")
        return str(v) if isinstance(v, str) and v else None

    @property
    def always_in_set(self) -> list[str]:
        """Classes with too few calibration images for the level: in every set."""
        return [str(c) for c in self._get("always_in_set") or []]

    @property
    def test(self) -> dict[str, Any]:
        """What the run's test split measured at the export's level: coverage, size, lowest_mix_coverage, ..."""
        t = self._get("test")
        return dict(t) if isinstance(t, dict) else {}

    def check(self, num_classes: int, outputs: set[str], r: Reader) -> None:
        """A fitted record names its coverage among its levels, C thresholds in [0, 1] per level, and the graph
        answers the set."""
        if self._get("fitted") is not True:
            return
        if self.coverage is None:
            r.problem("sets", "is fitted without a coverage between 0 and 1")
            return
        lv = self.thresholds
        if self.coverage not in lv:
            r.problem("sets", f"has no thresholds for its coverage {self.coverage:g}")
        for level, t in lv.items():
            if (num_classes and len(t) != num_classes) or not all(0 <= x <= 1 for x in t):  # no classes: named
                r.problem("sets", f"level {level:g}: expected {num_classes} thresholds in [0, 1]")
        for name, lv_site in self.sites.items():
            if set(lv_site) != set(lv) or any(num_classes and len(t) != num_classes for t in lv_site.values()):
                r.problem("sets", f"site {name!r}: expected {num_classes} thresholds for each level {sorted(lv)}")
        lacking = {"conformal_scores", "prediction_set"} - outputs
        if lacking:
            r.problem("sets", f"is fitted, but 'outputs' lack {sorted(lacking)}")


def _float(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _number(v: Any, default: Any) -> Any:
    return float(v) if isinstance(v, NUMBER) and not isinstance(v, bool) else default
