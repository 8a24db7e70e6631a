"""docs/configuration.md is generated from the config models and must match what the generator produces."""

from typing import Literal

from polyrl.config import Config, LoggingConfig
from polyrl.docs_gen import DOC_PATH, main, render, type_name


def test_committed_reference_is_current():
    assert DOC_PATH.read_text() == render(), (
        "docs/configuration.md is out of date with polyrl/config/; regenerate it: python -m polyrl.docs_gen"
    )
    assert main(["--check"]) == 0


def test_reference_covers_every_section_and_key():
    text = render()
    for name in Config.model_fields:
        assert f"| `{name}` |" in text
    for name in LoggingConfig.model_fields:
        assert f"| `{name}` |" in text, name
    assert "## `tasks[]`" in text and "## `model.lora`" in text
    # Descriptions come from the attribute docstrings; defaults and constraints from the fields.
    assert "| `mlflow_tracking_uri` | str \\| null | `null` | MLflow tracking URI; default" in text
    assert "| `trajectories_per_group` | int (>= 0) | `1` |" in text
    assert "| `tasks` | list[section] (at least 1 item(s)) | **required** |" in text


def test_type_names():
    assert type_name(Literal["a", "b"]) == '"a" \\| "b"'
    assert type_name(list[str]) == "list[str]"
    assert type_name(int | None) == "int \\| null"
    assert type_name(tuple[float, float]) == "tuple[float, float]"
