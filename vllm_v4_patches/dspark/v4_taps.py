"""A DeepSeek-V4 target's taps for its DSpark draft, on releases whose V4 model
records none (0.20-0.24).

The V1 runner reads a drafter's taps through vLLM's EAGLE-3 interface: it asks the
target to record the hidden state entering each tapped layer and takes them as the
second value of the target's forward. V4 carries ``hc_mult`` residual streams; a
tap is those streams merged by the layer's mHC post-mix and averaged over the
streams (what vLLM 0.25+'s V4 forward records). Here each tapped decoder layer
appends its tap to a list its model holds, and the model's forward hands the list
back beside the hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_v4_patches.patcher import split_receiver

TAP_SINK = "vllm_v4_tap_sink"  # on a tapped decoder layer: the list its tap joins
TAPS = "vllm_v4_taps"  # on the target: this forward's taps, in layer order


def merged_tap(layer: Any, output: Any) -> Any:
    """``[T, H]``: a layer's streams after its mHC post-mix, averaged."""
    from vllm_v4_patches.dspark.v4_blocks import mixed_streams

    return mixed_streams(layer, output).mean(dim=1)


def tap_after_layer(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``DeepseekV4DecoderLayer.forward``: a tapped layer's output also joins its
    model's taps."""
    output = wrapped(*args, **kwargs)
    layer, _, _ = split_receiver(instance, args)
    sink = layer.__dict__.get(TAP_SINK)
    if sink is not None:
        sink.append(merged_tap(layer, output))
    return output


def forward_with_taps(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``DeepseekV4ForCausalLM.forward``: with taps set, the hidden states and the
    taps this forward recorded, as the runner expects from an EAGLE-3 target."""
    target, _, _ = split_receiver(instance, args)
    taps = target.__dict__.get(TAPS)
    if taps is None:
        return wrapped(*args, **kwargs)
    taps.clear()
    hidden = wrapped(*args, **kwargs)
    if not taps:  # a pipeline stage before the last hands on intermediate tensors
        return hidden
    recorded = list(taps)
    taps.clear()
    return hidden, recorded


def set_tap_layers(model: Any, layers: tuple[int, ...]) -> None:
    """Tap the stream entering each layer in ``layers`` (the output of the layer
    before it), as vLLM's EAGLE-3 interface numbers them."""
    taps: list = []
    model.__dict__[TAPS] = taps
    for index, layer in enumerate(model.model.layers):
        if index + 1 in layers:
            layer.__dict__[TAP_SINK] = taps
        else:
            layer.__dict__.pop(TAP_SINK, None)


def default_tap_layers(model: Any) -> tuple[int, ...]:
    count = len(model.model.layers)
    return (2, count // 2, count - 3)


TAP_INTERFACE: dict[str, Any] = {
    "supports_eagle3": True,
    "has_own_lm_head": False,
    "has_own_embed_tokens": False,
    "set_aux_hidden_state_layers": set_tap_layers,
    "get_eagle3_default_aux_hidden_state_layers": default_tap_layers,
}


def add_tap_interface(target_class: Any) -> Callable[[], None]:
    """Give the target class the EAGLE-3 members it lacks; returns the undo."""
    added = [name for name in TAP_INTERFACE if name not in vars(target_class)]
    for name in added:
        setattr(target_class, name, TAP_INTERFACE[name])

    def undo() -> None:
        for name in added:
            delattr(target_class, name)

    return undo
