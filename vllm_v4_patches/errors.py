"""Exceptions shared by the core and the patches (no dependencies)."""


class StrictModeError(RuntimeError):
    """A patch failed while ``VLLM_V4_PATCHES_STRICT`` is on; meant to propagate."""


class ProbeError(Exception):
    """A probe found the target but could not recognise its shape.

    Reported as outcome ``failed``: patching code we do not understand, or
    skipping it silently, would both be wrong.
    """
