"""A worker that cannot start at the cluster's start-up, said in one line; and the one-line
renderings of an error the launcher, the CLI and the benchmark print (``first_line``, ``cause_line``).

Why: a worker's engine fails to build for reasons its operator must fix (a KV pool larger than
the machine's memory, a device it cannot have, a model it cannot load), and Ray reports that as
an ``ActorDiedError`` whose text is the actor's whole traceback, the exception's own line last.
The launcher raises ``WorkerStartError`` instead, naming the worker and that last line (the
traceback stays in the worker's log); ``pdserve serve`` prints it as its error and exits 1.
"""

from __future__ import annotations


class WorkerStartError(RuntimeError):
    """``worker_id`` could not start at the cluster's start-up; ``cause`` is the one line why."""

    def __init__(self, worker_id: str, cause: str) -> None:
        super().__init__(f"{worker_id} could not start: {cause}")
        self.worker_id = worker_id
        self.cause = cause


class RayUnreachableError(RuntimeError):
    """Nothing answers at the Ray address the router was told to join (``ray_init.wait_reachable``);
    ``pdserve serve`` prints it as its error and exits 1, as for a worker that cannot start."""


def first_line(error: BaseException | str, limit: int = 300) -> str:
    """An error's first non-blank line, bounded (Ray's death notices run to a paragraph, a server's
    error page to a whole HTML document); an exception with no text gives its type's name."""
    line = next((part.strip() for part in str(error).splitlines() if part.strip()), "")
    if not line and isinstance(error, BaseException):
        return type(error).__name__
    return line[:limit]


def cause_line(exc: BaseException) -> str:
    """The line of ``exc`` that says why: the last non-blank line of its text (a Ray error about
    the actor's constructor ends with the constructor's exception), else its type's name."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
