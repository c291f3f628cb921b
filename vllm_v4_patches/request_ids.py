"""The request ids of the batch whose attention metadata is being built.

Metadata builders that keep per-request state (a verify length, a scheduling
decision) need the batch's request ids in row order. Reading them back from the
device (``block_table[:, 0]`` and a host copy per step, as some plugins do) costs
a device-to-host sync every step; the runner already has them on the host. A
patch that wraps the runner's metadata build publishes them here for the length
of the build, and a builder reads them with ``current()``:

    from vllm_v4_patches import request_ids

    ids = request_ids.current()  # () outside a build
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

_local = threading.local()


def current() -> tuple[str, ...]:
    """Row-ordered request ids of the batch being built on this thread, else ()."""
    return getattr(_local, "ids", ())


@contextlib.contextmanager
def published(ids: Sequence[str]) -> Iterator[None]:
    """Make ``ids`` what ``current()`` returns on this thread, until the block ends."""
    previous = current()
    _local.ids = tuple(ids)
    try:
        yield
    finally:
        _local.ids = previous
