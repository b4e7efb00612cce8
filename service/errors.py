"""What the service answers when it refuses: the client raises these, the CLI prints their message."""
from __future__ import annotations


class ServiceError(Exception):
    """The service could not be reached or refused the call; the message says why and what to do."""


class AccessDenied(ServiceError, PermissionError):
    """The caller is proven, but the job is not theirs to see or change (service.authz)."""


class NotAuthenticated(ServiceError):
    """No valid munge credential came with the call (missing, expired, replayed, not for this request)."""
