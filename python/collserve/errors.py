"""collserve's exceptions, shaped like torch.distributed's (torch/distributed/__init__.py).

    DistError (RuntimeError)
    +-- DistBackendError          a collective or point-to-point operation failed
    |   +-- DistTimeoutError      ... did not finish in time (also a TimeoutError)
    |   +-- DistArgumentError     ... bad arguments or ranks that disagree (also a ValueError)
    +-- DistNetworkError          the sidecar, a peer host or a rank went away (UNAVAILABLE)
    +-- DistAuthError             no token, or one that does not grant the job (also a PermissionError)
    +-- DistStoreError            a store operation failed
        +-- DistStoreTimeoutError ... a get/wait timed out (also a TimeoutError)

Every exception carries `code`, the absl/gRPC status code number the service returned.
"""

# absl::StatusCode / grpc::StatusCode values.
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND, ALREADY_EXISTS = 0, 1, 2, 3, 4, 5, 6
PERMISSION_DENIED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, ABORTED, OUT_OF_RANGE = 7, 8, 9, 10, 11
UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 12, 13, 14
UNAUTHENTICATED = 16


class DistError(RuntimeError):
    """Base of collserve's errors (torch.distributed.DistError)."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code


class DistBackendError(DistError):
    """A collective or point-to-point operation failed (torch.distributed.DistBackendError)."""


class DistNetworkError(DistError):
    """The sidecar, a peer host or a rank is unreachable or went away (UNAVAILABLE)."""


class DistAuthError(DistError, PermissionError):
    """The coordinator (or the sidecar for it) refused the call's credential: no token or an
    unknown one (UNAUTHENTICATED), or a token of another job (PERMISSION_DENIED). Set
    COLLSERVE_TOKEN or COLLSERVE_TOKEN_FILE to the job's token (docs/security.md)."""


class DistStoreError(DistError):
    """A store operation failed (torch.distributed.DistStoreError)."""


class DistTimeoutError(DistBackendError, TimeoutError):
    """An operation or the rendezvous did not complete in time (DEADLINE_EXCEEDED)."""


class DistArgumentError(DistBackendError, ValueError):
    """Invalid arguments, including ranks that disagree (desync): the message names them."""


class DistStoreTimeoutError(DistStoreError, TimeoutError):
    """A store get/wait did not see its keys in time; the message names them."""


def raise_for(code, message):
    """Raises the exception for a (code, message) status of a process-group call."""
    if code == OK:
        return
    if code == DEADLINE_EXCEEDED:
        raise DistTimeoutError(message, code)
    if code in (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, OUT_OF_RANGE):
        raise DistArgumentError(message, code)
    if code in (UNAVAILABLE, CANCELLED):
        raise DistNetworkError(message, code)
    if code in (UNAUTHENTICATED, PERMISSION_DENIED):
        raise DistAuthError(message, code)
    raise DistBackendError(message, code)


def raise_for_store(code, message):
    """Raises the exception for a (code, message) status of a store call."""
    if code == OK:
        return
    if code == DEADLINE_EXCEEDED:
        raise DistStoreTimeoutError(message, code)
    if code == UNAVAILABLE:
        raise DistNetworkError(message, code)
    if code in (UNAUTHENTICATED, PERMISSION_DENIED):
        raise DistAuthError(message, code)
    raise DistStoreError(message, code)
