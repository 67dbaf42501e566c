"""The names EngineConfig accepts live at the bottom (cbatch/config.py); the registries above use exactly them.
Backends are told apart by their capability flags, never by their names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import cbatch
from cbatch.config import ATTENTION_BACKENDS, POLICIES
from cbatch.engine.policy import POLICY_BY_NAME
from cbatch.model.backend import Backend, BackendUnavailable, backend_name, make_backend, registered

PACKAGE = Path(cbatch.__file__).parent
BACKEND_PACKAGE = PACKAGE / "model" / "backend"


def test_admission_policies_are_the_configs_names_default_first():
    assert tuple(POLICY_BY_NAME) == POLICIES


def test_each_backend_file_registers_its_name_and_the_config_accepts_exactly_those():
    # NAME_backend.py registers NAME: config.ATTENTION_BACKENDS, read from the file names, matches the registry
    assert ATTENTION_BACKENDS[0] == "auto"
    assert sorted(registered()) == sorted(ATTENTION_BACKENDS[1:])


def _protocol_members() -> set[str]:
    methods = {name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")}
    return set(Backend.__annotations__) | methods


@pytest.mark.parametrize("name", sorted(registered()))
def test_every_registered_backend_defines_every_protocol_member(name):
    backend = registered()[name].make()
    missing = sorted(member for member in _protocol_members() if not hasattr(backend, member))
    assert not missing, f"{name} lacks {', '.join(missing)}"
    assert backend.name == name
    flags = [member for member in Backend.__annotations__ if member != "name"]
    assert all(isinstance(getattr(backend, flag), bool) for flag in flags)


def test_auto_and_the_refusals_are_as_before():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert backend_name("auto", cuda) == "triton"
    assert backend_name("auto", cpu) in ("cpu", "torch")  # torch only where the CPU kernels cannot be built
    assert backend_name("torch", cuda) == "torch"
    with pytest.raises(BackendUnavailable, match="cpu runs on the CPU only; use triton"):
        make_backend("cpu", cuda)


def _tests_which_backend(node: ast.AST) -> bool:
    """A comparison, membership test or isinstance check that tells which backend something is: a backend's name
    (`backend.name`, `backend_name(...)`) against anything, a registered name against a backend expression, or
    an isinstance against a backend class."""
    names = set(registered())
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
        return ast.unparse(node.args[1]).endswith("Backend")
    if not isinstance(node, ast.Compare):
        return False
    operands = [node.left, *node.comparators]
    texts = [ast.unparse(operand) for operand in operands]
    if any(text.endswith(".name") and "backend" in text.lower() or text.startswith("backend_name(") for text in texts):
        return True
    strings = {c.value for operand in operands for c in ast.walk(operand) if isinstance(c, ast.Constant)}
    return bool(strings & names) and any("backend" in text.lower() for text in texts)


def test_no_module_outside_the_backends_compares_a_backends_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if BACKEND_PACKAGE in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _tests_which_backend(node):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "ask the backend's capability flags instead:\n" + "\n".join(found)


@pytest.mark.parametrize("code", [
    'backend.name == "triton"', 'self.backend.name != "torch"', 'model.backend.name in ("triton", "cpu")',
    'config.attention_backend == "triton"', 'backend_name(name, device) == "cpu"', "isinstance(b, TritonBackend)",
])
def test_the_name_check_catches_the_ways_to_compare(code):
    assert _tests_which_backend(ast.parse(code).body[0].value)


@pytest.mark.parametrize("code", ['device.type == "cuda"', 'config.attention_backend == "auto"',
                                  'model.backend.needs_warmup and device.type == "cpu"'])
def test_the_name_check_passes_what_is_no_name_test(code):
    assert not any(_tests_which_backend(node) for node in ast.walk(ast.parse(code)))
