"""How many kernel variants the Triton JIT has compiled in this process.

Benchmarks print the count for their timed window: after the engine's warm-up it must not move (a
compile costs ~0.1-1 s, inside a step). On a GPU it is read off the JIT's own caches (one entry per
compiled specialisation, disk-cache hits included). Under TRITON_INTERPRET nothing compiles, so there
every launch of a cbatch kernel computes the key the JIT would compile for on a GPU (sm_90), with
Triton's own binder and the kernel's do_not_specialize list, and the count is the number of distinct
keys: a CPU test sees a step that would recompile on the GPU.

    from cbatch.kernels.jit_stats import compiled_variants
    before = compiled_variants(); ...timed work...; print(compiled_variants() - before)
"""

from __future__ import annotations

import importlib

from ._utils import interpreting

# every module of cbatch.kernels that defines a launched kernel (a @triton.jit function named *_kernel);
# tests/test_compile_count.py reads the package's sources and fails on one missing here
KERNEL_MODULES = ("activation", "gemm", "grouped_gemm", "kv_store", "lora", "mla_decode", "paged_attention", "rmsnorm",
                  "rope_store", "rotary", "sampler", "w4a16")
_interpreted_keys: dict[str, set[str]] = {}  # kernel name -> specialisation keys launched so far


def cbatch_kernels() -> dict[str, object]:
    """Every @triton.jit kernel of cbatch.kernels (name -> JITFunction, or InterpretedFunction)."""
    found = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"cbatch.kernels.{module_name}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "run"):
                found[f"{module_name}.{name}"] = obj
    return found


def compiled_variants() -> int:
    """Kernel variants compiled so far in this process (see the module docstring)."""
    if interpreting():
        return sum(len(keys) for keys in _interpreted_keys.values())
    total = 0
    for kernel in cbatch_kernels().values():
        for caches in getattr(kernel, "device_caches", {}).values():
            total += len(caches[0])  # (kernel_cache, ...) per device: one entry per compiled specialisation
    return total


def count_interpreted_launches() -> None:
    """Under TRITON_INTERPRET: wrap every cbatch kernel so that its launches record their specialisation key
    (idempotent; called when cbatch.kernels is imported)."""
    if not interpreting():
        return
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    for name, kernel in cbatch_kernels().items():
        if name in _interpreted_keys:
            continue
        options = {k: v for k, v in getattr(kernel, "kwargs", {}).items()
                   if k in ("do_not_specialize", "do_not_specialize_on_alignment")}
        jit = JITFunction(kernel.fn, **options)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        _interpreted_keys[name] = set()
        kernel.run = _counting_run(kernel.run, binder, _interpreted_keys[name])


def _counting_run(run, binder, keys: set[str]):
    def counted(*args, grid, warmup, **kwargs):
        _, specialization, options = binder(*args, **kwargs)
        keys.add(f"{specialization}{sorted(options.items())}")
        return run(*args, grid=grid, warmup=warmup, **kwargs)

    return counted


__all__ = ["cbatch_kernels", "compiled_variants", "count_interpreted_launches"]
