"""The HTTP API of sglang 0.5.9 (entrypoints/http_server.py and entrypoints/openai/), same paths, methods,
status codes and JSON shapes, on top of the simulated TokenizerManager.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from dynctl.sim.httpserver import HttpRequest, Response, Router, StreamResponse
from dynctl.sim.metrics import CONTENT_TYPE, ServerMetrics
from dynctl.sim import sgltree
from dynctl.sim.tokenizer import ServerStatus, TokenizerManager

# AuthLevel.ADMIN_OPTIONAL endpoints (http_server.py) among those served here
ADMIN_OPTIONAL_PATHS = ("/set_internal_state", "/flush_cache")

DEFAULT_MODEL_NAME = "default"  # entrypoints/openai/protocol.py CompletionRequest.model


def _json(value: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _sse(value: Any) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _validation_error(errors: list[dict[str, Any]]) -> Response:
    """http_server.py:409-442: FastAPI's RequestValidationError turned into a 400 ErrorResponse."""
    message = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}: {errors!r}"
    return _json({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, 400)


def _error(message: str) -> Response:
    """http_server.py:1636 _create_error_response."""
    return _json({"error": {"message": message}}, 400)


def _openai_error(message: str, err_type: str = "BadRequestError", status: int = 400) -> Response:
    """openai/serving_base.py create_error_response."""
    return _json({"object": "error", "message": message, "type": err_type, "param": None, "code": status}, status)


def _body_object(request: HttpRequest) -> tuple[dict[str, Any] | None, Response | None]:
    try:
        value = json.loads(request.body or b"")
    except (ValueError, UnicodeDecodeError) as err:
        return None, _validation_error([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                         "input": {}, "ctx": {"error": str(err)}}])
    if not isinstance(value, dict):
        return None, _validation_error([{"type": "dataclass_type", "loc": ("body",),
                                         "msg": "Input should be a dictionary or an instance of the model",
                                         "input": value}])
    return value, None


