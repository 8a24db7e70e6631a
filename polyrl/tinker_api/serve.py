"""``polyrl serve MODEL --tinker``: the Tinker API on a model polyrl loads (an alias, a Hugging Face directory,
a checkpoint, or a run directory's newest checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import AutoConfig, PreTrainedModel

from polyrl.endpoint.serve import resolve_source
from polyrl.models.device import resolve_bf16
from polyrl.models.loading import TINY_ALIAS, cache_dir, load_tokenizer, resolve_model_path, smollm2_tokenizer_dir
from polyrl.tinker_api.sampler import frozen_copy
from polyrl.tinker_api.server import TinkerServer
from polyrl.tinker_api.service import ServedModel, Service
from polyrl.tinker_api.trainer import load_policy

TINY_CONTEXT = 2048  # models/loading.tiny_random_model's max_position_embeddings


def served_model(source: str, bf16: bool | str = "auto", max_tokens: int = 512) -> ServedModel:
    """What the server reports and accepts for ``source``: a model directory is reported by its path, so the
    SDK's ``get_tokenizer`` (and the cookbook's) load the tokenizer from it offline."""
    path = resolve_source(source)
    tokenizer = load_tokenizer(path)
    if path == TINY_ALIAS:
        name, aliases, tokenizer_dir, context = path, {path}, str(smollm2_tokenizer_dir()), TINY_CONTEXT
    else:
        directory = resolve_model_path(path)
        if (directory / "adapter_config.json").exists():
            raise ValueError(f"model '{source}' is a LoRA adapter; serve its merged weights (polyrl export --merge)")
        name, tokenizer_dir = str(directory.resolve()), str(directory.resolve())
        aliases = {source, path, name, str(directory)}
        context = getattr(AutoConfig.from_pretrained(directory), "max_position_embeddings", None)
    return ServedModel(name=name, aliases=frozenset(aliases), tokenizer=tokenizer, tokenizer_dir=tokenizer_dir,
                       bf16=resolve_bf16(bf16, "cpu"), max_tokens=max_tokens, context=context)


def build_server(source: str, port: int = 0, max_tokens: int = 512, bf16: bool | str = "auto",
                 checkpoint_dir: Path | None = None, seed: int = 0) -> TinkerServer:
    """The Tinker server on ``source``, bound to 127.0.0.1:``port``, not yet started. Checkpoints go under
    ``checkpoint_dir`` (default: polyrl's cache, ``tinker/``)."""
    served = served_model(source, bf16, max_tokens)
    root = Path(checkpoint_dir) if checkpoint_dir is not None else cache_dir() / "tinker"
    return TinkerServer(Service(served, root, seed), port)


def serve(source: str, port: int, max_tokens: int, bf16: bool | str, checkpoint_dir: Path | None = None,
          echo: Callable[[str], None] = print) -> None:
    server = build_server(source, port, max_tokens, bf16, checkpoint_dir)
    echo(f"Tinker API for '{server.service.served.name}' at {server.base_url} (checkpoints in "
         f"{server.service.root}); point the client at it with ServiceClient(base_url='{server.base_url}', "
         "api_key='tml-local')  (Ctrl-C stops)")
    server.serve_forever()


def tinker_sampler_policy(path: Path) -> PreTrainedModel:
    """The policy a sampler checkpoint (``save_weights_for_sampler``) holds, as the server samples from it: float32,
    LoRA adapters merged."""
    return frozen_copy(load_policy(Path(path), bf16=False)[0])
