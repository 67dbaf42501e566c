"""Triton kernels for the GPU path, imported as `cbatch.kernels`.

    store_kv            write this step's K/V into the paged cache
    paged_attention     decode + chunked-prefill attention over the paged cache (optional split-KV)

Importing this package never needs a GPU (Triton imports on CPU). Where Triton itself is missing
(e.g. macOS), the names still import and raise ImportError when called, so the engine's CPU path keeps
working. Kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (set it before the
first import of triton).
"""

try:
    import triton  # noqa: F401
except ImportError as _err:  # pragma: no cover - exercised only where triton is absent
    _TRITON_IMPORT_ERROR = _err

    def _missing(name):
        def _fn(*args, **kwargs):
            raise ImportError(f"cbatch.kernels.{name} needs triton, which failed to import: {_TRITON_IMPORT_ERROR}")

        _fn.__name__ = name
        return _fn

    store_kv = _missing("store_kv")
    paged_attention = _missing("paged_attention")
    HAS_TRITON = False
else:
    from .kv_store import store_kv
    from .paged_attention import paged_attention

    HAS_TRITON = True

__all__ = [
    "HAS_TRITON",
    "paged_attention",
    "store_kv",
]
