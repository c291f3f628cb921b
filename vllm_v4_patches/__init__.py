"""vllm_v4_patches: guarded patches that fix and extend stock vLLM for DeepSeek-V4.

Importing this package must stay cheap (it happens at every interpreter start
through ``sitecustomize``): no third-party imports here.
"""

__version__ = "0.1.0"

# The patch modules, in the order they are reported. Each one carries its own
# record, probe and apply function; the core only ever sees this list.
PATCH_MODULES: tuple[str, ...] = ("vllm_v4_patches.embedding",)


def bootstrap() -> None:
    """Arm the overlay in this process (idempotent, never imports vLLM)."""
    from vllm_v4_patches._startup import arm

    arm()
