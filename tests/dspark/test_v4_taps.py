"""A DeepSeek-V4 target's taps on releases whose V4 model records none
(``dspark.v4_taps``): vLLM's own EAGLE-3 check accepts the target once the members
are added (and not before), the tapped layers are the ones the interface numbers,
and the forward returns the taps in layer order, each the layer's streams after its
post-mix, averaged. The target and its decoder layers are stand-ins with V4's shapes
of return (the real ones need CUDA and TileLang): the layer returns 0.21+'s four
values and its ``hc_post`` (0.21-0.22's post-mix) adds the residual to the streams."""

from __future__ import annotations

import pytest
import torch
import wrapt

from vllm_v4_patches.dspark import v4_taps

HC, HIDDEN, TOKENS = 4, 8, 3


class Layer(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, hidden: torch.Tensor) -> tuple:
        out = hidden + self.index
        return out, torch.ones_like(out), None, None

    def hc_post(self, hidden, residual, post_mix, res_mix) -> torch.Tensor:
        return hidden + residual


class Inner(torch.nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(i) for i in range(count))

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
def wrapped(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(
        Layer, "forward", wrapt.FunctionWrapper(Layer.forward, v4_taps.tap_after_layer)
    )
    monkeypatch.setattr(
        Target, "forward", wrapt.FunctionWrapper(Target.forward, v4_taps.forward_with_taps)
    )
    undo = v4_taps.add_tap_interface(Target)
    yield undo
    undo()


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
    target.set_aux_hidden_state_layers((1, 3, 5))
    out, taps = target(hidden)
    # the stream entering layer k is layer k-1's output (the sum of 0..k-1), post-mixed
    # (+1) and averaged over the streams
    assert [float(t[0, 0]) for t in taps] == [0 + 1, (0 + 1 + 2) + 1, sum(range(5)) + 1]
    assert taps[0].shape == (TOKENS, HIDDEN)
    assert out.shape == (TOKENS, HIDDEN)
    _, again = target(hidden)
    assert len(again) == 3  # each forward's own taps, not accumulated


def test_the_default_layers_follow_vllms_rule(wrapped):
    assert Target(8).get_eagle3_default_aux_hidden_state_layers() == (2, 4, 5)


def test_a_forward_called_through_its_class_is_tapped_too(wrapped):
    """``Class.forward(obj, ...)`` (wrapt 2 hands the wrapper ``obj`` as its
    instance; the wrappers also take it from the arguments where it does not): the
    tap still goes to that layer's model."""
    target = Target(4)
    target.set_aux_hidden_state_layers((2,))
    layer = target.model.layers[1]
    taps = target.__dict__[v4_taps.TAPS]
    Layer.forward(layer, torch.zeros(TOKENS, HC, HIDDEN))
    assert len(taps) == 1 and float(taps[0][0, 0]) == 1 + 1
    out, recorded = Target.forward(target, torch.zeros(TOKENS, HC, HIDDEN))
    assert [float(t[0, 0]) for t in recorded] == [1 + 1]  # layer 1 of zeros, post-mixed
