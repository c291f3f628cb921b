"""The ``dp_dummy`` patch: an idle data-parallel rank's dummy batch is a decode.

V1 runs for real: ``tools/inspect_dummy_batch.py`` starts ``vllm.LLM`` with its
engine core in the script's process (vLLM's real CPU worker; a multiprocess engine
would only add two vLLM start-ups) and runs ``Worker.execute_dummy_batch()`` there
with attention metadata forced on, capturing what the real attention builders
receive. The GPU suite runs the same script multiprocess.

V2 cannot be driven on CPU (its runner needs a GPU and Triton), so its tests call
vLLM's real ``Worker.execute_dummy_batch`` on a stand-in worker whose runner records
the ``_dummy_run`` call, and run vLLM's real ``set_dummy_context`` on a real V2
dummy ``InputBatch`` with a stand-in block-table holder.
"""

from __future__ import annotations

import json
import types

import pytest

from conftest import REPO, run_python
from vllm_v4_patches import dp_dummy
from vllm_v4_patches.patcher import Patcher
from vllm_v4_patches.sources import InstalledSource


def test_probe_finds_both_runners_without_dummy_context():
    found = dp_dummy.probe(InstalledSource())
    assert (found.verdict, found.variant) == ("needed", "V1+V2")


# -- V1, real runner ----------------------------------------------------------


def inspect(model, *, patched: bool, ngram: bool) -> dict:
    args = [str(REPO / "tools" / "inspect_dummy_batch.py"), str(model)]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if patched:
        env["VLLM_V4_PATCHES_STRICT"] = "1"
    result = run_python(
        args + (["--ngram"] if ngram else []), pythonpath=[REPO] if patched else [], env=env
    )
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def classified_as_decode(build: dict) -> bool:
    return build["num_prefills"] == 0 and build["num_decodes"] == build["num_reqs"]


@pytest.mark.e2e
@pytest.mark.parametrize("ngram", [False, True], ids=["decode", "spec-decode"])
def test_stock_v1_dummy_batch_looks_like_a_prefill(tiny_model, ngram):
    result = inspect(tiny_model, patched=False, ngram=ngram)
    assert result["builds"], "no attention metadata was built"
    for build in result["builds"]:
        assert build["contexts"] == [0] * build["num_reqs"]  # seq_len == query_len
        assert not classified_as_decode(build)


@pytest.mark.e2e
@pytest.mark.parametrize("ngram", [False, True], ids=["decode", "spec-decode"])
def test_patched_v1_dummy_batch_is_a_decode_with_consistent_context(tiny_model, ngram):
    result = inspect(tiny_model, patched=True, ngram=ngram)
    query_len = result["uniform_decode_query_len"]
    assert query_len == (3 if ngram else 1)
    assert result["builds"], "no attention metadata was built"
    for build in result["builds"]:
        assert classified_as_decode(build), build
        assert all(context >= 1 for context in build["contexts"]), build
        assert build["seq_lens"] == build["seq_lens_cpu_upper_bound"]
        assert build["max_seq_len"] == max(build["seq_lens"]) <= 256
        assert build["is_prefilling"] == [False] * build["num_reqs"]
        expected_positions = [
            context + offset
            for context, length in zip(build["contexts"], build["query_lens"], strict=True)
            for offset in range(length)
        ]
        assert build["positions"] == expected_positions
    # the persistent batch's rows (a stale aborted prefill) come back unchanged
    assert result["rows_kept"]


# -- V2, stand-ins around vLLM's real worker method and context helper ----------


class RecordingV2Runner:
    uniform_decode_query_len = 3

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def _dummy_run(
        self, num_tokens, *args, uniform_decode=False, context_len=0, **kwargs
    ):  # noqa: ANN001, ANN202
        self.calls.append({"uniform_decode": uniform_decode, "context_len": context_len})


@pytest.fixture
def v2_patched():
    from vllm.v1.worker.gpu_worker import Worker

    patcher = Patcher("dp_dummy")
    patcher.wrap(Worker, dp_dummy.WORKER_METHOD, dp_dummy.arm_during_call)
    patcher.wrap(RecordingV2Runner, dp_dummy.V2_METHOD, dp_dummy.dummy_with_context)
    yield
    patcher.revert()


def idle_step(runner: RecordingV2Runner) -> dict:
    from vllm.v1.worker.gpu_worker import Worker

    worker = types.SimpleNamespace(model_runner=runner, randomize_dummy_inputs=False)
    Worker.execute_dummy_batch(worker)
    return runner.calls[-1]


def test_stock_v2_idle_step_asks_for_no_context():
    assert idle_step(RecordingV2Runner()) == {"uniform_decode": True, "context_len": 0}


def test_patched_v2_idle_step_asks_for_one_context_token(v2_patched):
    assert idle_step(RecordingV2Runner()) == {"uniform_decode": True, "context_len": 1}


def test_patched_v2_other_dummy_runs_are_untouched(v2_patched):
    runner = RecordingV2Runner()
    runner._dummy_run(8, uniform_decode=True)  # capture, warm-up, profiling
    runner._dummy_run(8, uniform_decode=True, context_len=5)
    assert [call["context_len"] for call in runner.calls] == [0, 5]
    assert not dp_dummy.is_armed()


def test_v2_set_dummy_context_with_one_token_gives_a_decode_shape():
    torch = pytest.importorskip("torch")
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers, set_dummy_context

    buffers = InputBuffers(max_num_reqs=4, max_num_tokens=16, device=torch.device("cpu"))
    batch = InputBatch.make_dummy(2, 6, buffers, max_query_len=3)
    block_table = torch.zeros(4, 8, dtype=torch.int32)
    holder = types.SimpleNamespace(input_block_tables=[block_table], block_sizes=[16])
    set_dummy_context(batch, holder, dp_dummy.DUMMY_CONTEXT_TOKENS, 32, 256)
    assert batch.seq_lens.tolist() == [4, 4]
    assert batch.num_computed_tokens_np.tolist() == [1, 1]
    assert batch.positions.tolist() == [1, 2, 3, 1, 2, 3]
