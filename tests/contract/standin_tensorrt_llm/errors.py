"""STAND-IN for `tensorrt_llm.executor.RequestError` (tests only)."""


class RequestError(RuntimeError):
    """Raised while iterating a RequestOutput whose request failed in the executor."""
