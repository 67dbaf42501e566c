"""cbatch: offline LLM batch inference with continuous batching over a paged KV cache."""
