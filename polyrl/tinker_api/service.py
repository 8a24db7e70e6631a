"""The Tinker calls, over one served base model: sessions, training models, samplers, checkpoints and the
futures the client polls for their results.

Checkpoints live under ``root`` as ``<model_id>/weights/<name>`` (``save_state``) and
``<model_id>/sampler_weights/<name>`` (``save_weights_for_sampler`` with a name), addressed by the client as
``tinker://<model_id>/weights/<name>``. A sampler from ``save_weights_and_get_sampling_client`` is a snapshot
in memory: the ``SNAPSHOTS`` newest are kept, and sampling from an older one is refused, naming it.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from polyrl.models.loading import load_model
from polyrl.tinker_api import wire
from polyrl.tinker_api.jobs import Sequencer, Worker
from polyrl.tinker_api.sampler import SampleJob, Sampler, frozen_copy, stop_rule
from polyrl.tinker_api.trainer import LoraSpec, TrainingModel, build_policy, checkpoint_info, load_policy
from polyrl.tinker_api.wire import Unknown, WireError

SNAPSHOTS = 4
"""Sampler snapshots kept in memory (besides the base model's); each is a copy of the model's weights."""
KINDS = {"weights": "training", "sampler_weights": "sampler"}


@dataclass
class ServedModel:
    """The base model this server trains and samples."""

    name: str
    """How it is reported: a model directory's path where there is one, so a client's tokenizer loads offline."""
    aliases: frozenset[str]
    """Every name a client may ask for it by (the command line's, the alias, the directory)."""
    tokenizer: PreTrainedTokenizerBase
    tokenizer_dir: str
    bf16: bool
    max_tokens: int
    """max_tokens of a sample request that gives none."""
    context: int | None
    """The model's context length (max_position_embeddings)."""


@dataclass
class SamplerEntry:
    base_model: str
    model_path: str | None = None
    model_id: str | None = None
    """The training model a snapshot was taken from (save_weights_and_get_sampling_client)."""
    released: bool = False


class Service:
    def __init__(self, served: ServedModel, root: Path, seed: int = 0) -> None:
        self.served, self.root = served, root
        self.worker = Worker(seed)
        self.models: dict[str, TrainingModel] = {}
        self.sequencers: dict[str, Sequencer] = {}
        self.samplers: dict[str, SamplerEntry] = {}
        self.snapshots: OrderedDict[str, Sampler] = OrderedDict()
        self.base_sampler: Sampler | None = None
        self.futures: dict[str, Future] = {}
        self._lock = threading.Lock()

    # --- bookkeeping ----------------------------------------------------------------------------------------

    def _future(self, future: Future, **extra: Any) -> dict[str, Any]:
        request_id = uuid.uuid4().hex
        with self._lock:
            self.futures[request_id] = future
        return {"request_id": request_id, **extra}

    def future(self, request_id: str) -> Future:
        with self._lock:
            future = self.futures.get(request_id)
        if future is None:
            raise Unknown(f"unknown request_id '{request_id}'")
        return future

    def forget(self, request_id: str) -> None:
        with self._lock:
            self.futures.pop(request_id, None)

    def check_base(self, base_model: str) -> None:
        if base_model not in self.served.aliases:
            raise WireError(f"base_model '{base_model}' is not served here; this server serves "
                            f"'{self.served.name}'")

    def model(self, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None:
            raise WireError(f"unknown model_id '{model_id}'")
        return model

    def _sequenced(self, model_id: str, seq_id: int | None, fn: Callable[[], Any], name: str) -> dict[str, Any]:
        """Queue ``fn`` as the model's request ``seq_id``. Whatever can be wrong with a numbered request is
        found inside ``fn``: refused before it is queued, it would leave a gap that holds up those after it."""
        self.model(model_id)
        return self._future(self.sequencers[model_id].submit(seq_id, fn, name), model_id=model_id)

    def skip(self, body: Any) -> None:
        """Pass the turn of a refused request whose body names a known model and a seq_id."""
        if isinstance(body, dict) and isinstance(body.get("seq_id"), int):
            sequencer = self.sequencers.get(str(body.get("model_id")))
            if sequencer is not None:
                sequencer.skip(body["seq_id"])

    def _register(self, model: TrainingModel) -> None:
        with self._lock:
            self.models[model.model_id] = model
            self.sequencers.setdefault(model.model_id, Sequencer(self.worker, model.model_id))

    # --- sessions and capabilities ----------------------------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.served.name, "max_context_length": self.served.context,
                                      "trainable": True, "sampleable": True}]}

    @staticmethod
    def create_session() -> dict[str, Any]:
        return {"type": "create_session", "session_id": f"polyrl-{uuid.uuid4().hex[:12]}"}

    # --- training models --------------------------------------------------------------------------------------

    def create_model(self, session_id: str, seq: int, base_model: str, lora: dict | None,
                     optimizer: dict | None) -> dict[str, Any]:
        self.check_base(base_model)
        _check_adam(optimizer)
        spec = LoraSpec(**lora) if lora else None
        if spec is not None and spec.rank < 1:
            raise WireError(f"lora_config.rank must be 1 or more, got {spec.rank}")
        model_id = f"{session_id}:train:{seq}"

        def create() -> dict[str, Any]:
            policy = build_policy(self.served.name, spec, self.served.bf16)
            self._register(TrainingModel(model_id, self.served.name, policy, spec, self.served.bf16, self._pad()))
            return {"model_id": model_id, "type": "create_model"}

        return self._future(self.worker.call(create, name="create_model"), model_id=model_id)

    def _pad(self) -> int:
        tok = self.served.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def info(self, model_id: str) -> dict[str, Any]:
        model = self.model(model_id)
        arch = getattr(model.policy.config, "model_type", None)
        return {"type": "get_info", "model_id": model_id, "model_name": self.served.name,
                "model_data": {"arch": arch, "model_name": self.served.name, "tokenizer_id": self.served.tokenizer_dir},
                "is_lora": model.lora is not None, "lora_rank": model.lora.rank if model.lora else None}

    def forward_backward(self, request: wire.ForwardBackward) -> dict[str, Any]:
        def run() -> bytes:
            outputs, metrics = self.model(request.model_id).forward(
                wire.read_data(request), request.loss_fn, request.config, backward=not request.forward_only)
            return wire.forward_backward_output(outputs, metrics)

        return self._sequenced(request.model_id, request.seq_id, run,
                               "forward" if request.forward_only else "forward_backward")

    def optim_step(self, model_id: str, seq_id: int | None, params: dict[str, Any]) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            if params.get("type", "adamw") != "adamw":
                raise WireError(f"optim_step: optimizer '{params['type']}' is not supported (AdamParams only)")
            return {"metrics": self.model(model_id).optim_step(params)}

        return self._sequenced(model_id, seq_id, run, "optim_step")

    # --- checkpoints -------------------------------------------------------------------------------------------

    def _path(self, model_id: str, kind: str, name: str) -> tuple[Path, str]:
        if not name or "/" in name or name in (".", ".."):
            raise WireError(f"checkpoint name '{name}': a non-empty name without '/'")
        return self.root / model_id / kind / name, f"tinker://{model_id}/{kind}/{name}"

    def resolve(self, tinker_path: str) -> Path:
        """The directory of a ``tinker://<model_id>/<weights|sampler_weights>/<name>`` checkpoint."""
        parts = tinker_path.removeprefix("tinker://").split("/")
        if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KINDS:
            raise WireError(f"'{tinker_path}' is not a checkpoint path (tinker://<model_id>/weights/<name> or "
                            "tinker://<model_id>/sampler_weights/<name>)")
        path, _ = self._path(parts[0], parts[1], parts[2])
        if not (path / "tinker.json").exists():
            raise WireError(f"no checkpoint at {tinker_path}")
        return path

    def save(self, model_id: str, seq_id: int | None, name: str | None, kind: str, overwrite: bool,
             metadata: dict | None) -> dict[str, Any]:
        """``save_state`` (kind ``weights``, with the optimizer) or ``save_weights_for_sampler``; the latter
        without a name makes an in-memory snapshot and answers its sampling session id."""
        if name is None and kind == "sampler_weights":
            return self._sequenced(model_id, seq_id, lambda: self._snapshot(model_id), "snapshot")

        def run() -> dict[str, Any]:
            path, tinker_path = self._path(model_id, kind, name or "")
            if path.exists() and not overwrite:
                raise WireError(f"checkpoint {tinker_path} exists (save with overwrite=True to replace it)")
            self.model(model_id).save(path, self.served.tokenizer, optimizer=kind == "weights",
                                      meta={"user_metadata": metadata or {}})
            return {"path": tinker_path, "type": "save_weights" if kind == "weights" else "save_weights_for_sampler"}

        return self._sequenced(model_id, seq_id, run, f"save {kind}")

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        """``load_weights``: into a new training model (``session_id`` and ``model_seq_id``, the path of
        ``create_training_client_from_state``) or, replacing its weights, into an existing one."""
        with_optimizer = bool(request.get("optimizer"))
        if request.get("session_id") is not None:
            model_id, seq_id = f"{request['session_id']}:train:{request.get('model_seq_id', 0)}", None
        elif request.get("model_id"):
            model_id, seq_id = request["model_id"], request.get("seq_id")
        else:
            raise WireError("load_weights: give session_id and model_seq_id, or model_id")

        def run() -> dict[str, Any]:
            path = self.resolve(request["path"])
            if request.get("base_model"):
                self.check_base(request["base_model"])
            _check_adam(request.get("optimizer_config"))
            self.check_base(checkpoint_info(path)["base_model"])
            policy, base, lora = load_policy(path, self.served.bf16)
            model = TrainingModel(model_id, base, policy, lora, self.served.bf16, self._pad())
            if with_optimizer:
                model.load_optimizer(path)
            self._register(model)
            return {"path": request["path"], "model_id": model_id, "type": "load_weights"}

        if seq_id is None:
            return self._future(self.worker.call(run, name="load"), model_id=model_id)
        return self._sequenced(model_id, seq_id, run, "load")

    def training_run(self, model_id: str) -> dict[str, Any]:
        if model_id in self.models:
            model = self.models[model_id]
            base, lora = model.base_model, model.lora
        else:
            found = sorted((self.root / model_id).glob("*/*/tinker.json"))
            if not found:
                raise Unknown(f"unknown training run '{model_id}'")
            info = checkpoint_info(found[-1].parent)
            base, lora = info["base_model"], LoraSpec(**info["lora"]) if info["lora"] else None
        checkpoints = self.checkpoints(model_id)["checkpoints"]
        last = {kind: [c for c in checkpoints if c["checkpoint_type"] == kind] for kind in KINDS.values()}
        return {"training_run_id": model_id, "base_model": base, "model_owner": "local", "is_lora": lora is not None,
                "lora_rank": lora.rank if lora else None, "last_request_time": _now(),
                "last_checkpoint": last["training"][-1] if last["training"] else None,
                "last_sampler_checkpoint": last["sampler"][-1] if last["sampler"] else None}

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        """Remove ``<model_id>/<weights|sampler_weights>/<name>`` (the cookbook's rolling checkpoints)."""
        path = self.resolve(f"tinker://{model_id}/{checkpoint_id}")
        shutil.rmtree(path)

    def checkpoints(self, model_id: str) -> dict[str, Any]:
        found = []
        for info in sorted((self.root / model_id).glob("*/*/tinker.json"), key=lambda p: p.stat().st_mtime):
            kind, name = info.parent.parent.name, info.parent.name
            if kind in KINDS:
                found.append({"checkpoint_id": f"{kind}/{name}", "checkpoint_type": KINDS[kind],
                              "time": _now(info.stat().st_mtime), "tinker_path": f"tinker://{model_id}/{kind}/{name}"})
        return {"checkpoints": found}

    # --- samplers --------------------------------------------------------------------------------------------------

    def _snapshot(self, model_id: str) -> dict[str, Any]:
        """A sampler on the training model's current weights (run in the worker)."""
        model = self.model(model_id)
        sampler_id = f"{model_id}:sampler:{uuid.uuid4().hex[:8]}"
        recent = [s for i, s in self.snapshots.items() if self.samplers[i].model_id == model_id]
        reuse = next((s for s in reversed(recent) if s.version == model.version), None)
        sampler = reuse or Sampler(frozen_copy(model.policy), self.served.tokenizer, self.served.bf16, model.version)
        self.samplers[sampler_id] = SamplerEntry(self.served.name, model_id=model_id)
        self._keep(sampler_id, sampler)
        return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

    def _keep(self, sampler_id: str, sampler: Sampler) -> None:
        self.snapshots[sampler_id] = sampler
        self.snapshots.move_to_end(sampler_id)
        while len(self.snapshots) > SNAPSHOTS:
            old, _ = self.snapshots.popitem(last=False)
            self.samplers[old].released = True

    def create_sampling_session(self, base_model: str | None, model_path: str | None) -> dict[str, Any]:
        if model_path is not None:
            base = checkpoint_info(self.resolve(model_path))["base_model"]
        elif base_model is not None:
            self.check_base(base_model)
            base = self.served.name
        else:
            raise WireError("create_sampling_session: give base_model or model_path")
        sampler_id = f"sampler:{uuid.uuid4().hex[:12]}"
        self.samplers[sampler_id] = SamplerEntry(base, model_path=model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        entry = self.samplers.get(sampler_id)
        if entry is None:
            raise Unknown(f"unknown sampler '{sampler_id}'")
        return {"sampler_id": sampler_id, "base_model": entry.base_model, "model_path": entry.model_path}

    def _resolve_sampler(self, sampler_id: str) -> Sampler:
        """The sampler's snapshot, loading a base model or a checkpoint on first use (run in the worker)."""
        entry = self.samplers[sampler_id]
        if sampler_id in self.snapshots:
            self.snapshots.move_to_end(sampler_id)
            return self.snapshots[sampler_id]
        if entry.released:
            raise WireError(f"sampler {sampler_id} was released: the server keeps the {SNAPSHOTS} newest "
                            "snapshots in memory; save_weights_for_sampler(name) keeps one on disk")
        if entry.model_path is not None:
            policy, _, _ = load_policy(self.resolve(entry.model_path), self.served.bf16)
            sampler = Sampler(frozen_copy(policy), self.served.tokenizer, self.served.bf16)
            self._keep(sampler_id, sampler)
            return sampler
        if self.base_sampler is None:
            base = load_model(self.served.name, None, bf16=self.served.bf16).eval().requires_grad_(False)
            self.base_sampler = Sampler(base, self.served.tokenizer, self.served.bf16)
        return self.base_sampler

    def sample(self, request: dict[str, Any]) -> dict[str, Any]:
        sampler_id = request.get("sampling_session_id")
        if sampler_id is None:  # a one-off request naming its model
            sampler_id = self.create_sampling_session(request.get("base_model"),
                                                      request.get("model_path"))["sampling_session_id"]
        if sampler_id not in self.samplers:
            raise WireError(f"unknown sampling_session_id '{sampler_id}'")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if request.get(key):
                raise WireError(f"asample: {key} is not supported by this server")
        if request.get("target_prompt_logprobs") is not None:
            raise WireError("asample: target_prompt_logprobs is not supported by this server")
        params = request["sampling_params"]
        if params.get("top_k", -1) not in (-1, 0):
            raise WireError("sampling_params.top_k is not supported by this server (top_p is)")
        n = int(request.get("num_samples", 1))
        if n < 1:
            raise WireError(f"num_samples must be 1 or more, got {n}")
        job = SampleJob(
            prompt=wire.tokens_of(request["prompt"]), n=n,
            max_tokens=int(params.get("max_tokens") or self.served.max_tokens),
            temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
            seed=params.get("seed"), stop=stop_rule(params.get("stop"), self.served.tokenizer.eos_token_id),
            prompt_logprobs=bool(request.get("prompt_logprobs")),
            prompt_logprobs_last_n=request.get("prompt_logprobs_last_n"))
        if job.max_tokens < 1 or not 0 < job.top_p <= 1 or job.temperature < 0:
            raise WireError("sampling_params: max_tokens >= 1, 0 < top_p <= 1 and temperature >= 0")
        future = self.worker.sample(sampler_id, job, self._resolve_sampler)
        seq = request.get("seq_id") or 0
        return self._future(future, sample_sequence_ids=[f"{sampler_id}:{seq}:{i}" for i in range(n)])


def _check_adam(optimizer: dict | None) -> None:
    if optimizer and optimizer.get("type", "adamw") != "adamw":
        raise WireError(f"optimizer '{optimizer['type']}' is not supported (AdamW only)")


def _now(timestamp: float | None = None) -> str:
    moment = datetime.now(timezone.utc) if timestamp is None else datetime.fromtimestamp(timestamp, timezone.utc)
    return moment.isoformat()
