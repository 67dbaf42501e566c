"""The names EngineConfig accepts live at the bottom (cbatch/config.py); the registries above use exactly them."""
from __future__ import annotations

from cbatch.config import POLICIES
from cbatch.engine.policy import POLICY_BY_NAME


def test_admission_policies_are_the_configs_names_default_first():
    assert tuple(POLICY_BY_NAME) == POLICIES
