"""One error tree for the daemon, the client and the wire.

Every error a request can meet has a stable ``code`` that travels in an
``Error`` reply, so a client raises the same class the daemon raised.
``retriable`` says whether the same request may succeed if sent again later.
"""

from __future__ import annotations


class HicachedError(Exception):
    """Base of every error hicached raises on purpose."""

    code: str = "internal"
    retriable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(HicachedError):
    """The configuration is invalid; the message names the key."""

    code = "config"


class BadRequest(HicachedError):
    """A message that is malformed, of an unknown kind, or out of bounds."""

    code = "bad_request"


class TooLarge(BadRequest):
    """A message or a request that exceeds a configured size limit."""

    code = "too_large"


class VersionMismatch(HicachedError):
    """Client and daemon speak different major protocol versions."""

    code = "version_mismatch"


class SessionLost(HicachedError):
    """The daemon does not know this client (it restarted, or no hello yet)."""

    code = "no_session"
    retriable = True


class InvalidNamespace(HicachedError):
    """A namespace description that is unsafe or inconsistent."""

    code = "invalid_namespace"


class UnknownNamespace(HicachedError):
    """A request names a namespace this session has not registered."""

    code = "unknown_namespace"


class UnknownLease(HicachedError):
    """The lease was already committed, released or expired."""

    code = "unknown_lease"


class LeaseEnded(UnknownLease):
    """The client's own finding (never on the wire): a request bound to a lease
    met, at the hello its call said, another daemon instance than the one that
    granted the lease. The lease ended with that daemon, and the request is
    not asked of the new one, which never granted it."""


class ForeignLease(HicachedError):
    """The lease belongs to another client."""

    code = "foreign_lease"


class ForeignTenant(HicachedError):
    """The request needs a tenant this connection does not belong to: a namespace
    of another tenant, or any namespace from a peer that maps to no tenant. A
    connection's tenant comes from who it is (docs/operations.md, Tenants)."""

    code = "foreign_tenant"


class ResourceExhausted(HicachedError):
    """A bounded resource (leases, sessions, namespaces) is at its limit."""

    code = "resource_exhausted"
    retriable = True


class DeadlineExceeded(HicachedError):
    """No reply arrived before the request's deadline."""

    code = "deadline_exceeded"
    retriable = True


class DaemonUnavailable(HicachedError):
    """The daemon could not be reached or its pool could not be mapped."""

    code = "unavailable"
    retriable = True


class StaleHandle(HicachedError):
    """A copy through a handle that no longer owns its slots: closed, granted by
    a daemon that has since restarted, past its lease deadline, or a slot that
    changed owner while it was copied. What was read is a miss; ``valid``
    leading pages of it were intact."""

    code = "stale_handle"
    retriable = True

    def __init__(self, message: str, valid: int = 0) -> None:
        super().__init__(message)
        self.valid = valid


_BY_CODE: dict[str, type[HicachedError]] = {
    cls.code: cls
    for cls in (
        HicachedError,
        ConfigError,
        BadRequest,
        TooLarge,
        VersionMismatch,
        SessionLost,
        InvalidNamespace,
        UnknownNamespace,
        UnknownLease,
        ForeignLease,
        ForeignTenant,
        ResourceExhausted,
        DeadlineExceeded,
        DaemonUnavailable,
        StaleHandle,
    )
}


def error_from_code(code: str, message: str) -> HicachedError:
    """Rebuild the error a daemon reported; unknown codes become the base class."""
    return _BY_CODE.get(code, HicachedError)(message)
