"""Telling an object store that stopped answering from every other failure: an error whose chain
(its causes and the errors it was raised while handling) holds a refused, reset or timed-out
connection, as each client raises one once its own retries are spent (botocore and s3fs, gcsfs and
aiohttp, TensorStore's status codes). Read by the one place that turns such an error into a
run's stop (trainer.loop), and by what skips writing to a store already known to be down.
"""

from __future__ import annotations

# The clients' own exception classes, by name: importing botocore or aiohttp here would load them
# for every local run. Each is raised only after the client's retries are spent.
CONNECTION_ERRORS = frozenset({
    "EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError",  # botocore
    "ClientConnectorError", "ServerDisconnectedError", "ServerTimeoutError", "ClientOSError",  # aiohttp (gcsfs, s3fs)
})
# TensorStore (Orbax's writes, the lock object) reports a store it could not reach with these codes,
# or, once its retries of a request are spent (storage.store_retries), with this ABORTED status.
STATUS_PREFIXES = ("UNAVAILABLE:", "DEADLINE_EXCEEDED:")
RETRIES_SPENT = ("ABORTED: All ", " retry attempts failed")


def _chain(error: BaseException) -> list[BaseException]:
    """`error`, then its causes and contexts, outermost first, each once."""
    found, todo = [], [error]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is f for f in found):
            continue
        found.append(e)
        todo += [e.__cause__, e.__context__]
    return found


def _is_connection(error: BaseException) -> bool:
    if isinstance(error, ConnectionError):  # refused, reset, aborted
        return True
    if any(cls.__name__ in CONNECTION_ERRORS for cls in type(error).__mro__):
        return True
    text = str(error)
    return text.startswith(STATUS_PREFIXES) or (text.startswith(RETRIES_SPENT[0]) and RETRIES_SPENT[1] in text)


def unreachable(error: BaseException | None) -> BaseException | None:
    """The outermost error in `error`'s chain that says the store did not answer (its message
    names the object, where the client's does), or None when none does."""
    if error is None:
        return None
    return next((e for e in _chain(error) if _is_connection(e)), None)


class LeftRunning(Exception):
    """Raised over an outage a library's background tasks outlive (a save the object store cut
    short: Orbax's threads wait on signals that never come; a restore it cut short: TensorStore's
    and the fsspec clients' callbacks into event loops that close): the process exits at once,
    without joining their threads, which would never end or print tracebacks."""


def left_running(error: BaseException | None) -> bool:
    """Whether `error`'s chain holds a LeftRunning: the run must exit without joining threads."""
    return error is not None and any(isinstance(e, LeftRunning) for e in _chain(error))
