"""CPU checks of the DSpark Markov/confidence heads' PyTorch path (the GPU path's oracle).

The Triton path is checked against this same reference on the GPU by
benchmarks/dspark_markov_gpu.py; here the reference itself is checked against a
float64 loop written straight from docs/dspark.md sections 2 and 3.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_v4_patches.dspark import markov_kernel

REPO = Path(__file__).resolve().parents[2]
VOCAB, RANK, HIDDEN = 50, 8, 16


def make_inputs(batch: int, slots: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return {
        "base_logits": normal(batch, slots, VOCAB, scale=2.0),
        "anchor": torch.randint(0, VOCAB, (batch,), generator=gen),
        "markov_w1": normal(VOCAB, RANK),
        "markov_w2": normal(VOCAB, RANK, scale=0.5),
        "hidden": normal(batch, slots, HIDDEN),
        "confidence_w": normal(HIDDEN + RANK, scale=0.3),
    }


def float64_loop(inputs: dict, temperature=None, gumbel_noise=None):
    """One row and one slot at a time, in float64: the definition, not an optimisation."""
    base = inputs["base_logits"].double()
    w1, w2 = inputs["markov_w1"].double(), inputs["markov_w2"].double()
    hidden, weight = inputs["hidden"].double(), inputs["confidence_w"].double()
    batch, slots, _ = base.shape
    tokens = torch.zeros(batch, slots, dtype=torch.int64)
    confidence = torch.zeros(batch, slots, dtype=torch.float64)
    for row in range(batch):
        prev = int(inputs["anchor"][row])
        for slot in range(slots):
            embedding = w1[prev]
            logits = base[row, slot] + w2 @ embedding
            if gumbel_noise is not None:
                logits = logits + float(temperature[row]) * gumbel_noise[row, slot].double()
            tokens[row, slot] = int(torch.argmax(logits))
            score = weight @ torch.cat([hidden[row, slot], embedding])
            confidence[row, slot] = 1.0 / (1.0 + torch.exp(-score))
            prev = int(tokens[row, slot])
    return tokens, confidence


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_reference_matches_float64_loop(batch: int, slots: int, dtype: torch.dtype):
    inputs = make_inputs(batch, slots, dtype, seed=batch * 10 + slots)
    tokens, confidence = markov_kernel.greedy_markov_draft(**inputs)
    want_tokens, want_confidence = float64_loop(inputs)
    assert tokens.dtype == torch.int64 and tokens.shape == (batch, slots)
    assert confidence.dtype == torch.float32 and confidence.shape == (batch, slots)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(confidence.double(), want_confidence, rtol=0, atol=1e-5)


@pytest.mark.parametrize("slots", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 4])
def test_sampled_reference_matches_float64_loop(batch: int, slots: int):
    inputs = make_inputs(batch, slots, torch.float32, seed=100 + batch * 10 + slots)
    gen = torch.Generator().manual_seed(7)
    uniform = torch.rand(batch, slots, VOCAB, generator=gen).clamp(1e-10, 1 - 1e-7)
    noise = -torch.log(-torch.log(uniform))
    temperature = torch.rand(batch, generator=gen) + 0.5
    temperature[0] = 0.0  # a greedy row among sampled ones
    tokens, confidence = markov_kernel.sampled_markov_draft(
        **inputs, temperature=temperature, gumbel_noise=noise
    )
    want_tokens, want_confidence = float64_loop(inputs, temperature, noise)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(confidence.double(), want_confidence, rtol=0, atol=1e-5)
    greedy_row = markov_kernel.greedy_markov_draft(**inputs)[0][0]
    assert torch.equal(tokens[0], greedy_row)


def test_ties_break_toward_lowest_index():
    """The Triton path promises torch.argmax's tie rule; the reference defines it."""
    inputs = make_inputs(2, 3, torch.float32, seed=0)
    inputs["markov_w2"] = torch.zeros(VOCAB, RANK)
    inputs["base_logits"] = torch.zeros(2, 3, VOCAB)
    inputs["base_logits"][:, :, [7, 3, 41]] = 1.0
    tokens, _ = markov_kernel.greedy_markov_draft(**inputs)
    assert torch.equal(tokens, torch.full((2, 3), 3))


