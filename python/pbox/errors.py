"""Exceptions raised by the pbox client.

Every failed call raises a subclass of :class:`PboxError` chosen by the gRPC status code the
agent returned; the exception's message is the agent's own message (for example
``"sandbox sb-3 not found"`` or ``"/tmp/x: No such file or directory"``).
"""

from __future__ import annotations

from typing import Dict, Optional, Type

import grpc

__all__ = [
    "PboxError",
    "Cancelled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
    "SessionClosed",
    "CommandError",
    "error_from_rpc",
    "error_from_code",
]


class PboxError(Exception):
    """Base of every error the pbox client raises for a failed agent call.

    Attributes:
        message: the agent's message (or the transport's, when the agent was not reached).
        code: the ``grpc.StatusCode`` of the failed call, or None for client-side errors.
        method: the RPC that failed (e.g. ``"ReadFile"``), when known.
    """

    code: Optional[grpc.StatusCode] = None

    def __init__(
        self,
        message: str,
        *,
        code: Optional[grpc.StatusCode] = None,
        method: Optional[str] = None,
    ) -> None:
        self.message = message
        if code is not None:
            self.code = code
        self.method = method
        prefix = f"{method}: " if method else ""
        super().__init__(f"{prefix}{message}")


class Cancelled(PboxError):
    """The call was cancelled (by the client, or the agent shut down)."""

    code = grpc.StatusCode.CANCELLED


class Unknown(PboxError):
    """The agent failed in a way it did not classify."""

    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(PboxError, ValueError):
    """The request was malformed (bad path, bad mode, bad spec...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(PboxError, TimeoutError):
    """The call's deadline passed before the agent answered."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(PboxError, LookupError):
    """No such sandbox, file or directory."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(PboxError):
    """The target exists (e.g. ``move(..., no_replace=True)``)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(PboxError, PermissionError):
    """The agent refused the operation (e.g. writing into /proc)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(PboxError):
    """The agent is at capacity (max sandboxes), or a limit was hit (disk full, message size)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(PboxError):
    """The operation does not fit the current state (e.g. removing a non-empty directory)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(PboxError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(PboxError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(PboxError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(PboxError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(PboxError, ConnectionError):
    """The agent cannot be reached (not running, wrong endpoint, socket permissions)."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(PboxError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(PboxError):
    """The TCP call carried no token or a wrong one."""

    code = grpc.StatusCode.UNAUTHENTICATED


class SessionClosed(PboxError):
    """The session's stream ended; its sandboxes are gone."""


class CommandError(PboxError):
    """Raised by :meth:`pbox.RunResult.check` when a command did not succeed.

    Attributes:
        result: the :class:`pbox.RunResult` of the command.
    """

    def __init__(self, message: str, result: object) -> None:
        super().__init__(message)
        self.result = result


_BY_CODE: Dict[grpc.StatusCode, Type[PboxError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def error_from_rpc(err: grpc.RpcError, method: Optional[str] = None) -> PboxError:
    """Maps a failed gRPC call to the matching :class:`PboxError` subclass."""
    try:
        code = err.code()
        details = err.details() or ""
    except Exception:  # a bare RpcError without call state
        code, details = grpc.StatusCode.UNKNOWN, str(err)
    if not details:
        details = code.name.lower().replace("_", " ") if code is not None else "unknown error"
    cls = _BY_CODE.get(code, PboxError)
    return cls(details, code=code, method=method)


_BY_NUMBER: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_from_code(code: int, message: str, method: Optional[str] = None) -> PboxError:
    """The :class:`PboxError` subclass of a canonical status code given as a number (the data
    channel's status frames carry them so)."""
    status = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    if not message:
        message = status.name.lower().replace("_", " ")
    return _BY_CODE.get(status, PboxError)(message, code=status, method=method)


def with_method(err: PboxError, method: str) -> PboxError:
    """``err`` as raised by ``method`` (same class, code and message)."""
    if err.method == method or isinstance(err, CommandError):
        return err
    return type(err)(err.message, code=err.code, method=method)
