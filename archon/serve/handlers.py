"""The endpoints of the Tinker API this server answers, each a function of (server, path, body,
content type) that returns a JSON-able dict or protobuf bytes. Requests are validated with the
SDK's own request types (`tinker.types`), so a field the SDK would not send is refused by name."""

from __future__ import annotations

import json
import time
from typing import Any

from tinker import types

from archon.serve.adapters import UserError
from archon.serve.futures import Batch, HTTPError
from archon.serve.sampling import SampleCall, batch_key, parse_stop
from archon.serve.wire import (
    PROTO_CONTENT_TYPE,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)


def client_config() -> dict:
    """The SDK's feature flags for this server: API-key auth (no JWT exchange), plain httpx, one
    forward_backward chunk after another, uncompressed protobuf, per-request future polling, custom
    losses computed in the SDK."""
    return {
        "pjwt_auth_enabled": False,
        "credential_default_source": "api_key",
        "use_pyqwest_transport": False,
        "parallel_fwdbwd_chunks": False,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
    }


def _json(body: bytes) -> dict:
    return json.loads(body or b"{}")


def _direct(server, work) -> Any:
    """Run `work` on the worker thread now; a UserError becomes HTTP 400."""
    return server.futures.run_now(work)


def _future(server, work, model_id: str | None = None, batch: Batch | None = None, **extra) -> dict:
    """Queue `work` (acting on training client `model_id`, if any)."""
    return {"request_id": server.futures.submit(work, batch, owner=model_id), "model_id": model_id, **extra}


# ---- sessions and service ------------------------------------------------------------------------


def healthz(server, path, body, content_type) -> dict:
    return {"status": "ok"}


def capabilities(server, path, body, content_type) -> dict:
    backend = server.backend
    return {
        "supported_models": [
            {
                "model_name": backend.model_name,
                "max_context_length": backend.context_length,
                "trainable": True,
                "sampleable": True,
            }
        ]
    }


def create_session(server, path, body, content_type) -> dict:
    types.CreateSessionRequest.model_validate(_json(body))
    return {"type": "create_session", "session_id": server.backend.create_session()}


def heartbeat(server, path, body, content_type) -> dict:
    request = types.SessionHeartbeatRequest.model_validate(_json(body))
    session = server.backend.sessions.get(request.session_id)
    if session is None or session.ended:
        raise HTTPError(410, f"session {request.session_id!r} has ended or never existed")
    session.last_heartbeat = time.monotonic()
    return {"type": "session_heartbeat"}


def finish_session(server, path, body, content_type) -> None:
    session_id = path.removeprefix("/api/v1/sessions/").removesuffix("/finish")
    _direct(server, lambda: server.backend.end_session(session_id))
    return None


def telemetry(server, path, body, content_type) -> dict:
    return {"status": "accepted"}


def ignored(server, path, body, content_type) -> dict:
    """cancel_future and the dynamic client config: nothing to do here (defaults apply)."""
    return {}


# ---- training clients ----------------------------------------------------------------------------


def create_model(server, path, body, content_type) -> dict:
    request = types.CreateModelRequest.model_validate(_json(body))
    lora = request.lora_config or types.LoraConfig(rank=32)
    if request.optimizer_config.type != "adamw":
        raise HTTPError(400, f"optimizer_config.type {request.optimizer_config.type!r}: this server trains with adamw")
    targets = (lora.train_attn, lora.train_mlp, lora.train_unembed)

    def work() -> dict:
        model_id = server.backend.create_model(
            request.session_id, request.model_seq_id, request.base_model, lora.rank, lora.seed, targets
        )
        return {"type": "create_model", "model_id": model_id}

    return _future(server, work)


def get_info(server, path, body, content_type) -> dict:
    request = types.GetInfoRequest.model_validate(_json(body))
    return _direct(server, lambda: server.backend.info(request.model_id))


def forward_backward(server, path, body, content_type) -> dict:
    if "protobuf" not in content_type:
        raise HTTPError(400, f"forward_backward takes {PROTO_CONTENT_TYPE!r} bodies, got Content-Type {content_type!r}")
    call = decode_forward_backward(body)

    def encoded(calls: list) -> list[bytes]:
        return [encode_forward_backward_output(*result) for result in server.backend.forward_backward_many(calls)]

    # several clients' requests queued together run in one forward (one process only)
    batch = None
    if server.backend.dims is None:
        batch = Batch(("forward_backward", call.forward_only), call, encoded, owner=call.model_id)
    return _future(server, lambda: encoded([call])[0], call.model_id, batch)


def optim_step(server, path, body, content_type) -> dict:
    raw = _json(body)
    request = types.OptimStepRequest.model_validate(raw)
    if not isinstance(request.optim_params, types.AdamParams):
        raise HTTPError(400, f"optim_step: {type(request.optim_params).__name__}; this server steps with adam_params")
    params = request.optim_params.model_dump()
    return _future(server, lambda: server.backend.optim_step(request.model_id, params), request.model_id)


def save_weights(server, path, body, content_type) -> dict:
    request = types.SaveWeightsRequest.model_validate(_json(body))

    def work() -> dict:
        return {
            "type": "save_weights",
            "path": server.backend.save(request.model_id, request.path, "weights", request.overwrite),
        }

    return _future(server, work, request.model_id)