def test_dispatcher_picks_torch_on_cpu():
    inputs = make_inputs(2, 3, torch.float32, seed=1)
    assert markov_kernel.pick_backend(inputs["base_logits"]) == "torch"
    got = markov_kernel.greedy_markov_draft(**inputs)
    want = markov_kernel.greedy_markov_draft_reference(**inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("batch", [1, 16, 17, 32, 64, 65, 128, 256])
def test_default_configs_suit_their_kernels(batch: int):
    """The persistent kernels publish keys; Gluon's programs are whole warpgroups."""
    for kernel in ("gluon", "stream", "k_loop"):
        config = markov_kernel.default_config(batch, kernel)
        if kernel == "k_loop":
            assert config.kernel == "k_loop"
            continue
        assert config.kernel in ("gluon", "stream") and config.atomic_argmax
        assert config.block_k == 256 and config.block_b >= min(batch, 64)
        if config.kernel == "gluon":
            assert config.block_b % 64 == 0 and config.num_warps == config.block_b // 16


def test_import_loads_no_heavy_module():
    """The overlay is imported at every interpreter start: torch must load lazily."""
    code = (
        "import sys, vllm_v4_patches.dspark.markov_kernel; "
        "print(sorted(m for m in ('torch', 'triton', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "[]"


def stand_in(**changes):  # noqa: ANN003, ANN201
    """The benchmark's stand-in draft (vLLM's draft classes' interface, small sizes)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from dspark_drafter_stage_gpu import stand_in_draft

    model = stand_in_draft(VOCAB, RANK, HIDDEN, torch.float32, "cpu")
    for path, value in changes.items():
        owner, _, name = path.rpartition(".")
        target = model
        for part in filter(None, owner.split(".")):
            target = getattr(target, part)
        setattr(target, name, value)
    return model


def test_the_drafter_takes_the_kernel_only_where_it_computes_what_the_loop_would():
    """Which loaded drafts the fused path serves (checked on CPU; the kernel itself and
    its equality with the loop run on the GPU, benchmarks/dspark_drafter_stage_gpu.py)."""
    from vllm_v4_patches.dspark import sampling

    weights = sampling.fusable_markov_weights(stand_in(), VOCAB)
    assert weights is not None and weights[1].shape == (VOCAB, RANK)
    padded = sampling.fusable_markov_weights(stand_in(), VOCAB - 2)
    assert padded[1].shape == (VOCAB - 2, RANK)  # a padded head is read up to the vocabulary
    assert sampling.fusable_markov_weights(stand_in(), VOCAB + 1) is None
    for change in (
        {"model.markov_head.kind": "gated"},
        {"draft_id_to_target_id": torch.zeros(VOCAB, dtype=torch.long)},
        {"model.markov_head.markov_w2.tp_size": 2},
        {"logits_processor": type("Scaled", (), {"scale": 0.5, "soft_cap": None})()},
        {"logits_processor": type("Capped", (), {"scale": 1.0, "soft_cap": 30.0})()},
        {"model.markov_head.markov_w2.quant_method": type("Fp8LinearMethod", (), {})()},
    ):
        assert sampling.fusable_markov_weights(stand_in(**change), VOCAB) is None, change


def test_the_drafter_stage_falls_back_to_the_loop_off_cuda(monkeypatch):
    from vllm_v4_patches.dspark import sampling

    model = stand_in()
    gen = torch.Generator().manual_seed(3)
    model.base_logits = torch.randn(2 * 4, VOCAB, generator=gen)
    hidden = torch.randn(2 * 4, HIDDEN, generator=gen)
    anchors = torch.tensor([3, 7])
    assert (
        sampling.fused_greedy_tokens(model, model.base_logits.view(2, 4, -1), anchors, hidden)
        is None
    )
    block = sampling.draft_with_markov_head(model, hidden, anchors, 4, None)
    inputs = {
        "base_logits": model.base_logits.view(2, 4, VOCAB),
        "anchor": anchors,
        "markov_w1": model.model.markov_head.markov_w1.weight,
        "markov_w2": model.model.markov_head.markov_w2.weight,
    }
    tokens = float64_loop(
        {**inputs, "hidden": hidden.view(2, 4, -1), "confidence_w": torch.zeros(HIDDEN + RANK)}
    )[0]
    assert torch.equal(block.tokens, tokens)
    monkeypatch.setenv(sampling.KERNEL_SETTING, "sometimes")
    assert sampling.kernel_choice() == "auto"
    monkeypatch.setenv(sampling.KERNEL_SETTING, " Torch ")
    assert sampling.kernel_choice() == "torch"


def test_anchors_outside_the_table_read_its_nearest_row():
    """vLLM's -1 placeholder (and any id past the table) as an anchor: drafted as
    the nearest row's id would be, where an unchecked gather faults on the GPU."""
    inputs = make_inputs(4, 3, torch.float32, seed=5)
    outside = {**inputs, "anchor": torch.tensor([-1, VOCAB + 3, 7, -5])}
    nearest = {**inputs, "anchor": torch.tensor([0, VOCAB - 1, 7, 0])}
    for draft in (markov_kernel.greedy_markov_draft, markov_kernel.greedy_markov_draft_reference):
        tokens, confidence = draft(**outside)
        expected_tokens, expected_confidence = draft(**nearest)
        assert torch.equal(tokens, expected_tokens)
        assert torch.equal(confidence, expected_confidence)
