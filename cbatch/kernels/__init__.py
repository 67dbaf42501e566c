"""Triton kernels for the GPU path, imported as `cbatch.kernels`.

    store_kv            write this step's K/V into the paged cache (fp8 caches: scaled, saturated)
    norm_rope_store     per-head q/k RMSNorm + rotary + K/V store in one launch, on the packed qkv in place
    fused_sample        greedy / temperature sampling in one pass over the logits
    paged_attention     decode + chunked-prefill attention over the paged cache (optional split-KV)
    rms_norm            HF-Llama RMSNorm
    fused_add_rms_norm  residual add + RMSNorm in one pass
    apply_rotary        NeoX/HF rotary embedding, in place
    silu_and_mul        SwiGLU activation
    gelu_tanh_and_mul   GELU-tanh gated activation (Gemma)
    fused_moe           mixture-of-experts MLP: tokens sorted by expert, one grouped GEMM per projection
    fp8_linear          x @ W.T with W stored in FP8 and dequantized per tile (per-channel or block scales)
    w4a16_linear        x @ W.T with W packed 4/8-bit integers (AWQ, GPTQ, compressed-tensors), unpacked in registers
    decode_linear       x @ W.T for decode-sized batches (small-M tiles, split-K); start-up tuning picks it or cuBLAS
    mla_decode_attention  MLA decode attention in latent space over the paged latent cache (DeepSeek-V2/V3, Kimi K2)

Importing this package never needs a GPU (Triton imports on CPU). Where Triton itself is missing
(e.g. macOS), the names still import and raise ImportError when called, so the engine's CPU path keeps
working. Kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (set it before the
first import of triton).
"""

try:
    import triton as _triton  # probe only: the submodules below import it themselves

    del _triton
except ImportError as _err:  # pragma: no cover - exercised only where triton is absent
    _TRITON_IMPORT_ERROR = _err

    def _missing(name):
        def _fn(*args, **kwargs):
            raise ImportError(f"cbatch.kernels.{name} needs triton, which failed to import: {_TRITON_IMPORT_ERROR}")

        _fn.__name__ = name
        return _fn

    store_kv = _missing("store_kv")
    paged_attention = _missing("paged_attention")
    rms_norm = _missing("rms_norm")
    fused_add_rms_norm = _missing("fused_add_rms_norm")
    apply_rotary = _missing("apply_rotary")
    silu_and_mul = _missing("silu_and_mul")
    norm_rope_store = _missing("norm_rope_store")
    fused_sample = _missing("fused_sample")
    gelu_tanh_and_mul = _missing("gelu_tanh_and_mul")
    fused_moe = _missing("fused_moe")
    fp8_linear = _missing("fp8_linear")
    w4a16_linear = _missing("w4a16_linear")
    decode_linear = _missing("decode_linear")
    mla_decode_attention = _missing("mla_decode_attention")
    HAS_TRITON = False
else:
    from .activation import gelu_tanh_and_mul, silu_and_mul
    from .grouped_gemm import fp8_linear, fused_moe
    from .kv_store import store_kv
    from .w4a16 import w4a16_linear
    from .gemm import decode_linear
    from .mla_decode import mla_decode_attention
    from .paged_attention import paged_attention
    from .rmsnorm import fused_add_rms_norm, rms_norm
    from .rope_store import norm_rope_store
    from .rotary import apply_rotary
    from .sampler import fused_sample
    from ._utils import interpreting, patch_interpreter_scalars
    from .jit_stats import count_interpreted_launches

    if interpreting():
        patch_interpreter_scalars()  # triton 3.6 + NumPy >= 2.4 (see _utils)
        count_interpreted_launches()  # see jit_stats
    HAS_TRITON = True

__all__ = [
    "HAS_TRITON",
    "apply_rotary",
    "decode_linear",
    "fp8_linear",
    "fused_moe",
    "gelu_tanh_and_mul",
    "mla_decode_attention",
    "fused_add_rms_norm",
    "fused_sample",
    "norm_rope_store",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
    "w4a16_linear",
]