def save_weights_for_sampler(server, path, body, content_type) -> dict:
    request = types.SaveWeightsForSamplerRequest.model_validate(_json(body))
    backend = server.backend

    def work() -> dict:
        if request.path is not None:
            return {
                "type": "save_weights_for_sampler",
                "path": backend.save(request.model_id, request.path, "sampler_weights", True),
            }
        session_id = backend.model(request.model_id).session_id
        sampler_id = backend.sampler_from_model(request.model_id, session_id)
        return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

    return _future(server, work, request.model_id)


def load_weights(server, path, body, content_type) -> dict:
    request = types.LoadWeightsRequest.model_validate(_json(body))
    backend = server.backend

    def work() -> dict:
        backend.check_base_model(request.base_model)
        model_id = backend.load(
            request.model_id, request.path, request.optimizer, request.session_id, request.model_seq_id
        )
        return {"type": "load_weights", "path": request.path, "model_id": model_id}

    return _future(server, work, request.model_id)


# ---- sampling ------------------------------------------------------------------------------------


def create_sampling_session(server, path, body, content_type) -> dict:
    request = types.CreateSamplingSessionRequest.model_validate(_json(body))
    backend = server.backend
    sampler_id = _direct(
        server, lambda: backend.create_sampler(request.session_id, request.model_path, request.base_model)
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


def get_sampler(server, path, body, content_type) -> dict:
    sampler_id = path.removeprefix("/api/v1/samplers/")
    try:
        sampler = server.backend.sampler(sampler_id)
    except UserError as e:
        raise HTTPError(404, str(e)) from None
    return {"sampler_id": sampler_id, "base_model": server.backend.model_name, "model_path": sampler.model_path}


def asample(server, path, body, content_type) -> dict:
    request = types.SampleRequest.model_validate(_json(body))
    if request.sampling_session_id is None:
        raise HTTPError(400, "asample: this server samples through sampling sessions (sampling_session_id)")
    unsupported = [
        name
        for name, value in (
            ("target_prompt_logprobs", request.target_prompt_logprobs),
            ("prompt_alt_tokens_k", request.prompt_alt_tokens_k),
            ("prompt_logprobs_last_n", request.prompt_logprobs_last_n),
            ("record_stability_info", request.record_stability_info),
        )
        if value
    ]
    if unsupported:
        raise HTTPError(400, f"asample: {unsupported} are not served by this server")
    params = request.sampling_params
    try:
        stop_ids, stop_strings = parse_stop(params.stop)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    call = SampleCall(
        sampling_session_id=request.sampling_session_id,
        prompt=request.prompt.to_ints(),
        num_samples=request.num_samples,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
        prompt_logprobs=bool(request.prompt_logprobs),
        topk_prompt_logprobs=request.topk_prompt_logprobs,
        topk_sample_logprobs=request.topk_sample_logprobs,
    )

    def encoded(calls: list[SampleCall]) -> list[bytes]:
        results = server.backend.sample_many(calls)
        return [
            encode_sample_response(
                sequences,
                scores.get("prompt_logprobs"),
                scores.get("topk_prompt"),
                c.topk_prompt_logprobs,
                c.topk_sample_logprobs,
            )
            for c, (sequences, scores) in zip(calls, results)
        ]

    key = batch_key(call)
    batch = None if key is None else Batch(key, call, encoded)
    ids = [f"{request.sampling_session_id}:{request.seq_id}:{i}" for i in range(request.num_samples)]
    request_id = server.futures.submit(lambda: encoded([call])[0], batch)
    return {"request_id": request_id, "model_id": None, "sample_sequence_ids": ids}


def retrieve_future(server, path, body, content_type) -> Any:
    request = types.FutureRetrieveRequest.model_validate(_json(body))
    return server.futures.retrieve(request.request_id)


ROUTES = {
    ("GET", "/api/v1/healthz", True): healthz,
    ("GET", "/api/v1/get_server_capabilities", True): capabilities,
    ("POST", "/api/v1/create_session", True): create_session,
    ("POST", "/api/v1/session_heartbeat", True): heartbeat,
    ("POST", "/api/v1/sessions/", False): finish_session,
    ("POST", "/api/v1/telemetry", True): telemetry,
    ("POST", "/api/v1/cancel_future", True): ignored,
    ("POST", "/api/v1/client/dynamic_config", True): ignored,
    ("POST", "/api/v1/create_model", True): create_model,
    ("POST", "/api/v1/get_info", True): get_info,
    ("POST", "/api/v1/forward_backward", True): forward_backward,
    ("POST", "/api/v1/optim_step", True): optim_step,
    ("POST", "/api/v1/save_weights", True): save_weights,
    ("POST", "/api/v1/save_weights_for_sampler", True): save_weights_for_sampler,
    ("POST", "/api/v1/load_weights", True): load_weights,
    ("POST", "/api/v1/create_sampling_session", True): create_sampling_session,
    ("GET", "/api/v1/samplers/", False): get_sampler,
    ("POST", "/api/v1/asample", True): asample,
    ("POST", "/api/v1/retrieve_future", True): retrieve_future,
}
