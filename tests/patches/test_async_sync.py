"""The ``async_sync`` gate against the installed vLLM's real buffers.

CUDA events do not exist on CPU, so the ordering tests inject a recording stand-in
for ``torch.cuda.Event`` (``async_sync.new_event``); the buffers, the pool and
its round robin are vLLM's own.
"""

from __future__ import annotations

import pytest

from vllm_v4_patches import async_sync
from vllm_v4_patches.patcher import Patcher
from vllm_v4_patches.sources import InstalledSource


class Log:
    def __init__(self) -> None:
        self.entries: list[tuple] = []
        self.call = 0
        self.pool = None  # when set, synchronize() notes what the pool's slots hold

    def event(self):  # noqa: ANN201
        return RecordingEvent(self)


class RecordingEvent:
    def __init__(self, log: Log) -> None:
        self.log = log
        self.recorded_at: int | None = None

    def record(self) -> None:
        self.recorded_at = self.log.call
        self.log.entries.append(("record", self.log.call))

    def synchronize(self) -> None:
        self.log.entries.append(("synchronize", self.log.call, self.recorded_at))
        if self.log.pool is not None:
            held = sorted(int(buf.np[0]) for buf in self.log.pool._uva_bufs)
            self.log.entries.append(("slots at synchronize", self.log.call, held))


@pytest.fixture
def log(monkeypatch) -> Log:
    log = Log()
    monkeypatch.setattr(async_sync, "new_event", log.event)
    return log


@pytest.fixture
def patched():
    patcher = Patcher("async_sync")
    async_sync.apply(patcher, async_sync.probe(InstalledSource()))
    yield
    patcher.revert()


def test_probe_finds_both_runners_unguarded_in_the_installed_vllm():
    found = async_sync.probe(InstalledSource())
    assert (found.verdict, found.variant) == ("needed", "V1+V2")


@pytest.fixture
def make_pool(monkeypatch):
    """vLLM's pool with its own non-UVA buffers: the CPU platform claims UVA but
    cannot pin memory here."""
    import torch
    from vllm.v1.worker.gpu import buffer_utils

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    return lambda: buffer_utils.UvaBufferPool(8, torch.int32, max_concurrency=2)


def _fill(pool, log: Log, value: int):
    import numpy as np

    log.call += 1
    return pool.copy_to_uva(np.full(4, value, dtype=np.int32))


def test_stock_pool_rewrites_a_slot_without_any_wait(log, make_pool):
    pool = make_pool()
    for value in range(1, 6):
        _fill(pool, log, value)
    assert not [e for e in log.entries if e[0] in ("record", "synchronize")]


def test_patched_pool_waits_for_the_slots_previous_use_never_the_current_step(
    log, patched, make_pool
):
    pool = make_pool()
    log.pool = pool
    outputs = [_fill(pool, log, value).clone() for value in range(1, 7)]
    assert [int(out[0]) for out in outputs] == [1, 2, 3, 4, 5, 6]  # data unchanged
    syncs = [e for e in log.entries if e[0] == "synchronize"]
    records = [e for e in log.entries if e[0] == "record"]
    assert [r[1] for r in records] == [2, 3, 4, 5, 6]  # each call closes the previous slot
    assert [s[1] for s in syncs] == [3, 4, 5, 6]  # from the first reuse of a slot on
    for _, call, recorded_at in syncs:
        assert recorded_at == call - 1  # the previous use's event, not this step's
    # At call 4 (value 4) the slot being reused still holds call 2's value 2: the wait
    # comes before the rewrite.
    held = [e[2] for e in log.entries if e[0] == "slots at synchronize" and e[1] == 4]
    assert held == [[2, 3]]


def _proposer(log: Log):
    import torch
    from vllm.v1.utils import CpuGpuBuffer

    class StandIn:
        """Carries a real CpuGpuBuffer; the method body below mirrors vLLM's (write
        the pinned numpy view, then copy_to_gpu), since the real one also needs a
        scheduled input batch."""

        def __init__(self) -> None:
            self.backup_next_token_ids = CpuGpuBuffer(
                4, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False
            )

        def prepare_next_token_ids_padded(self, value: int):  # noqa: ANN201
            log.entries.append(("write", log.call))
            self.backup_next_token_ids.np[:2] = value
            log.entries.append(("copy_to_gpu", log.call))
            return self.backup_next_token_ids.copy_to_gpu(2)

    return StandIn()


def test_patched_drafter_staging_waits_for_its_previous_copy_first(log):
    proposer = _proposer(log)
    method = type(proposer).prepare_next_token_ids_padded
    for value in (7, 8, 9):
        log.call += 1
        out = async_sync.gate_backup_tokens(
            lambda v, m=method: m(proposer, v), proposer, (value,), {}
        )
        assert out.tolist() == [value, value]
    by_call = {call: [e[0] for e in log.entries if e[1] == call] for call in (1, 2, 3)}
    assert by_call[1] == ["write", "copy_to_gpu", "record"]
    assert by_call[2] == ["synchronize", "write", "copy_to_gpu", "record"]
    syncs = [e for e in log.entries if e[0] == "synchronize"]
    assert all(recorded_at == call - 1 for _, call, recorded_at in syncs)


def test_without_cuda_the_gates_are_pass_through(patched, make_pool):
    import numpy as np

    assert async_sync.new_event() is None  # this machine has no CUDA
    pool = make_pool()
    values = [pool.copy_to_uva(np.full(4, v, dtype=np.int32)).clone() for v in (3, 4, 5)]
    assert [int(v[0]) for v in values] == [3, 4, 5]
    assert "_vllm_v4_slot_events" in pool.__dict__ and not pool._vllm_v4_slot_events


def test_the_patched_methods_are_the_drafters_and_the_pools(patched):
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.worker.gpu.buffer_utils import UvaBufferPool

    assert hasattr(EagleProposer.prepare_next_token_ids_padded, "__wrapped__")
    assert hasattr(UvaBufferPool.__dict__["copy_to_uva"], "__wrapped__")
