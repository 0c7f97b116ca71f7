"""Every tensor mori creates names its device, and every floating-point one its dtype: a program
that calls ``torch.set_default_device("cuda")`` and ``torch.set_default_dtype(torch.bfloat16)``
(DeepEP's examples do) must not turn mori's host tensors into GPU tensors (``pin_memory=True``
then fails with "Only dense CPU tensors can be pinned"), place a GPU tensor on the wrong device,
or compute in bf16 what mori means as fp32. Checked on the source, so it covers code paths the
CPU tests cannot run. (``mori bench`` runs in its own process, where no user default applies:
only the device rule holds there.)"""

from __future__ import annotations

import ast
import pathlib

import pytest

# torch functions that create a tensor on the default device unless given `device=`.
FACTORIES = {
    "arange", "as_tensor", "empty", "empty_strided", "eye", "full", "linspace", "ones", "rand", "randint", "randn",
    "randperm", "tensor", "zeros",
}
# factories whose result takes the default (floating-point) dtype unless given `dtype=`.
FLOAT_FACTORIES = {"empty", "empty_strided", "eye", "full", "linspace", "ones", "rand", "randn", "zeros"}
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "python" / "mori"


def factory_calls_without_device(source: str, *, dtype_too: bool = False) -> list[tuple[int, str]]:
    """(line, name) of every ``torch.<factory>(...)`` call in ``source`` without ``device=`` (and,
    with ``dtype_too``, every floating-point factory without ``dtype=``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Name) and owner.id == "torch" and node.func.attr in FACTORIES:
            given = {k.arg for k in node.keywords}
            if None in given:  # **kwargs: cannot tell
                continue
            if "device" not in given:
                found.append((node.lineno, f"torch.{node.func.attr}(...) without device="))
            elif dtype_too and node.func.attr in FLOAT_FACTORIES and "dtype" not in given:
                found.append((node.lineno, f"torch.{node.func.attr}(...) without dtype="))
    return found


def test_the_check_sees_a_missing_device():
    src = "import torch\na = torch.zeros(3, dtype=torch.int32, pin_memory=True)\nb = torch.empty(2, device='cpu')\n"
    assert factory_calls_without_device(src) == [(2, "torch.zeros(...) without device=")]
    assert factory_calls_without_device(src, dtype_too=True) == [(2, "torch.zeros(...) without device="), (3, "torch.empty(...) without dtype=")]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_tensor_mori_creates_names_its_device(path):
    missing = factory_calls_without_device(path.read_text(), dtype_too="bench" not in path.relative_to(PACKAGE).parts)
    assert not missing, f"{path.relative_to(PACKAGE.parent.parent)}: " + ", ".join(f"line {n}: {what}" for n, what in missing)
