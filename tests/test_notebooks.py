"""Every notebook runs top to bottom in a fresh kernel (each asserts what it shows), uses only public names,
and is stored without outputs."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"quickstart", "functional_core", "scoring", "attention_kernels", "sharding", "serving_under_load"}


def code_cells(path: Path) -> list[str]:
    return [cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


def private_names(source: str) -> list[str]:
    """Underscore-prefixed attributes, names and modules in a cell (top-level `await` allowed, as in Jupyter)."""
    tree = compile(source, "<cell>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            found.append("." + node.attr)
        elif isinstance(node, ast.Name) and node.id.startswith("_") and node.id != "_":  # `_`: a throwaway
            found.append(node.id)
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") + [alias.name for alias in node.names]
            found += [p for p in parts if p.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [p for alias in node.names for p in alias.name.split(".") if p.startswith("_")]
    return found


def test_the_notebooks_the_readme_promises_exist():
    assert {p.stem for p in NOTEBOOKS} == EXPECTED


def test_the_private_name_check_catches_what_it_should():
    found = private_names("engine._tracked\nfrom pallas_kernels._tpu_call import x\nimport a._b\n_x = 1")
    assert set(found) == {"._tracked", "_tpu_call", "_b", "_x"}
    assert private_names("for _ in range(3):\n    await run(x.public)") == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_uses_only_public_names_and_is_stored_without_outputs(path):
    for source in code_cells(path):
        assert not private_names(source), (path.name, private_names(source), source[:200])
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
    import nbclient
    notebook = nbformat.read(path, as_version=4)
    # A fresh kernel per notebook: the sharding one needs 8 fake devices, set before JAX starts.
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
