"""Patch ``swa_prefix``: prefix-cache hits for sliding-window KV cache groups that
take the EAGLE lookahead (a drafter on DeepSeek-V4), on vLLM 0.22.x."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_v4_patches.registry import PatchRecord, ProbeResult, Target
from vllm_v4_patches.sources import SourceReader, names_in, read_method

if TYPE_CHECKING:
    from vllm_v4_patches.patcher import Patcher

COORDINATOR_MODULE = "vllm.v1.core.kv_cache_coordinator"
COORDINATOR = "HybridKVCacheCoordinator"
GROUPING = "verify_and_split_kv_cache_groups"
MANAGER_MODULE = "vllm.v1.core.single_type_kv_cache_manager"
MANAGER = "SlidingWindowManager"
MASK = "_cache_block_mask"
# the mask's EAGLE-aware successor (vLLM 0.23)
EAGLE_AWARE_MASK = "reachable_block_mask"
# set on a sliding-window manager whose lookups take the EAGLE lookahead block
DENSE_MARK = "_vllm_v4_swa_prefix_dense"

RECORD = PatchRecord(
    id="swa_prefix",
    toggle="VLLM_V4_PATCH_SWA_PREFIX",
    summary="Prefix caching: sliding-window groups with the EAGLE lookahead cache every "
    "block on vLLM 0.22.x.",
    why=(
        "vLLM 0.22 caches only the sliding-window blocks a hit can end on: with hits "
        "aligned to the lcm of the groups' block sizes, each aligned segment keeps its "
        "last window's blocks (SlidingWindowManager._cache_block_mask). A group that "
        "takes the EAGLE lookahead (the speculative methods vLLM counts as EAGLE, "
        "dflash among them, which the overlay's DSpark route on V1 presents itself "
        "as) looks for one block more and then drops it, so its lookup must end on "
        "the first block of the next segment, which that mask never caches. "
        "DeepSeek-V4 keeps every layer's window in such groups (block 64, window 128, "
        "hits aligned to 256 tokens): with a drafter on, no request ever hits the "
        "prefix cache. Measured on an H100 with 0.22.1: behind an 815-token shared "
        "prefix, V4 without speculation hit 8,448 of 9,048 tokens, the overlay's "
        "DSpark 0 of 17,286; 0.20.2 and 0.24.0 hit 6,144 and 6,656 tokens there."
    ),
    how=(
        "Wrap HybridKVCacheCoordinator.verify_and_split_kv_cache_groups, the "
        "coordinator's last step of set-up: mark the sliding-window managers of every "
        "attention group that takes the EAGLE lookahead. Wrap "
        "SlidingWindowManager._cache_block_mask: a marked manager caches every full "
        "block (as vLLM 0.21 did for all groups); others keep the mask. Only which "
        "computed blocks stay findable changes; a block is cached only once computed, "
        "as before."
    ),
    upstream=(
        "vLLM 0.23.0 (#44082): the mask keeps the EAGLE/MTP lookahead block",
        "vLLM 0.22.0 (#42258): the sliding-window cache mask itself",
        "vLLM #42784 (closed): the same remedy, no mask for EAGLE groups' managers",
    ),
    removal_plan=(
        "0.23.0 and later report not-needed by the probe (the mask is EAGLE-aware "
        "there); drop the patch with support for 0.22.x."
    ),
    targets=(
        Target(COORDINATOR_MODULE, f"{COORDINATOR}.{GROUPING}"),
        Target(MANAGER_MODULE, f"{MANAGER}.{MASK}"),
    ),
    vllm_versions=">=0.22.0",
)


# -- probe ------------------------------------------------------------------


def probe(source: SourceReader) -> ProbeResult:
    managers = source.read(MANAGER_MODULE)
    if managers is None or source.read(COORDINATOR_MODULE) is None:
        return ProbeResult("absent", f"{MANAGER_MODULE} or {COORDINATOR_MODULE} does not exist")
    mask = read_method(source, MANAGER_MODULE, MANAGER, MASK)
    if mask is None and EAGLE_AWARE_MASK in managers:
        return ProbeResult("not-needed", f"{EAGLE_AWARE_MASK} keeps the EAGLE lookahead block")
    if mask is None:
        return ProbeResult("not-needed", f"{MANAGER} has no {MASK}: every full block is cached")
    if any("eagle" in name.lower() for name in names_in(mask)):
        return ProbeResult("not-needed", f"{MANAGER}.{MASK} accounts for the EAGLE lookahead")
    grouping = read_method(source, COORDINATOR_MODULE, COORDINATOR, GROUPING)
    if grouping is None or "eagle_attn_group_indices" not in names_in(grouping):
        return ProbeResult(
            "absent", f"{COORDINATOR}.{GROUPING} does not name its EAGLE attention groups"
        )
    return ProbeResult(
        "needed", f"{MANAGER}.{MASK} drops the block an EAGLE group's lookup ends on"
    )


# -- apply ------------------------------------------------------------------


def apply(patcher: Patcher, found: ProbeResult) -> str:
    marked = patcher.wrap_when_imported(
        COORDINATOR_MODULE, COORDINATOR, GROUPING, mark_lookahead_groups
    )
    masked = patcher.wrap_when_imported(MANAGER_MODULE, MANAGER, MASK, dense_when_marked)
    return f"{marked} {COORDINATOR}.{GROUPING}; {masked} {MANAGER}.{MASK}"


def mark_lookahead_groups(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    for index in instance.eagle_attn_group_indices:
        _spec, group_ids, _manager_class = instance.attention_groups[index]
        for group_id in group_ids:
            manager = instance.single_type_managers[group_id]
            if hasattr(manager, "sliding_window"):
                setattr(manager, DENSE_MARK, True)
    return result


def dense_when_marked(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if getattr(instance, DENSE_MARK, False):
        return None  # the manager caches every full block
    return wrapped(*args, **kwargs)
