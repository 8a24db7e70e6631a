"""``polyrl serve``: a model, an HF directory, a checkpoint or a run's newest checkpoint on the endpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from polyrl.checkpoint.store import latest_checkpoint
from polyrl.endpoint.server import Endpoint, EndpointServer, Sampling
from polyrl.engines.hf import HFEngine
from polyrl.models.device import resolve_bf16
from polyrl.models.loading import load_model, load_tokenizer


def resolve_source(source: str) -> str:
    """A run directory (it holds ``checkpoints/``) stands for its newest valid checkpoint."""
    path = Path(source)
    if (path / "checkpoints").is_dir():
        newest = latest_checkpoint(path)
        if newest is None:
            raise ValueError(f"{source}: a run directory without a usable checkpoint")
        return str(newest)
    return source


def build_server(source: str, port: int = 0, max_tokens: int = 512, bf16: bool | str = "auto") -> EndpointServer:
    """The endpoint on ``source``, bound to 127.0.0.1:``port``, not yet started. The model answers to the
    name given on the command line and to ``policy``; ``bf16`` auto samples in bf16 where the CPU computes it
    natively."""
    path = resolve_source(source)
    tokenizer = load_tokenizer(path)
    model = load_model(path).eval().requires_grad_(False)
    bf16 = resolve_bf16(bf16, "cpu")
    engine = HFEngine(model, tokenizer, bf16=bf16, bf16_weights=bf16)
    endpoint = Endpoint(engine, [source, "policy"])
    endpoint.sampling = Sampling(max_tokens=max_tokens)
    return EndpointServer(endpoint, port)


def serve(source: str, port: int, max_tokens: int, bf16: bool | str, echo: Callable[[str], None] = print) -> None:
    server = build_server(source, port, max_tokens, bf16)
    echo(f"serving {source} as '{source}' (or 'policy') at {server.base_url}  (Ctrl-C stops)")
    server.serve_forever()
