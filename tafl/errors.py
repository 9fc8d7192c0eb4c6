"""The one exception tree of tafl.

Every error a user can cause is a `TaflError` with a message a person can act on; the CLI prints
it as one line and exits non-zero, the service turns it into a JSON body with its HTTP status.
Third-party errors are wrapped at the boundary (``raise DataError(...) from exc``).

    TaflError                    (status 500 when it reaches the service unhandled)
    ├── ConfigError              a bad run configuration, flag or config key         400
    ├── DataError                a dataset that is missing, unreadable or unusable    400
    ├── CheckpointError          a checkpoint that is missing, corrupt or foreign     400
    ├── PackageError             a model package that is incomplete or tampered       400
    ├── RunDirError              an output folder that holds another run              400
    ├── TrainingDiverged         a run whose loss or weights stopped being finite     (CLI only)
    └── ServiceError             errors the service answers with their own status
        ├── BadRequest           400
        ├── Unauthorized         401
        ├── Forbidden            403 (refused by the service's configuration: reload)
        ├── NotFound             404
        ├── PayloadTooLarge      413
        ├── UnsupportedMedia     415
        ├── UnprocessableImage   422
        ├── ServiceUnavailable   503
        └── ServiceCallError     a client's call that failed: the status the service answered (0: no answer)
"""

from __future__ import annotations


class TaflError(Exception):
    """Base class: an error whose message is meant for a person."""

    status: int = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ConfigError(TaflError):
    status = 400


class DataError(TaflError):
    status = 400


class CheckpointError(TaflError):
    status = 400


class PackageError(TaflError):
    status = 400


class RunDirError(TaflError):
    status = 400


class TrainingDiverged(TaflError):
    """Training stopped: the global model or the clients' losses are no longer finite (or exploded).
    The checkpoints of the rounds before stay; no final model is written."""

    status = 500


class ServiceError(TaflError):
    status = 500


class BadRequest(ServiceError):
    status = 400


class Unauthorized(ServiceError):
    status = 401


class Forbidden(ServiceError):
    """The request is understood and refused by the service's configuration (403)."""

    status = 403


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    """The request cannot be done in the service's current configuration (409), e.g. a reload with several workers."""

    status = 409


class PayloadTooLarge(ServiceError):
    status = 413


class UnsupportedMedia(ServiceError):
    status = 415


class UnprocessableImage(ServiceError):
    status = 422


class OutsideDomain(ServiceError):
    """The image's DICOM header contradicts the domain the model was trained on (a CT slice sent to a dermoscopy
    model): refused before the model runs, with the reason (422)."""

    status = 422


class ServiceUnavailable(ServiceError):
    status = 503


class ServiceCallError(ServiceError):
    """A call to the service failed (raised by `tafl.clients`): `status` is the HTTP status the service answered,
    0 when no answer came; `code` the service's error code, `detail` its message, `request_id` its X-Request-ID."""

    def __init__(self, status: int, message: str, code: str = "", request_id: str | None = None):
        super().__init__(f"{status or 'no answer'}: {message}")
        self.status, self.code, self.request_id = status, code, request_id
        self.detail = message
