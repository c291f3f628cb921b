"""The ``embedding`` patch against the installed vLLM's real VocabParallelEmbedding."""

from __future__ import annotations

import sys
import textwrap

import pytest

from conftest import REPO
from vllm_v4_patches import embedding
from vllm_v4_patches.errors import ProbeError
from vllm_v4_patches.patcher import Patcher
from vllm_v4_patches.sources import InstalledSource, TreeSource

sys.path.insert(0, str(REPO / "tools" / "gpu"))

VOCAB = 128  # a multiple of vLLM's padding (64), so VOCAB + 3 is outside the table
HIDDEN = 32


@pytest.fixture(scope="module")
def layer():
    pytest.importorskip("torch")
    from embedding_fault import tp1_embedding

    with tp1_embedding(VOCAB, HIDDEN, 29517) as module:
        yield module


@pytest.fixture
def patched():
    found = embedding.probe(InstalledSource())
    patcher = Patcher("embedding")
    embedding.apply(patcher, found)
    yield patcher
    patcher.revert()


def test_probe_finds_the_unmasked_lookup_in_the_installed_vllm():
    found = embedding.probe(InstalledSource())
    assert found.verdict == "needed"
    assert found.variant == "forward"  # 0.20+ shape; 0.29+ uses the early return
    assert "early-return form" in found.detail


def test_stock_raises_on_out_of_range_ids(layer):
    import torch

    assert layer.tp_size == 1 and layer.num_embeddings_per_partition == VOCAB
    with pytest.raises(IndexError):
        layer(torch.tensor([-1, 5, VOCAB + 3]))


def test_patched_zeroes_invalid_rows_and_keeps_valid_rows_bit_identical(layer, patched):
    import torch

    ids = torch.tensor([-1, 5, VOCAB + 3, 0, VOCAB - 1])
    out = layer(ids)
    assert out.shape == (5, HIDDEN)
    assert torch.equal(out[0], torch.zeros(HIDDEN)) and torch.equal(out[2], torch.zeros(HIDDEN))
    for row, token in ((1, 5), (3, 0), (4, VOCAB - 1)):
        assert torch.equal(out[row], layer.weight[token])
    batch = torch.tensor([[3, -1], [VOCAB + 7, 9]])  # 2-D input keeps its shape
    out2 = layer(batch)
    assert out2.shape == (2, 2, HIDDEN)
    assert torch.equal(out2[0, 0], layer.weight[3]) and torch.equal(out2[1, 1], layer.weight[9])
    assert not out2[0, 1].any() and not out2[1, 0].any()


def test_patched_method_called_through_the_class_behaves_the_same(layer, patched):
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    ids = torch.tensor([-1, 5])
    assert torch.equal(VocabParallelEmbedding.forward(layer, ids), layer(ids))


def test_valid_ids_give_the_same_bits_as_stock(layer):
    import torch

    ids = torch.randint(0, VOCAB, (257,), generator=torch.Generator().manual_seed(1))
    stock = layer(ids)
    patcher = Patcher("embedding")
    embedding.apply(patcher, embedding.probe(InstalledSource()))
    try:
        assert torch.equal(layer(ids), stock)
    finally:
        patcher.revert()


def test_revert_restores_the_stock_method(layer):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    stock = VocabParallelEmbedding.__dict__["forward"]
    patcher = Patcher("embedding")
    embedding.apply(patcher, embedding.probe(InstalledSource()))
    embedding.apply(patcher, embedding.probe(InstalledSource()))  # idempotent
    assert VocabParallelEmbedding.__dict__["forward"].__wrapped__ is stock
    patcher.revert()
    assert VocabParallelEmbedding.__dict__["forward"] is stock


