"""The Tinker wire formats the server reads and writes, through the SDK's own definitions (``tinker.proto``).

``forward_backward`` arrives as a protobuf ``ForwardBackwardRequest``; the results of sampling and of
forward/backward go back as protobuf (the SDK asks for them with ``Accept: application/x-protobuf`` and reads
nothing else for those two types). Every other request and result is JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

PROTO = "application/x-protobuf"

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request the server cannot read: answered as the caller's error, naming what is wrong."""


class Unknown(LookupError):
    """An id (request, model, sampler, training run) the server does not know."""


@dataclass
class Datum:
    """One training example: the input tokens and the per-position tensors its loss reads."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int | None
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    message: pb.ForwardBackwardRequest
    """The data stays encoded until the request's turn (``read_data``), so a bad datum fails that request
    alone, in its place in the model's sequence."""


def _tensor(msg: pb.Tensor, name: str, row: int) -> torch.Tensor:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"data[{row}].loss_fn_inputs['{name}']: unsupported dtype {pb.DType.Name(msg.dtype)}")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        if len(shape) != 2:
            raise WireError(f"data[{row}].loss_fn_inputs['{name}']: a sparse tensor needs a 2-D shape")
        csr = msg.sparse_csr
        dense = torch.sparse_csr_tensor(
            torch.from_numpy(np.frombuffer(csr.crow_indices, dtype=np.int64).copy()),
            torch.from_numpy(np.frombuffer(csr.col_indices, dtype=np.int64).copy()),
            torch.from_numpy(np.frombuffer(csr.values, dtype=dtype).copy()),
            shape,
        ).to_dense()
        return dense.long() if dtype != np.float32 else dense
    values = torch.from_numpy(np.frombuffer(msg.dense, dtype=dtype).copy())
    if dtype != np.float32:
        values = values.long()
    if shape:
        if int(np.prod(shape)) != values.numel():
            raise WireError(f"data[{row}].loss_fn_inputs['{name}']: shape {shape} does not hold "
                            f"{values.numel()} values")
        values = values.reshape(shape)
    return values


def _tokens(chunks, row: int) -> list[int]:
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"data[{row}].model_input: {kind} chunks are not supported (text tokens only)")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    return tokens


def read_forward_backward(body: bytes) -> ForwardBackward:
    """The protobuf ``ForwardBackwardRequest`` the SDK sends (seq_id 0 is the SDK's "none")."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({exc})") from None
    config: dict[str, float | str] = dict(msg.loss_fn_config.items())
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    return ForwardBackward(msg.model_id, msg.seq_id or None, msg.loss_fn, config, msg.forward_only, msg)


def read_data(request: ForwardBackward) -> list[Datum]:
    """The request's datums as token lists and tensors."""
    data = []
    for row, datum in enumerate(request.message.data):
        inputs = {name: _tensor(t, name, row) for name, t in datum.loss_fn_inputs.items()}
        data.append(Datum(_tokens(datum.model_input, row), inputs))
    return data


def tokens_of(model_input: dict) -> list[int]:
    """The tokens of a JSON ``ModelInput`` (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``)."""
    tokens: list[int] = []
    for chunk in model_input.get("chunks", []):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise WireError(f"model_input: {kind} chunks are not supported (text tokens only)")
        tokens.extend(int(t) for t in chunk["tokens"])
    return tokens


def forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """A protobuf ``ForwardBackwardOutput``: each field's per-datum float32 vectors packed into one buffer."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else []:
        arrays = [o[name].detach().float().cpu().numpy().astype(np.float32).reshape(-1) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    return msg.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    """True when a stop token or sequence ended it, False when max_tokens did."""


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """A protobuf ``SampleResponse``; ``prompt_logprobs`` has NaN where nothing was scored."""
    msg = pb.SampleResponse()
    for s in sequences:
        msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
