"""LoRA adapters per row (docs/lora.md): PEFT folders read and checked (`adapter`), the job's adapters by name
(`registry`), their slots and per-step deltas in the model (`runtime`, `ops`). Layered between model/ and
engine/: it imports model/ only; the scheduler's side (at most --max-loras adapters per step, admission grouped by
adapter) is engine/adapter_admission.py."""
