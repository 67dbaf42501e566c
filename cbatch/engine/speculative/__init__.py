"""Speculative decoding without a second model, verified exactly (docs/speculative.md): draft sources (`ngram`: the
row's own tokens; `suffix`: the job's finished outputs and prompts) and the per-step choice of who drafts
(`speculator`). The scheduler asks for drafts and applies what the runner verified; nothing here touches tensors."""
from cbatch.engine.speculative.speculator import Speculator, StepCost

__all__ = ["Speculator", "StepCost"]
