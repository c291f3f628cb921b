"""``Patcher.wrap(..., traced=True)``: wrappers for code that runs inside a model
``torch.compile`` traces (vLLM compiles its models' inner forward, ``fullgraph=True``).

Dynamo takes a wrapt proxy for the function it proxies and traces the original, so a
wrapt wrapper there is silently skipped once the model is compiled; the first test
shows that on the installed torch (its control), the rest that a traced wrapper is
run, compiled plainly and ahead of time (vLLM's default from torch 2.10), and keeps
the Patcher's promises: applied once, reverted exactly, unlinked from a chain in
either order."""

from __future__ import annotations

import pytest

from vllm_v4_patches.patcher import Patcher, RevertError, is_patched_by

torch = pytest.importorskip("torch")


class Layer(torch.nn.Module):
    def forward(self, x):
        return x + 1


class Model(torch.nn.Module):
    """A layer inside a model, as vLLM nests them (module level: an AOT artifact's
    guards name the model's class)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = Layer()

    def forward(self, x):
        return self.layer(x) * 10


STOCK_FORWARD = Layer.__dict__["forward"]


@pytest.fixture(autouse=True)
def stock_layer():
    yield
    Layer.forward = STOCK_FORWARD  # a test that failed midway leaves no wrapper


def stand_in_model():
    return Layer, Model()


def doubled(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) * 2


def compiled(model, how: str):
    torch._dynamo.reset()
    traced = torch.compile(model.forward, fullgraph=True, backend="eager")
    if how == "aot_compile":
        artifact = traced.aot_compile(((torch.zeros(2),), {}))
        return lambda x: artifact(model, x)
    return traced


@pytest.mark.parametrize("traced, compiled_result", [(False, 10.0), (True, 20.0)])
def test_dynamo_skips_a_wrapt_wrapper_and_runs_a_traced_one(traced, compiled_result):
    layer_class, model = stand_in_model()
    patcher = Patcher("synthetic")
    patcher.wrap(layer_class, "forward", doubled, traced=traced)
    x = torch.zeros(2)
    assert model(x).tolist() == [20.0, 20.0]  # eager runs either wrapper
    assert compiled(model, "compile")(x).tolist() == [compiled_result] * 2
    patcher.revert()


@pytest.mark.parametrize("how", ["compile", "aot_compile"])
def test_a_traced_wrapper_runs_inside_the_compiled_model(how):
    layer_class, model = stand_in_model()
    patcher = Patcher("synthetic")
    patcher.wrap(layer_class, "forward", doubled, traced=True)
    assert compiled(model, how)(torch.ones(2)).tolist() == [40.0, 40.0]
    patcher.revert()


def test_a_traced_wrapper_is_handed_the_receiver_first_and_applies_once():
    layer_class, model = stand_in_model()
    original = layer_class.__dict__["forward"]
    seen = []

    def spy(wrapped, instance, args, kwargs):
        seen.append((instance, args[0]))
        return wrapped(*args, **kwargs)

    patcher = Patcher("synthetic")
    first = patcher.wrap(layer_class, "forward", spy, traced=True)
    assert patcher.wrap(layer_class, "forward", spy, traced=True) is first
    assert is_patched_by(first, "synthetic") and first.__wrapped__ is original
    model(torch.zeros(1))
    layer_class.forward(model.layer, torch.zeros(1))  # through the class
    assert seen == [(None, model.layer)] * 2
    patcher.revert()
    assert layer_class.__dict__["forward"] is original


@pytest.mark.parametrize("inner_first", [True, False])
def test_two_traced_patches_on_one_method_revert_in_either_order(inner_first):
    layer_class, model = stand_in_model()
    original = layer_class.__dict__["forward"]
    inner, outer = Patcher("inner"), Patcher("outer")
    inner.wrap(layer_class, "forward", doubled, traced=True)
    outer.wrap(layer_class, "forward", lambda w, i, a, k: w(*a, **k) + 5, traced=True)
    x = torch.zeros(2)
    assert model(x).tolist() == [(1 * 2 + 5) * 10] * 2
    first, second = (inner, outer) if inner_first else (outer, inner)
    first.revert()
    left = 1 + 5 if inner_first else 1 * 2
    assert model(x).tolist() == [left * 10] * 2
    assert compiled(model, "compile")(x).tolist() == [left * 10] * 2
    second.revert()
    assert layer_class.__dict__["forward"] is original


def test_a_traced_wrapper_replaced_by_someone_else_is_not_reverted_over():
    layer_class, _ = stand_in_model()
    patcher = Patcher("synthetic")
    patcher.wrap(layer_class, "forward", doubled, traced=True)

    def someone_elses(self, x):
        return x

    layer_class.forward = someone_elses
    with pytest.raises(RevertError, match="replaced after"):
        patcher.revert()
    assert layer_class.__dict__["forward"] is someone_elses


def test_traced_wrapping_needs_a_plain_function():
    class Owner:
        @staticmethod
        def helper():
            return 1

    with pytest.raises(TypeError, match="not a plain function"):
        Patcher("synthetic").wrap(Owner, "helper", doubled, traced=True)
