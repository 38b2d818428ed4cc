"""The two protobuf messages of the Tinker wire format the server reads and writes: the
forward_backward request in, the forward_backward output and the sample response out. The message
classes are the SDK's own (`tinker.proto.tinker_public_pb2`), so the server reads exactly what the
SDK writes; every other request and response is JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

PROTO_CONTENT_TYPE = "application/x-protobuf"

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_DTYPE_NAMES = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64", pb.DTYPE_INT32: "int32"}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


class WireError(ValueError):
    """A request that does not decode: the client's error."""


@dataclass
class WireTensor:
    array: np.ndarray
    """The values, reshaped to the declared shape (flat when none was declared)."""
    dtype: str
    """The dtype the client declared: "float32", "int64" or "int32"."""


@dataclass
class WireDatum:
    tokens: list[int]
    inputs: dict[str, WireTensor] = field(default_factory=dict)


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]


def _tensor(name: str, msg: pb.Tensor) -> WireTensor:
    if msg.dtype not in _DTYPES:
        raise WireError(f"loss_fn_inputs[{name!r}]: unsupported dtype enum {msg.dtype}")
    np_dtype = _DTYPES[msg.dtype]
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        values = np.frombuffer(msg.sparse_csr.values, dtype=np_dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        if len(shape) != 2:
            raise WireError(f"loss_fn_inputs[{name!r}]: a sparse tensor needs a 2-D shape, got {shape}")
        dense = np.zeros(shape, dtype=np_dtype)
        for row in range(shape[0]):
            cols = col[crow[row] : crow[row + 1]]
            dense[row, cols] = values[crow[row] : crow[row + 1]]
        return WireTensor(dense, _DTYPE_NAMES[msg.dtype])
    array = np.frombuffer(msg.dense, dtype=np_dtype).copy()
    if shape:
        if int(np.prod(shape)) != array.size:
            raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} does not hold its {array.size} values")
        array = array.reshape(shape)
    return WireTensor(array, _DTYPE_NAMES[msg.dtype])


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # the protobuf runtime's DecodeError
        raise WireError(f"forward_backward: the body is no ForwardBackwardRequest message ({e})") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"data[{i}].model_input: a {kind} chunk; this server takes token chunks only")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _tensor(name, tensor) for name, tensor in datum.loss_fn_inputs.items()}
        data.append(WireDatum(tokens, inputs))
    return ForwardBackwardCall(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """outputs: per datum, 1-D float32 arrays by name (the same names for every datum)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    if outputs:
        record = msg.loss_fn_outputs.add()
        record.num_datums = len(outputs)
        for name in outputs[0]:
            arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
            sizes = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
            batched = record.fields[name]
            batched.data = b"".join(a.tobytes() for a in arrays)
            batched.offsets = sizes.tobytes()
            batched.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


MASK_LOGPROB = -99999.0
"""The SDK's filler of a top-k row with fewer than k entries (token id 0 with this log-prob)."""


def _topk(rows: list[list[tuple[int, float]]], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row[:k]):
            ids[i, j], logprobs[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))


@dataclass
class SampledOut:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk: list[list[tuple[int, float]]] | None = None


def encode_sample_response(
    sequences: list[SampledOut],
    prompt_logprobs: list[float] | None = None,
    topk_prompt: list[list[tuple[int, float]]] | None = None,
    k_prompt: int = 0,
    k_sample: int = 0,
) -> bytes:
    """prompt_logprobs: one per prompt token, NaN where none (the first token)."""
    msg = pb.SampleResponse()
    for seq in sequences:
        out = msg.sequences.add()
        out.stop_reason = _STOP_REASONS[seq.stop_reason]
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk is not None:
            out.topk_sampled_logprobs.CopyFrom(_topk(seq.topk, k_sample))
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt, k_prompt))
    return msg.SerializeToString()
