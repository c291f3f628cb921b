"""A DeepSeek-V4 target's taps for its DSpark draft, on releases whose V4 model
records none (0.20-0.24).

The V1 runner reads a drafter's taps through vLLM's EAGLE-3 interface: it asks the
target to record the hidden state entering each tapped layer and takes them as the
second value of the target's forward. V4 carries ``hc_mult`` residual streams; a
tap is those streams merged by the layer's mHC post-mix and averaged over the
streams (what vLLM 0.25+'s V4 forward records).

The tapped layers may run inside a model ``torch.compile`` traces (0.20-0.22
compile the NVIDIA ``DeepseekV4Model``; 0.23-0.24 capture CUDA graphs without it),
so each copies its tap into a buffer of its own, as
vLLM's V4 stashes its MTP hidden states: the copy is part of the compiled graph and
of its CUDA graphs, where a list the layer appended to would be a side effect that
vLLM's AOT compile drops. The target's forward, outside the compiled model, hands
the buffers' rows for this batch back beside the hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_v4_patches.dspark.v4_blocks import defers_post_mix, last_post_mix, mixed_streams
from vllm_v4_patches.patcher import split_receiver

TAP_BUFFER = "vllm_v4_tap_buffer"  # on a tapped decoder layer: ``[rows, hidden]``
TAP_POST_MIX = "vllm_v4_tap_post_mix"  # on a tapped decoder layer: its post-mix
TAPPED = "vllm_v4_tapped_layers"  # on the target: its tapped layers, in layer order


def merged_tap(layer: Any, output: Any) -> Any:
    """``[T, H]``: a layer's streams after its mHC post-mix (found when the taps were
    set, outside the trace), averaged."""
    return mixed_streams(layer, output, layer.__dict__[TAP_POST_MIX]).mean(dim=1)


def tap_after_layer(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``DeepseekV4DecoderLayer.forward`` (wrapped traceable): a tapped layer also
    copies its tap into its buffer's first rows."""
    output = wrapped(*args, **kwargs)
    layer, _, _ = split_receiver(instance, args)
    buffer = layer.__dict__.get(TAP_BUFFER)
    if buffer is not None:
        tap = merged_tap(layer, output)
        buffer[: tap.shape[0]].copy_(tap)
    return output


def forward_with_taps(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``DeepseekV4ForCausalLM.forward``: with taps set, the hidden states and this
    forward's taps (copies: the buffers are rewritten by the next forward), as the
    runner expects from an EAGLE-3 target."""
    import torch

    target, _, _ = split_receiver(instance, args)
    tapped = target.__dict__.get(TAPPED)
    if tapped is None:
        return wrapped(*args, **kwargs)
    hidden = wrapped(*args, **kwargs)
    if not torch.is_tensor(hidden):  # a pipeline stage before the last
        return hidden
    rows = hidden.shape[0]
    return hidden, [layer.__dict__[TAP_BUFFER][:rows].clone() for layer in tapped]


def set_tap_layers(model: Any, layers: tuple[int, ...], rows: int | None = None) -> None:
    """Tap the stream entering each layer in ``layers`` (the output of the layer
    before it), as vLLM's EAGLE-3 interface numbers them. ``rows``: the most tokens
    a forward takes, by default the engine's ``max_num_batched_tokens`` (the
    scheduler's budget, to which the runner sizes its own buffers). The buffers
    never grow: CUDA graphs captured after them keep writing where they were."""
    import torch

    rows = rows or engine_token_budget()
    embedding = model.model.embed_tokens.weight  # the activations' dtype and device
    tapped = []
    for index, layer in enumerate(model.model.layers):
        if index + 1 in layers:
            shape = (rows, layer.hidden_size)
            buffer = torch.zeros(shape, dtype=embedding.dtype, device=embedding.device)
            layer.__dict__[TAP_BUFFER] = buffer
            layer.__dict__[TAP_POST_MIX] = last_post_mix(layer) if defers_post_mix(layer) else None
            tapped.append(layer)
        else:
            layer.__dict__.pop(TAP_BUFFER, None)
            layer.__dict__.pop(TAP_POST_MIX, None)
    model.__dict__[TAPPED] = tapped


def engine_token_budget() -> int:
    """The engine's ``max_num_batched_tokens``: the runner sets taps while it loads
    the model, inside vLLM's current-config context."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        raise RuntimeError(
            "vllm_v4_patches: DeepSeek-V4 taps set outside an engine's model load "
            "(no current vLLM config to size them from)"
        )
    return config.scheduler_config.max_num_batched_tokens


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
