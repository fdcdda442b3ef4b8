"""Errors of the trace replay. Each one's message is a complete, one-line explanation for a user: the
command-line front end prints it as it is, without a traceback."""

from __future__ import annotations

from kvstrata.impl.errors import KvStrataError

__all__ = ["ReplayError", "ReplayStalled", "TraceError", "VerifyError"]


class ReplayError(KvStrataError):
    """Root of the replay's own errors."""


class TraceError(ReplayError, ValueError):
    """A trace that cannot be replayed: missing, unreadable, or a malformed line (the message names
    the file and the line number)."""


class VerifyError(ReplayError):
    """KV bytes served by the cache differ from the KV that was written for those tokens: a
    correctness bug, never a capacity effect. The message names the request and the page."""


class ReplayStalled(ReplayError):
    """Background work (a copy, a store call) did not finish within the replay's bound."""