@dataclass
class Api:
    tokenizer: TokenizerManager
    metrics: ServerMetrics | None
    time_scale: float
    slow_health: float
    slow_server_info: float = 0.0
    health_timeout: float = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT

    def authorize(self, request: HttpRequest) -> Response | None:
        """sglang's API-key middleware (utils/auth.py decide_request_auth, 0.5.8+; before that one key for all):
        /health* and /metrics always open; the admin endpoints want the admin key when there is one, else the
        API key; every other endpoint wants the API key when there is one."""
        args = self.tokenizer.server_args
        api_key, admin_key = args.get("api_key"), args.get("admin_api_key")
        path = request.path
        if request.method == "OPTIONS" or path.startswith("/health") or path.startswith("/metrics"):
            return None
        wanted = (admin_key or api_key) if path in ADMIN_OPTIONAL_PATHS and "admin_api_key" in args else api_key
        if not wanted:
            return None
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), wanted.encode()):
            return None
        return _json({"error": "Unauthorized"}, 401)

    def router(self) -> Router:
        r = Router(self.authorize)
        r.add(("GET",), "/health", self.health)
        r.add(("GET",), "/health_generate", self.health)
        r.add(("GET",), "/model_info", self.model_info)
        r.add(("GET",), "/get_model_info", self.get_model_info)
        r.add(("GET",), "/server_info", self.server_info)
        r.add(("GET",), "/get_server_info", self.get_server_info)
        r.add(("POST", "PUT"), "/set_internal_state", self.set_internal_state)
        r.add(("POST", "PUT"), "/generate", self.generate)
        r.add(("GET", "POST"), "/flush_cache", self.flush_cache)
        r.add(("POST",), "/v1/completions", self.completions)
        r.add(("GET",), "/v1/models", self.models)
        if sgltree.version_tuple(self.tokenizer.version) >= (0, 5, 8):  # entrypoints/v1_loads.py is new in 0.5.8
            r.add(("GET",), "/v1/loads", self.loads)
        if self.metrics is not None:
            r.add(("GET",), "/metrics", self.prometheus)
        return r

    # ------------------------------------------------------------------------------------ native API

    async def health(self, request: HttpRequest) -> Response:
        if self.slow_health:
            await asyncio.sleep(self.slow_health)
        tm = self.tokenizer
        if tm.gracefully_exit:
            tm.log.info("Health check request received during shutdown. Returning 503.")
            return Response(503, b"", None)
        if tm.server_status == ServerStatus.Starting:
            return Response(503, b"", None)
        if tm.first_request_hook is not None:
            hook, tm.first_request_hook = tm.first_request_hook, None
            hook()
        healthy = await tm.check_health(self.health_timeout / self.time_scale, 1.0 / self.time_scale)
        return Response(200 if healthy else 503, b"", None)

    async def get_model_info(self, request: HttpRequest) -> Response:
        self.tokenizer.log.warning("Endpoint '/get_model_info' is deprecated and will be removed in a future "
                                   "version. Please use '/model_info' instead.")
        return await self.model_info(request)

    async def model_info(self, request: HttpRequest) -> Response:
        args = self.tokenizer.server_args
        return _json({
            "model_path": args["model_path"],
            "tokenizer_path": args.get("tokenizer_path"),
            "is_generation": True,
            "preferred_sampling_params": args.get("preferred_sampling_params"),
            "weight_version": args.get("weight_version", "default"),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "simulated",
            "architectures": ["SimulatedForCausalLM"],
            # Not in sglang: the simulator labels itself wherever a client looks.
            "simulated": True,
        })

    async def get_server_info(self, request: HttpRequest) -> Response:
        self.tokenizer.log.warning("Endpoint '/get_server_info' is deprecated and will be removed in a future "
                                   "version. Please use '/server_info' instead.")
        return await self.server_info(request)

    async def server_info(self, request: HttpRequest) -> Response:
        if self.slow_server_info:
            await asyncio.sleep(self.slow_server_info)
        tm = self.tokenizer
        return _json({**tm.server_args, **tm.scheduler_info, "internal_states": [tm.internal_state()],
                      "version": tm.version})

    async def loads(self, request: HttpRequest) -> Response:
        """/v1/loads (entrypoints/v1_loads.py, Scheduler.get_loads): one DP rank, the sections asked for."""
        query = dict(p.partition("=")[::2] for p in (request.query or "").split("&") if p)
        include = {s.strip() for s in query["include"].replace("%2C", ",").split(",")} if query.get("include") else {"all"}
        invalid = include - {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if invalid:
            return _json({"detail": f"Invalid include sections: {invalid}. Valid options: "
                                    "['all', 'core', 'disagg', 'lora', 'memory', 'queues', 'spec']"}, 400)
        every = "all" in include
        b = self.tokenizer.batcher
        running, waiting = len(b.running), len(b.waiting)
        load: dict[str, Any] = {
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_used_tokens": b.used_tokens, "max_total_num_tokens": b.max_total_num_tokens,
            "token_usage": round(b.token_usage(), 4), "gen_throughput": round(b.last_gen_throughput, 2),
            "cache_hit_rate": 0.0, "utilization": round(b.token_usage(), 4),
            "max_running_requests": b.max_running_requests,
        }
        # memory: sglang leaves the section out where the model runner has no memory figures, as here
        if (every or "spec" in include) and b.spec_total_num_forward_ct > 0:
            length = b.spec_total_num_accepted_tokens / b.spec_total_num_forward_ct
            load["speculative"] = {"accept_length": length, "accept_rate": b.accept_rate}
        if every or "disagg" in include:
            load["disaggregation"] = {"mode": "null", "prefill_prealloc_queue_reqs": 0,
                                      "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                                      "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                                      "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}
        if every or "queues" in include:
            load["queues"] = {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0}
        load["num_total_reqs"] = running + waiting
        return _json({
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "version": self.tokenizer.version, "dp_rank_count": 1, "loads": [load],
            "aggregate": {"total_running_reqs": running, "total_waiting_reqs": waiting, "total_reqs": running + waiting,
                          "avg_token_usage": load["token_usage"], "avg_throughput": load["gen_throughput"],
                          "avg_utilization": load["utilization"]},
        })

    async def set_internal_state(self, request: HttpRequest) -> Response:
        body, error = _body_object(request)
        if error is not None:
            return error
        updates = body.get("server_args")
        if not isinstance(updates, dict):
            return _validation_error([{"type": "missing" if updates is None else "dict_type",
                                       "loc": ("body", "server_args"), "msg": "Field required"
                                       if updates is None else "Input should be a valid dictionary",
                                       "input": body}])
        return _json(self.tokenizer.set_internal_state(updates))

    async def flush_cache(self, request: HttpRequest) -> Response:
        ok = self.tokenizer.flush_cache()
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n")
        return Response(200 if ok else 400, text.encode(), "text/plain; charset=utf-8")

    async def prometheus(self, request: HttpRequest) -> Response:
        return Response(200, self.metrics.exposition(), CONTENT_TYPE)

    async def generate(self, request: HttpRequest) -> Response | StreamResponse:
        body, error = _body_object(request)
        if error is not None:
            return error
        stream = bool(body.get("stream", False))
        sampling = body.get("sampling_params") or {}
        texts, ids = body.get("text"), body.get("input_ids")
        batch = isinstance(texts, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
        try:
            if not isinstance(sampling, (dict, list)):
                raise ValueError("sampling_params must be a dict.")
            if batch:
                count = len(texts) if isinstance(texts, list) else len(ids)
                reqs = [self.tokenizer.make_request(
                    text=texts[i] if isinstance(texts, list) else None,
                    input_ids=ids[i] if isinstance(ids, list) and texts is None else None,
                    sampling_params=sampling[i] if isinstance(sampling, list) else sampling,
                    rid=None, log_metrics=body.get("log_metrics", True)) for i in range(count)]
            else:
                reqs = [self.tokenizer.make_request(
                    text=texts, input_ids=ids, sampling_params=sampling if isinstance(sampling, dict) else {},
                    rid=body.get("rid") if isinstance(body.get("rid"), str) else None,
                    log_metrics=body.get("log_metrics", True))]
        except ValueError as err:
            self.tokenizer.log.error(f"[http_server] Error: {err}")
            if stream:
                return StreamResponse(_error_stream({"error": {"message": str(err)}}))
            return _error(str(err))
        if stream:
            return StreamResponse(self._generate_stream(reqs, batch))
        outputs = [await _last(self.tokenizer.generate(r)) for r in reqs] if len(reqs) == 1 else \
            await _gather_last(self.tokenizer, reqs)
        return _json(outputs if batch else outputs[0])

    async def _generate_stream(self, reqs, batch: bool) -> AsyncIterator[bytes]:
        async for index, out in _merged(self.tokenizer, reqs):
            if batch:
                out["index"] = index
            yield _sse(out)
        yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------------------------------ OpenAI API

    async def models(self, request: HttpRequest) -> Response:
        args = self.tokenizer.server_args
        name = args.get("served_model_name") or args["model_path"]
        return _json({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
            "parent": None, "max_model_len": self.tokenizer.context_len}]})

    async def completions(self, request: HttpRequest) -> Response | StreamResponse:
        media = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
        if media != "application/json":
            return _validation_error([{"loc": ["header", "content-type"],
                                       "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                                       "type": "value_error"}])
        body, error = _body_object(request)
        if error is not None:
            return error
        problems = _check_completion(body)
        if problems:
            return _validation_error(problems)
        prompt = body["prompt"]
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            return _openai_error("Prompt cannot be empty")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                return _openai_error("The simulator serves one prompt per completion request", "BadRequest")
            prompt = prompt[0]
        if body.get("n", 1) != 1:
            return _openai_error("The simulator serves n=1 only", "BadRequest")
        sampling = {"max_new_tokens": body.get("max_tokens", 16), "min_new_tokens": body.get("min_tokens", 0)}
        try:
            req = self.tokenizer.make_request(
                text=prompt if isinstance(prompt, str) else None,
                input_ids=prompt if isinstance(prompt, list) else None, sampling_params=sampling,
                rid=f"cmpl-{uuid.uuid4().hex}")
        except ValueError as err:
            return _openai_error(str(err), "BadRequest")
        model = body.get("model", DEFAULT_MODEL_NAME)
        echo = prompt if body.get("echo") and isinstance(prompt, str) else ""
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return StreamResponse(self._completion_stream(req, model, echo, options))
        out = await _last(self.tokenizer.generate(req))
        meta = out["meta_info"]
        finish = meta["finish_reason"]
        return _json({
            "id": meta["id"], "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": echo + out["text"], "logprobs": None,
                         "finish_reason": finish["type"] if finish else None,
                         "matched_stop": finish.get("matched") if finish else None}],
            "usage": _usage(meta["prompt_tokens"], meta["completion_tokens"]),
            "metadata": {"weight_version": meta["weight_version"]},
        })

    async def _completion_stream(self, req, model: str, echo: str, options: dict) -> AsyncIterator[bytes]:
        """openai/serving_completions.py _generate_completion_stream: deltas of the cumulative text."""
        created = int(time.time())
        stream_buffer = ""
        meta = {}
        try:
            async for out in self.tokenizer.generate(req):
                meta = out["meta_info"]
                text = out["text"]
                if not stream_buffer and echo:
                    text = echo + text
                delta = text[len(stream_buffer):]
                stream_buffer += delta
                finish = meta["finish_reason"]
                chunk = {"id": meta["id"], "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": 0, "text": delta, "logprobs": None,
                                      "finish_reason": finish["type"] if finish else None,
                                      "matched_stop": finish.get("matched") if finish else None}],
                         "usage": None}
                if options.get("continuous_usage_stats"):
                    chunk["usage"] = _usage(meta["prompt_tokens"], meta["completion_tokens"])
                yield _sse(chunk)
            if options.get("include_usage") and meta:
                usage = {k: v for k, v in _usage(meta["prompt_tokens"], meta["completion_tokens"]).items()
                         if v is not None}
                yield _sse({"id": meta["id"], "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": usage})
        except ValueError as err:
            yield _sse({"error": {"object": "error", "message": str(err), "type": "BadRequestError",
                                  "param": None, "code": 400}})
        yield b"data: [DONE]\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None, "reasoning_tokens": 0}


