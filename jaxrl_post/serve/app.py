"""The HTTP surface of the Tinker API (paths under /api/v1/), on Starlette.

Handlers check and queue; the Service's worker does the device work. A UserError is a 400
with {"detail": message} (404 for an unknown id): the client retries 408, 409, 429 and 5xx
for minutes, so a request that can never succeed must never get one of those.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from typing import Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxrl_post.errors import UserError
from jaxrl_post.serve.service import NotFound, Service

log = logging.getLogger("jaxrl_post.serve")
PROTO = "application/x-protobuf"


def _answer(fn: Callable[[Request], Awaitable[object]]):
  async def handler(request: Request) -> Response:
    try:
      out = await fn(request)
    except NotFound as e:
      return JSONResponse({"detail": str(e).splitlines()[0]}, status_code=404)
    except UserError as e:
      return JSONResponse({"detail": str(e).splitlines()[0]}, status_code=400)
    return out if isinstance(out, Response) else JSONResponse(out)
  return handler


async def _json(request: Request) -> dict:
  raw = await request.body()
  try:
    body = json.loads(raw) if raw else {}
  except ValueError as e:
    raise UserError(f"request body: not JSON ({e})") from e
  if not isinstance(body, dict):
    raise UserError("request body: expected a JSON object")
  return body


def build(service: Service) -> Starlette:
  """The app; every route's work is one Service method."""
  limiter = anyio.CapacityLimiter(256)  # Threads for long polls (each holds one).

  def post(fn: Callable[[dict], object]):
    async def run(request: Request):
      return fn(await _json(request))
    return run

  async def forward_backward(request: Request):
    if request.headers.get("content-encoding", "") not in ("", "identity"):
      raise UserError("forward_backward: compressed bodies are not supported")
    return service.forward_backward(await request.body())

  async def retrieve_future(request: Request):
    body = await _json(request)
    rid = body.get("request_id")
    if not isinstance(rid, str):
      raise UserError(f"request_id: expected a string, got {rid!r}")
    result = await anyio.to_thread.run_sync(service.retrieve, rid, service.cfg.poll_seconds,
                                            limiter=limiter)
    if result is None:
      return {"type": "try_again", "request_id": rid, "queue_state": "active"}
    if result.proto:
      return Response(result.payload, media_type=PROTO)
    return result.payload

  async def finish(request: Request):
    return service.finish(request.path_params["sid"])

  async def sampler(request: Request):
    return service.sampler_info(request.path_params["sid"])

  async def training_run(request: Request):
    return service.training_run(request.path_params["rid"])

  async def checkpoints(request: Request):
    return {"checkpoints": service.store.checkpoints(request.path_params["rid"]), "cursor": None}

  async def training_runs(request: Request):
    runs = [service.training_run(m) for m in service.store.runs()]
    return {"training_runs": runs, "cursor": {"offset": 0, "limit": len(runs),
                                              "total_count": len(runs)}}

  async def constant(value):
    return value

  def fixed(value):
    return lambda request: constant(value)

  routes = {
      "client/config": post(lambda b: {}),
      "client/dynamic_config": post(lambda b: {}),
      "create_session": post(service.create_session),
      "session_heartbeat": post(service.heartbeat),
      "telemetry": post(lambda b: {"status": "accepted"}),
      "create_model": post(service.create_model),
      "get_info": post(service.info),
      "forward_backward": forward_backward,
      "optim_step": post(service.optim_step),
      "save_weights": post(service.save_weights),
      "save_weights_for_sampler": post(service.save_weights_for_sampler),
      "load_weights": post(service.load_weights),
      "create_sampling_session": post(service.create_sampling_session),
      "asample": post(service.asample),
      "retrieve_future": retrieve_future,
      "weights_info": post(service.weights_info),
  }
  table = [Route(f"/api/v1/{path}", _answer(fn), methods=["POST"]) for path, fn in routes.items()]
  table += [
      Route("/api/v1/sessions/{sid}/finish", _answer(finish), methods=["POST"]),
      Route("/api/v1/get_server_capabilities", _answer(fixed(service.capabilities())),
            methods=["GET"]),
      Route("/api/v1/healthz", _answer(fixed({"status": "ok"})), methods=["GET"]),
      Route("/api/v1/samplers/{sid}", _answer(sampler), methods=["GET"]),
      Route("/api/v1/training_runs", _answer(training_runs), methods=["GET"]),
      Route("/api/v1/training_runs/{rid}", _answer(training_run), methods=["GET"]),
      Route("/api/v1/training_runs/{rid}/checkpoints", _answer(checkpoints), methods=["GET"]),
  ]
  return Starlette(routes=table)


def wait_until_serving(url: str, alive: Callable[[], bool], timeout_s: float) -> bool:
  """Polls `url`'s health route: True once it answers, False when the server process is no
  longer `alive()` or `timeout_s` runs out (for a caller that started it)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and alive():
    try:
      with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=1) as answer:
        if answer.status == 200:
          return True
    except OSError:  # Not listening yet (URLError and timeouts are OSErrors).
      pass
    time.sleep(0.2)
  return False
