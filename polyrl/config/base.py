"""The base of every config model, and the one-line error type."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the file and key."""

    def __init__(self, message: str) -> None:
        # Keys and values quoted in the message are user text: their line breaks must not split the line.
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


class _Strict(BaseModel):
    # Attribute docstrings become field descriptions: docs/configuration.md is generated from them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