def _check_completion(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The pydantic checks of CompletionRequest that a client can trip (protocol.py:236-309)."""
    problems = []
    if "prompt" not in body:
        problems.append({"type": "missing", "loc": ("body", "prompt"), "msg": "Field required", "input": body})
    elif not isinstance(body["prompt"], (str, list)):
        problems.append({"type": "string_type", "loc": ("body", "prompt"), "msg": "Input should be a valid string",
                         "input": body["prompt"]})
    for key in ("max_tokens", "n", "min_tokens"):
        value = body.get(key, 1)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append({"type": "int_type", "loc": ("body", key), "msg": "Input should be a valid integer",
                             "input": value})
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens <= 0:
        problems.append({"type": "value_error", "loc": ("body", "max_tokens"),
                         "msg": "Value error, max_tokens must be positive", "input": max_tokens,
                         "ctx": {"error": "max_tokens must be positive"}})
    if "stream_options" in body and body["stream_options"] is not None and not isinstance(body["stream_options"], dict):
        problems.append({"type": "model_type", "loc": ("body", "stream_options"),
                         "msg": "Input should be a valid dictionary or instance of StreamOptions",
                         "input": body["stream_options"]})
    return problems


async def _error_stream(value: Any) -> AsyncIterator[bytes]:
    yield _sse(value)
    yield b"data: [DONE]\n\n"


async def _last(outputs: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    last = None
    async for out in outputs:
        last = out
    return last


async def _gather_last(tokenizer: TokenizerManager, reqs) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(_last(tokenizer.generate(r)) for r in reqs)))


async def _merged(tokenizer: TokenizerManager, reqs) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, req) -> None:
        try:
            async for out in tokenizer.generate(req):
                await queue.put((index, out))
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