def test_patched_forward_compiles_as_one_graph(layer, patched):
    """fullgraph=True raises on any graph break, the overlay's included."""
    import torch

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager", dynamic=False)
    ids = torch.tensor([-1, 5, VOCAB + 3, 7])
    out = compiled(ids)
    assert torch.equal(out[1], layer.weight[5]) and not out[0].any() and not out[2].any()
    explanation = torch._dynamo.explain(layer)(ids)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_patched_lookup_runs_inside_a_compiled_model(layer, patched):
    """vLLM compiles the model around the embedding, not the embedding alone; a
    wrapper Dynamo skipped there would leave stock's lookup in the compiled graph."""
    import torch
    from embedding_fault import compiled_lookup

    torch._dynamo.reset()
    out = compiled_lookup(layer, backend="eager")(torch.tensor([-1, 5, VOCAB + 3, 7]))
    assert torch.equal(out[1], layer.weight[5]) and torch.equal(out[3], layer.weight[7])
    assert not out[0].any() and not out[2].any()


def test_parallel_lm_head_is_not_touched(patched):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    assert "forward" in ParallelLMHead.__dict__  # overrides (and raises), so stays stock


# -- the probe on the other source shapes vLLM has had --------------------

_INIT = """
    def __init__(self, num_embeddings, embedding_dim):
        self.num_embeddings_per_partition = num_embeddings
"""

SHAPES = {
    # 0.20-0.28: forward with the tp_size > 1 mask and an unmasked else branch
    "else-form forward": """
class VocabParallelEmbedding(PluggableLayer):{init}
    def forward(self, input_):
        if self.tp_size > 1:
            masked_input, input_mask = get_masked_input_and_mask(input_, 0, 1, 0, 0, 0)
        else:
            masked_input = input_
        output_parallel = self.quant_method.embedding(self, masked_input.long())
        return output_parallel
""",
    # 0.10.2-0.19.x: CustomOp, logic in forward_native, no forward on the class
    "custom-op forward_native": """
class VocabParallelEmbedding(CustomOp):{init}
    def forward_native(self, input_):
        if self.tp_size > 1:
            masked_input, input_mask = get_masked_input_and_mask(input_, 0, 1, 0, 0, 0)
        else:
            masked_input = input_
        return self.quant_method.embedding(self, masked_input.long())

    def forward_cuda(self, input_):
        return self.forward_native(input_)
""",
    # a plausible upstream fix (#53977): the tp_size 1 branch masks too
    "fixed upstream": """
class VocabParallelEmbedding(PluggableLayer):{init}
    def forward(self, input_):
        if self.tp_size == 1:
            masked_input, input_mask = get_masked_input_and_mask(input_, 0, 1, 0, 0, 0)
            out = self.quant_method.embedding(self, masked_input.long())
            return out.masked_fill_(input_mask.unsqueeze(-1), 0)
        return self.quant_method.embedding(self, input_.long())
""",
    "unrecognised": """
class VocabParallelEmbedding(PluggableLayer):{init}
    def forward(self, input_):
        return lookup_somehow(self, input_)
""",
    "no class": "class SomethingElse:\n    pass\n",
}


def _tree(tmp_path, body: str) -> TreeSource:
    path = tmp_path / "vllm" / "model_executor" / "layers"
    path.mkdir(parents=True)
    (path / "vocab_parallel_embedding.py").write_text(
        textwrap.dedent(body).format(init=textwrap.indent(_INIT, ""))
    )
    return TreeSource(str(tmp_path))


@pytest.mark.parametrize(
    ("shape", "verdict", "variant"),
    [
        ("else-form forward", "needed", "forward"),
        ("custom-op forward_native", "needed", "forward_native"),
        ("fixed upstream", "not-needed", None),
        ("no class", "absent", None),
    ],
)
def test_probe_on_each_source_shape(tmp_path, shape, verdict, variant):
    found = embedding.probe(_tree(tmp_path, SHAPES[shape]))
    assert (found.verdict, found.variant) == (verdict, variant)


def test_probe_refuses_an_unrecognised_shape(tmp_path):
    with pytest.raises(ProbeError, match="no recognised tp_size 1 lookup"):
        embedding.probe(_tree(tmp_path, SHAPES["unrecognised"]))


def test_probe_reports_a_missing_module_as_absent(tmp_path):
    assert embedding.probe(TreeSource(str(tmp_path))).verdict == "absent"
