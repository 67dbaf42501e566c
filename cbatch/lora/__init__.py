"""LoRA adapters per row (docs/lora.md): PEFT folders read and checked (`adapter`), the job's adapters by name
(`registry`), their slots and per-step deltas in the model (`runtime`, `ops`), and the scheduler's limit of
adapters per step with admission grouped by adapter (`admission`)."""
