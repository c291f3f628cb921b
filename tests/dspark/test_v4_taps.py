"""A DeepSeek-V4 target's taps on releases whose V4 model records none
(``dspark.v4_taps``): vLLM's own EAGLE-3 check accepts the target once the members
are added (and not before), the tapped layers are the ones the interface numbers,
and the forward returns the taps in layer order, each the layer's streams after its
post-mix, averaged, also when ``torch.compile`` traces the model the layers run in
(plain and AOT, as vLLM 0.22 compiles on torch 2.10+). The target and its decoder
layers are stand-ins with V4's shapes of return (the real ones need CUDA and
TileLang): the layer returns 0.21+'s four values and its ``hc_post`` (0.21-0.22's
post-mix) adds the residual to the streams. The wrappers install through the
overlay's Patcher, as the patch installs them."""

from __future__ import annotations

import pytest
import torch

from vllm_v4_patches.dspark import v4_taps
from vllm_v4_patches.patcher import Patcher

HC, HIDDEN, TOKENS, ROWS = 4, 8, 3, 16


class Layer(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.hidden_size = HIDDEN

    def forward(self, hidden: torch.Tensor, post_mix=None) -> tuple:
        out = hidden + self.index
        return out, torch.ones_like(out), None, None

    def hc_post(self, hidden, residual, post_mix, res_mix) -> torch.Tensor:
        return hidden + residual


class Inner(torch.nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(i) for i in range(count))
        self.embed_tokens = torch.nn.Embedding(4, HIDDEN)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)[0]
        return hidden.mean(dim=1)


class Target(torch.nn.Module):
    def __init__(self, count: int = 6) -> None:
        super().__init__()
        self.model = Inner(count)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model(hidden)


@pytest.fixture
def wrapped():
    patcher = Patcher("dspark")
    patcher.wrap(Layer, "forward", v4_taps.tap_after_layer, traced=True)
    patcher.wrap(Target, "forward", v4_taps.forward_with_taps)
    undo = v4_taps.add_tap_interface(Target)
    yield patcher
    undo()
    patcher.revert()


def tapped(target: Target, layers: tuple[int, ...]) -> Target:
    v4_taps.set_tap_layers(target, layers, rows=ROWS)
    return target


def test_vllms_eagle3_check_accepts_the_target_only_with_the_members():
    from vllm.model_executor.models.interfaces import supports_eagle3

    assert not supports_eagle3(Target())
    undo = v4_taps.add_tap_interface(Target)
    try:
        assert supports_eagle3(Target())
    finally:
        undo()
    assert not supports_eagle3(Target()) and "supports_eagle3" not in vars(Target)


def test_the_stream_entering_each_tapped_layer_comes_back_in_layer_order(wrapped):
    target = Target()
    hidden = torch.zeros(TOKENS, HC, HIDDEN)
    assert torch.is_tensor(target(hidden))  # no taps asked for: the forward as it was
    out, taps = tapped(target, (1, 3, 5))(hidden)
    # the stream entering layer k is layer k-1's output (the sum of 0..k-1), post-mixed
    # (+1) and averaged over the streams
    assert [float(t[0, 0]) for t in taps] == [0 + 1, (0 + 1 + 2) + 1, sum(range(5)) + 1]
    assert taps[0].shape == (TOKENS, HIDDEN)
    assert out.shape == (TOKENS, HIDDEN)
    _, again = target(hidden + 1)
    assert len(again) == 3 and float(again[0][0, 0]) == 1 + 1  # this forward's own
    assert float(taps[0][0, 0]) == 0 + 1  # copies: the next forward leaves them be


@pytest.mark.parametrize("how", ["compile", "aot_compile"])
def test_taps_come_back_from_a_compiled_model(wrapped, how):
    """vLLM compiles the inner model with ``fullgraph=True`` (AOT on torch 2.10+) and
    the tapped layers run inside it: their taps must reach the target's forward
    outside it, batch after batch, at the batch's own size."""
    target = tapped(Target(), (1, 3, 5))
    inner = target.model
    torch._dynamo.reset()
    traced = torch.compile(inner.forward, fullgraph=True, backend="aot_eager", dynamic=True)
    if how == "aot_compile":
        sample = torch.zeros(TOKENS, HC, HIDDEN)
        artifact = traced.aot_compile(((sample,), {}))
        inner.forward = lambda hidden: artifact(inner, hidden)
    else:
        inner.forward = traced
    for tokens, start in ((TOKENS, 0.0), (5, 2.0)):
        out, taps = target(torch.full((tokens, HC, HIDDEN), start))
        expected = [start + 0 + 1, start + (0 + 1 + 2) + 1, start + sum(range(5)) + 1]
        assert [float(t[0, 0]) for t in taps] == expected
        assert [t.shape for t in taps] == [(tokens, HIDDEN)] * 3 and out.shape == (tokens, HIDDEN)


def test_the_taps_are_sized_from_the_engines_token_budget(wrapped):
    from vllm.config import SchedulerConfig, VllmConfig, set_current_vllm_config

    target = Target()
    with pytest.raises(RuntimeError, match="outside an engine's model load"):
        target.set_aux_hidden_state_layers((1,))
    scheduler = SchedulerConfig(
        max_num_batched_tokens=256, max_num_seqs=4, max_model_len=256, is_encoder_decoder=False
    )
    with set_current_vllm_config(VllmConfig(scheduler_config=scheduler)):
        target.set_aux_hidden_state_layers((1,))
    buffer = target.model.layers[0].__dict__[v4_taps.TAP_BUFFER]
    assert buffer.shape == (256, HIDDEN) and buffer.dtype == target.model.embed_tokens.weight.dtype


def test_the_default_layers_follow_vllms_rule(wrapped):
    assert Target(8).get_eagle3_default_aux_hidden_state_layers() == (2, 4, 5)


def test_a_forward_called_through_its_class_is_tapped_too(wrapped):
    """``Class.forward(obj, ...)`` (wrapt 2 hands the wrapper ``obj`` as its
    instance; the wrappers also take it from the arguments where it does not): the
    tap still goes to that layer's model."""
    target = tapped(Target(4), (2,))
    layer = target.model.layers[1]
    Layer.forward(layer, torch.zeros(TOKENS, HC, HIDDEN))
    assert float(layer.__dict__[v4_taps.TAP_BUFFER][0, 0]) == 1 + 1
    out, recorded = Target.forward(target, torch.zeros(TOKENS, HC, HIDDEN))
    assert [float(t[0, 0]) for t in recorded] == [1 + 1]  # layer 1 of zeros, post-mixed
