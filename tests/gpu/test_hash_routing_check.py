"""The matrix's routing premise (``tools/gpu/hash_routing_probe.py`` and the suite's
``routes_alone_as_in_batch``), run here on the CPU. vLLM's routing kernel needs CUDA,
so two stand-in kernels take its place: one that routes every token on its own, and
one that divides a token's weights by a sum over its warp's tokens (16 a warp at 8
float32 experts, one at 128 and more), the arithmetic read in vLLM 0.20's
``topk_softplus_sqrt_kernels.cu``. The probe must see the second and not the first,
and the check must judge each against the expert count the matrix serves on the
release."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))

import hash_routing_probe as probe  # noqa: E402
from test_v4_matrix_model import rows_per_warp  # noqa: E402  the kernel's arithmetic

import suite  # noqa: E402

CHECK = suite.CHECKS[
    "v4 matrix: the matrix's model routes a token alone as in a batch (float32 router logits)"
]


class PerToken:
    """Each token's experts and weights from its own scores alone."""

    def topk_hash_softplus_sqrt(self, weights, ids, _, logits, renorm, scale, bias, tokens, table):
        assert renorm
        scores = torch.nn.functional.softplus(logits.float()).sqrt()
        if table is not None:
            chosen_ids = table[tokens.long()].long()
        else:
            chosen_ids = (scores + bias).topk(ids.shape[1], dim=-1).indices
        chosen = scores.gather(-1, chosen_ids)
        weights.copy_(self.normalise(chosen) * scale)
        ids.copy_(chosen_ids.int())

    def normalise(self, chosen: torch.Tensor) -> torch.Tensor:
        return chosen / chosen.sum(-1, keepdim=True)


class WarpSum(PerToken):
    """The weights divided by a sum over every token the warp holds."""

    experts = 0

    def topk_hash_softplus_sqrt(self, weights, ids, token_expert, logits, *rest):
        self.experts = logits.shape[1]
        super().topk_hash_softplus_sqrt(weights, ids, token_expert, logits, *rest)

    def normalise(self, chosen: torch.Tensor) -> torch.Tensor:
        warp = torch.arange(len(chosen)) // rows_per_warp(self.experts)
        sums = torch.zeros(int(warp[-1]) + 1).index_add_(0, warp, chosen.sum(-1))
        return chosen / sums[warp][:, None]


def verdict(kernel, version: str) -> tuple[bool, str]:
    cases = probe.all_cases(kernel, device="cpu")
    result = {"vllm": version, "device": "cpu", "cases": cases}
    return CHECK({"v4-hash-routing": suite.Outcome(result, None, "", 1.0, 0)})


@pytest.mark.parametrize("version", ["0.20.2", "0.24.0"])
def test_a_kernel_that_routes_each_token_alone_passes(version):
    ok, figure = verdict(PerToken(), version)
    assert ok, figure
    assert "alone-vs-batch 0," in figure


def test_the_warp_sum_is_seen_at_8_experts_and_not_at_128():
    cases = {
        (c["experts"], c["hash_layer"], c["logits"]): c for c in probe.all_cases(WarpSum(), "cpu")
    }
    for hashed in (True, False):
        assert cases[(8, hashed, "float32")]["batch_vs_alone"] > 0.1
        assert cases[(128, hashed, "float32")]["batch_vs_alone"] <= suite.ROUTING_TOLERANCE
        assert cases[(8, hashed, "float32")]["alone_vs_reference"] <= suite.ROUTING_TOLERANCE


def test_the_check_judges_the_model_the_matrix_serves_on_the_release():
    assert verdict(WarpSum(), "0.20.2")[0]  # 128 experts below 0.21: one token a warp
    ok, figure = verdict(WarpSum(), "0.24.0")  # 8 experts from 0.21
    assert not ok
    assert figure.startswith("matrix model 8 experts (0.24.0)")


def test_a_probe_without_the_models_cases_is_missing():
    result = {"vllm": "0.20.2", "device": "cpu", "cases": probe.all_cases(PerToken(), "cpu")}
    result["cases"] = [c for c in result["cases"] if c["experts"] != 128]
    with pytest.raises(suite.Missing):
        CHECK({"v4-hash-routing": suite.Outcome(result, None, "", 1.0, 0)})
    with pytest.raises(suite.NotRun):
        CHECK({})
