"""The Tinker service: sessions, training runs (one LoRA adapter each), sampling sessions,
and the one worker thread that runs their requests on the devices.

The HTTP handlers only check a request and queue it (answering a future's id at once);
the worker takes, in turn: control requests (new adapters), then the head of every
training run's queue -- a run's requests run in seq_id order, one at a time, while
forward_backward heads of several runs with the same loss run as ONE batched program
(serve.adapters), and so do the optim_step heads of several runs -- then every queued
sample request, decoded together per sampling session. A request that fails fails its
own future only; the worker goes on.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import os
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.rollout.engine_config import EngineConfig
from jaxrl_post.rollout.weights import engine_form, split_layers
from jaxrl_post.serve import requests as R
from jaxrl_post.serve import store as S
from jaxrl_post.serve import wire
from jaxrl_post.serve.adapters import ATTN, MLP, AdapterBank, Row
from jaxrl_post.serve.config import ServeConfig
from jaxrl_post.serve.futures import Futures
from jaxrl_post.serve.sampling import Engines, Session, Weights, seeds, snapshot

log = logging.getLogger("jaxrl_post.serve")


class NotFound(UserError):
  """An id the server does not know (HTTP 404)."""


@dataclasses.dataclass(order=True)
class Op:
  seq_id: int
  order: int
  kind: str = dataclasses.field(compare=False)
  rid: str = dataclasses.field(compare=False)
  work: Any = dataclasses.field(compare=False)  # rows + loss for forward_backward, else a callable


@dataclasses.dataclass
class Run:
  """A training client: its adapter's slot and its queued requests."""

  model_id: str
  base_model: str
  rank: int
  slot: int
  ops: list = dataclasses.field(default_factory=list)  # heap of Op
  seen: dict = dataclasses.field(default_factory=dict)  # seq_id -> request id
  # Its client's pace, by steps: a step starts with the first forward_backward after an
  # optim_step (a client may send several per step).
  step_start: float = 0.0  # time.monotonic() of the last step's first forward_backward
  step_every: float = 0.0  # seconds between the last two steps' (0: fewer than two yet)
  stepped: bool = True  # an optim_step came since that forward_backward

  def submitted(self, kind: str, now: float) -> None:
    if kind == "optim_step":
      self.stepped = True
    elif kind == "forward_backward" and self.stepped:
      self.step_every = now - self.step_start if self.step_start else 0.0
      self.step_start, self.stepped = now, False

  def expects_fb(self, now: float) -> bool:
    """Whether its client, stepping at the pace of its last two steps, is about to send
    the next step's forward_backward."""
    return self.stepped and now - self.step_start < 1.5 * self.step_every


@dataclasses.dataclass
class Served:
  """The base model the server was started with."""

  name: str  # what clients call it (get_info's model_name)
  cfg: ModelConfig
  params: Optional[dict]  # params_of, without adapters (Service keeps them as its base)
  tokenizer_dir: str  # tokenizer.json for the client's AutoTokenizer
  eos_ids: tuple[int, ...]
  encode: Callable[[str], list[int]]
  aliases: tuple[str, ...] = ()  # other names create_model may use for it


def shared_base(cfg: ModelConfig, params: dict, engine: EngineConfig, mesh=None) -> dict:
  """`params` placed once for every bank and engine (replicated over `mesh`), in the form
  the engines hold (rollout.weights.engine_form)."""
  if mesh is not None:
    params = jax.device_put(params, NamedSharding(mesh, P()))
  if engine_form(cfg, mesh, engine.split_layers) is None:
    return params
  return split_layers(params, cfg.num_layers)


class Service:
  def __init__(self, served: Served, cfg: ServeConfig, workdir: str, mesh=None):
    self.served, self.cfg, self.mesh = served, cfg, mesh
    self.store = S.Store(workdir)
    self.futures = Futures(cfg.keep_results_s)
    self.banks: dict[int, AdapterBank] = {}
    self.runs: dict[str, Run] = {}
    self.sessions: dict[str, dict] = {}
    self.samplers: dict[str, Session] = {}
    # The base weights once, for the adapter banks and the engines alike: replicated over
    # the mesh, in the engines' form (split per layer on a GPU, so the training programs
    # read each layer's weights in place too); the loaded copy is not kept.
    self.base = shared_base(served.cfg, served.params, cfg.engine, mesh)
    self.served = dataclasses.replace(served, params=None)
    self.engines = Engines(served.cfg, self.base, cfg.engine, cfg.lora_alpha,
                           cfg.max_samplers + 1, mesh)
    self._cv = threading.Condition()
    self._control: list[tuple[str, Callable]] = []
    self._samples: list[tuple[str, str, R.Sample]] = []  # (request id, sampler id, request)
    self._order = itertools.count()
    self._ended: set[str] = set()  # Finished sessions: no new adapters.
    self._rng = np.random.default_rng()
    self._stop = False
    self._worker = threading.Thread(target=self._loop, name="serve-worker", daemon=True)
    self._worker.start()

  def close(self) -> None:
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    self._worker.join(timeout=60)

  # ---------------------------------------------------------------- sessions and info

  def create_session(self, body: dict) -> dict:
    sid = f"session-{uuid.uuid4().hex[:12]}"
    with self._cv:
      self.sessions[sid] = {"created": time.time(), "heartbeat": time.time()}
    return {"type": "create_session", "session_id": sid}

  def heartbeat(self, body: dict) -> dict:
    session = self.sessions.get(R.field(body, "session_id", str))
    if session is not None:
      session["heartbeat"] = time.time()
    return {"type": "session_heartbeat"}

  def finish(self, sid: str) -> dict:
    """A client closed its session: its adapters' slots and its samplers are freed (its
    saved checkpoints stay). Requests still queued for them fail."""
    with self._cv:
      self.sessions.pop(sid, None)
      self._ended.add(sid)
      runs = [r for m, r in self.runs.items() if m.startswith(f"{sid}:train:")]
      for run in runs:
        del self.runs[run.model_id]
        for op in run.ops:
          self.futures.fail(op.rid, f"model {run.model_id}: its session has ended", "user")
        run.ops.clear()
      for key in [k for k in self.samplers if k.startswith(f"{sid}:")]:
        del self.samplers[key]
    self._control_op(lambda: self._release(runs))
    return {}

  def _release(self, runs: list["Run"]) -> dict:
    for run in runs:
      self.banks[run.rank].release(run.slot)
    return {"released": len(runs)}

  def _expire_sessions(self) -> None:
    """Sessions whose client sent no heartbeat for ServeConfig.session_timeout_s end."""
    cutoff = time.time() - self.cfg.session_timeout_s
    with self._cv:
      stale = [sid for sid, s in self.sessions.items() if s["heartbeat"] < cutoff]
    for sid in stale:
      log.info("session %s sent no heartbeat for %.0f s: ended", sid, self.cfg.session_timeout_s)
      self.finish(sid)

  def capabilities(self) -> dict:
    return {"supported_models": [{"model_name": self.served.name, "trainable": True,
                                  "sampleable": True, "max_context_length": self.cfg.max_length}]}

  def _check_base(self, base_model: str) -> str:
    local = os.path.realpath(base_model) if os.path.exists(base_model) else base_model
    if local not in (self.served.name, *self.served.aliases):
      raise UserError(f"base_model: {base_model!r} is not served here (this server serves "
                      f"{self.served.name!r})")
    return self.served.name

  def info(self, body: dict) -> dict:
    run = self._run(R.field(body, "model_id", str))
    return {"type": "get_info", "model_id": run.model_id, "is_lora": True,
            "lora_rank": run.rank, "model_name": self.served.name,
            "model_data": {"model_name": self.served.name,
                           "tokenizer_id": self.served.tokenizer_dir}}

  def _lookup(self, table: dict, key: str, field: str, what: str):
    with self._cv:
      found = table.get(key)
    if found is None:
      raise NotFound(f"{field}: {key!r} is not {what} of this server")
    return found

  def _run(self, model_id: str) -> Run:
    return self._lookup(self.runs, model_id, "model_id", "a training run")

  # ---------------------------------------------------------------- training runs

  def _bank(self, rank: int) -> AdapterBank:
    if rank not in self.banks:  # Worker thread only: banks change device state.
      lora = self.engines.lora_config(rank)
      self.banks[rank] = AdapterBank(self.served.cfg, self.base, lora,
                                     self.cfg.max_adapters + 1, self.mesh)
      self.banks[rank].reserve()  # The last slot: samplers' prompt logprobs.
    return self.banks[rank]

  def create_model(self, body: dict) -> dict:
    session = R.field(body, "session_id", str)
    seq = R.field(body, "model_seq_id", int)
    base = self._check_base(R.field(body, "base_model", str))
    lora = R.field(body, "lora_config", dict, {})
    rank = R.field(lora, "rank", int, 32)
    if not 1 <= rank <= 256:
      raise UserError(f"lora_config.rank: {rank} (1 to 256 allowed)")
    optimizer = R.field(body, "optimizer_config", dict, {"type": "adamw"})
    if optimizer.get("type", "adamw") != "adamw":
      raise UserError(f"optimizer_config.type: {optimizer.get('type')!r} is not supported (adamw)")
    seed = R.field(lora, "seed", int, int(self._rng.integers(0, 2**31)))
    targets = R.lora_targets(lora, ATTN, MLP)
    model_id = f"{session}:train:{seq}"

    def create():
      if session in self._ended:
        raise UserError(f"session_id: session {session} has ended")
      slot = self._bank(rank).allocate(seed, targets)
      self._add_run(Run(model_id, base, rank, slot))
      return {"type": "create_model", "model_id": model_id}

    return {"request_id": self._control_op(create), "model_id": model_id}

  def _add_run(self, run: Run) -> None:
    with self._cv:
      old = self.runs.get(run.model_id)
      if old is not None:  # The same id created again (a retried request): reuse nothing.
        self.banks[old.rank].release(old.slot)
      self.runs[run.model_id] = run
    self.store.write_run(run.model_id, {"base_model": run.base_model, "rank": run.rank})

  def _control_op(self, fn: Callable) -> str:
    rid = self.futures.create()
    with self._cv:
      self._control.append((rid, fn))
      self._cv.notify_all()
    return rid

  def _queue(self, run: Run, seq_id: int, kind: str, work: Any) -> dict:
    with self._cv:
      if seq_id in run.seen:  # A retried submit: the request it already queued.
        return {"request_id": run.seen[seq_id], "model_id": run.model_id}
      rid = self.futures.create()
      run.seen[seq_id] = rid
      run.submitted(kind, time.monotonic())
      heapq.heappush(run.ops, Op(seq_id, next(self._order), kind, rid, work))
      self._cv.notify_all()
    return {"request_id": rid, "model_id": run.model_id}

  def forward_backward(self, body: bytes) -> dict:
    req = wire.forward_backward_request(body)
    run = self._run(req.model_id)
    rows = R.rows(req, run.slot, self.served.cfg.vocab_size, self.cfg.max_length)
    key = (req.loss_fn, tuple(sorted(req.loss_fn_config.items())), req.forward_only)
    return self._queue(run, req.seq_id, "forward_backward", (key, rows))

  def optim_step(self, body: dict) -> dict:
    run = self._run(R.field(body, "model_id", str))
    return self._queue(run, R.field(body, "seq_id", int), "optim_step", R.adam(body))

  def save_weights(self, body: dict) -> dict:
    run = self._run(R.field(body, "model_id", str))
    path = S.tinker_path(run.model_id, "weights", S.check_name(R.field(body, "path", str)))

    def save():
      bank = self.banks[run.rank]
      tree = {"adapter": bank.adapter(run.slot), **bank.optimizer_state(run.slot)}
      self.store.save(path, jax.device_get(tree), self._meta(run))
      return {"type": "save_weights", "path": path}

    return self._queue(run, R.field(body, "seq_id", int), "save_weights", save)

  def _meta(self, run: Run) -> dict:
    return {"base_model": run.base_model, "rank": run.rank, "model_id": run.model_id,
            "targets": list(self.banks[run.rank].targets[run.slot])}

  def save_weights_for_sampler(self, body: dict) -> dict:
    run = self._run(R.field(body, "model_id", str))
    name = R.field(body, "path", str, None)
    if name is None:
      R.field(body, "sampling_session_seq_id", int)  # The unnamed form carries one.
    path = None if name is None else S.tinker_path(run.model_id, "sampler_weights",
                                                   S.check_name(name))

    def save():
      adapter = self.banks[run.rank].adapter(run.slot)
      if path is not None:
        self.store.save(path, jax.device_get(adapter), self._meta(run))
        return {"type": "save_weights_for_sampler", "path": path}
      sid = f"{run.model_id}:sample:{uuid.uuid4().hex[:8]}"
      with self._cv:
        self.samplers[sid] = Session(run.base_model, None, Weights(run.rank, snapshot(adapter)))
      return {"type": "save_weights_for_sampler", "sampling_session_id": sid}

    return self._queue(run, R.field(body, "seq_id", int), "save_weights_for_sampler", save)

  def load_weights(self, body: dict) -> dict:
    path = R.field(body, "path", str)
    meta = self.store.meta(path)
    if S.parse(path)[1] != "weights":
      raise UserError(f"path: {path} holds sampler weights; load_weights needs a save_state path")
    optimizer = bool(R.field(body, "optimizer", bool, False))
    if body.get("model_id") is not None:  # Into an existing run, in its request order.
      run = self._run(body["model_id"])
      if run.rank != meta["rank"]:
        raise UserError(f"path: {path} is a rank-{meta['rank']} adapter; model "
                        f"{run.model_id} has rank {run.rank}")
      load = lambda: self._load_into(run, path, meta, optimizer)
      return self._queue(run, R.field(body, "seq_id", int), "load_weights", load)
    session = R.field(body, "session_id", str)
    model_id = f"{session}:train:{R.field(body, 'model_seq_id', int)}"

    def create():
      if session in self._ended:
        raise UserError(f"session_id: session {session} has ended")
      run = Run(model_id, meta["base_model"], meta["rank"],
                self._bank(meta["rank"]).allocate(0, _targets(meta)))
      self._add_run(run)
      return self._load_into(run, path, meta, optimizer)

    return {"request_id": self._control_op(create), "model_id": model_id}

  def _load_into(self, run: Run, path: str, meta: dict, optimizer: bool) -> dict:
    bank = self.banks[run.rank]
    like = jax.device_get({"adapter": bank.adapter(run.slot), **bank.optimizer_state(run.slot)})
    tree = self.store.load(path, like)
    state = {"mu": tree["mu"], "nu": tree["nu"], "steps": tree["steps"]} if optimizer else None
    bank.set_adapter(run.slot, tree["adapter"], state)
    return {"type": "load_weights", "path": path, "model_id": run.model_id}

  # ---------------------------------------------------------------- sampling

  def create_sampling_session(self, body: dict) -> dict:
    path = R.field(body, "model_path", str, None)
    if path is not None:
      meta = self.store.meta(path)
      session = Session(meta["base_model"], path, None)
    else:
      session = Session(self._check_base(R.field(body, "base_model", str)))
    # Named under its session, so the session's end frees it.
    sid = f"{R.field(body, 'session_id', str, 'none')}:sample:{uuid.uuid4().hex[:12]}"
    with self._cv:
      self.samplers[sid] = session
    return {"type": "create_sampling_session", "sampling_session_id": sid}

  def sampler(self, sid: str) -> Session:
    return self._lookup(self.samplers, sid, "sampling_session_id", "a sampling session")

  def sampler_info(self, sid: str) -> dict:
    s = self.sampler(sid)
    return {"sampler_id": sid, "base_model": s.base_model, "model_path": s.model_path}

  def asample(self, body: dict) -> dict:
    sid = R.field(body, "sampling_session_id", str)
    self.sampler(sid)
    served = self.served
    req = R.sample(body, served.cfg.vocab_size, self.cfg.max_length, self.cfg.default_max_tokens,
                   served.eos_ids, served.encode)
    rid = self.futures.create()
    with self._cv:
      self._samples.append((rid, sid, req))
      self._cv.notify_all()
    ids = [f"{rid}:{i}" for i in range(req.num_samples)]  # The SDK requires one per sample.
    return {"request_id": rid, "sample_sequence_ids": ids}

  def _weights(self, session: Session) -> Optional[Weights]:
    if session.weights is None and session.model_path is not None:  # Read once, when used.
      meta = self.store.meta(session.model_path)
      like = jax.device_get(self._bank(meta["rank"]).adapter(0))
      session.weights = Weights(meta["rank"], self.store.load(session.model_path, like))
    return session.weights

  def _run_samples(self, jobs: list[tuple[str, str, R.Sample]]) -> None:
    ready = []
    for rid, sid, req in jobs:
      try:  # A checkpoint that cannot be read fails its own requests only.
        ready.append((self._weights(self.samplers[sid]), req, rid))
      except UserError as e:
        self.futures.fail(rid, str(e).splitlines()[0])
    seeded = [(w, req, seed, rid) for (w, req, rid), seed
              in zip(ready, seeds(self._rng, [req for _, req, _ in ready]))]
    for rank, part in self.engines.batches(seeded):
      for (weights, req, _, rid), completions in zip(part, self.engines.sample(rank, part)):
        prompt_lp = self._prompt_logprobs(weights, req.prompt) if req.prompt_logprobs else None
        seqs = [wire.Sequence(list(c.tokens), list(c.logprobs), c.finish_reason == "stop")
                for c in completions]
        self.futures.resolve(rid, wire.sample_response(seqs, prompt_lp))

  def _prompt_logprobs(self, weights: Optional[Weights], prompt: tuple[int, ...]) -> np.ndarray:
    """logp(prompt[i] | prompt[:i]) under the session's weights; NaN at 0. Runs the
    training forward on the bank's scratch slot, so it is the trainer's number."""
    bank = self._bank(weights.rank if weights is not None else 1)
    scratch = bank.capacity - 1
    adapter = weights.adapter if weights is not None else jax.tree.map(
        jax.numpy.zeros_like, bank.adapter(scratch))
    bank.set_adapter(scratch, adapter, None)
    tokens = np.asarray(prompt, np.int32)
    row = Row(scratch, tokens[:-1], {"target_tokens": tokens[1:],
                                     "weights": np.ones(len(tokens) - 1, np.float32)})
    out = np.full((len(tokens),), np.nan, np.float32)
    if len(tokens) > 1:
      out[1:] = bank.forward_backward([row], "cross_entropy", {}, True)[0][0]
    return out

  # ---------------------------------------------------------------- futures

  def retrieve(self, rid: str, timeout: float):
    if not self.futures.known(rid):
      raise NotFound(f"request_id: {rid!r} is not a request of this server")
    return self.futures.wait(rid, timeout)

  # ---------------------------------------------------------------- REST listing

  def training_run(self, model_id: str) -> dict:
    meta = self.store.run(model_id)
    if meta is None:
      raise NotFound(f"training run {model_id!r} does not exist on this server")
    checkpoints = self.store.checkpoints(model_id)
    last = lambda kind: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind),
                             None)
    return {"training_run_id": model_id, "base_model": meta["base_model"], "model_owner": "local",
            "is_lora": True, "lora_rank": meta["rank"], "corrupted": False,
            "last_request_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "last_checkpoint": last("training"), "last_sampler_checkpoint": last("sampler")}

  def weights_info(self, body: dict) -> dict:
    meta = self.store.meta(R.field(body, "tinker_path", str))
    targets = set(_targets(meta))
    return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": meta["rank"],
            "train_attn": set(ATTN) <= targets, "train_mlp": set(MLP) <= targets,
            "train_unembed": False}

  # ---------------------------------------------------------------- the worker

  def _loop(self) -> None:
    while True:
      self._expire_sessions()
      with self._cv:
        if not self._cv.wait_for(lambda: self._stop or self._has_work(), timeout=30):
          continue
        if self._stop:
          return
        # Lets the others join this batch (the lock is released meanwhile): until each has
        # sent its request, or batch_wait_s has passed.
        deadline = time.monotonic() + self.cfg.batch_wait_s
        while self._others_due() and (left := deadline - time.monotonic()) > 0:
          self._cv.wait(left)
        job = self._next_job()
      job()

  def _others_due(self) -> bool:
    """Whether the queued forward_backward requests wait for other runs' next one: clients
    stepping in lockstep send theirs within moments of each other."""
    if self._control or self.cfg.batch_wait_s <= 0:
      return False
    waiting = [r for r in self.runs.values() if r.ops]
    if not waiting or any(r.ops[0].kind != "forward_backward" for r in waiting):
      return False
    now = time.monotonic()
    return any(r.expects_fb(now) for r in self.runs.values() if not r.ops)

  def _has_work(self) -> bool:
    return bool(self._control or self._samples or any(r.ops for r in self.runs.values()))

  def _next_job(self) -> Callable[[], None]:
    """Under the lock: the next piece of work, taken off its queue."""
    if self._control:
      rid, fn = self._control.pop(0)
      return lambda: self._resolve([rid], fn)
    heads = sorted((r.ops[0], r) for r in self.runs.values() if r.ops)
    if heads:
      single = [(op, r) for op, r in heads if op.kind != "forward_backward"]
      if single and single[0][0].order <= heads[0][0].order:
        op, run = single[0]
        if op.kind == "optim_step":
          return self._optim_steps([(o, r) for o, r in single if o.kind == "optim_step"])
        heapq.heappop(run.ops)
        return lambda: self._resolve([op.rid], op.work)
      return self._batch(heads)
    jobs, self._samples = self._samples, []
    return lambda: self._guard([rid for rid, _, _ in jobs], lambda: self._run_samples(jobs))

  def _batch(self, heads) -> Callable[[], None]:
    """The forward_backward heads sharing the oldest one's loss, with each run's following
    forward_backward requests of that loss: one batched program."""
    oldest = min((op for op, _ in heads if op.kind == "forward_backward"), key=lambda o: o.order)
    key, taken = oldest.work[0], []
    for _, run in heads:
      while run.ops and run.ops[0].kind == "forward_backward" and run.ops[0].work[0] == key:
        taken.append((heapq.heappop(run.ops), run))
    return lambda: self._guard([op.rid for op, _ in taken], lambda: self._run_batch(key, taken))

  def _optim_steps(self, heads) -> Callable[[], None]:
    """Every run whose next request is an optim_step: one optimizer program per rank."""
    for _, run in heads:
      heapq.heappop(run.ops)
    return lambda: self._guard([op.rid for op, _ in heads], lambda: self._run_optims(heads))

  def _run_optims(self, heads) -> None:
    for rank in {run.rank for _, run in heads}:
      part = [(op, run) for op, run in heads if run.rank == rank]
      stats = self.banks[rank].optim_steps([(run.slot, op.work) for op, run in part])
      for (op, _), metrics in zip(part, stats):
        self.futures.resolve(op.rid, {"metrics": {f"optim/{k}": v for k, v in metrics.items()}})

  def _run_batch(self, key, taken) -> None:
    loss_fn, config, forward_only = key
    by_rank: dict[int, list] = {}
    for op, run in taken:
      by_rank.setdefault(run.rank, []).append(op)
    for rank, ops in by_rank.items():
      rows = [row for op in ops for row in op.work[1]]
      logps, losses = self.banks[rank].forward_backward(rows, loss_fn, dict(config), forward_only)
      i = 0
      for op in ops:
        n = len(op.work[1])
        # How many adapters shared the program (the SDK sums or maxes metrics by suffix).
        metrics = {"loss:sum": float(np.sum(losses[i:i + n])), "batch_adapters:max": len(ops)}
        self.futures.resolve(op.rid, wire.forward_backward_output({"logprobs": logps[i:i + n]},
                                                                  metrics))
        i += n

  def _resolve(self, rids: list[str], fn: Callable[[], dict]) -> None:
    self._guard(rids, lambda: self.futures.resolve(rids[0], fn()))

  def _guard(self, rids: list[str], fn: Callable[[], None]) -> None:
    """Runs fn; a failure fails these requests' futures (those not resolved yet) only."""
    try:
      fn()
    except UserError as e:
      for rid in rids:
        self.futures.fail(rid, str(e).splitlines()[0], "user")
    except Exception as e:  # noqa: BLE001  (the worker must outlive any one request)
      log.error("request failed:\n%s", traceback.format_exc())
      for rid in rids:
        self.futures.fail(rid, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                          "server")


def _targets(meta: dict) -> tuple[str, ...]:
  """The matrices a saved adapter's run trained (all, for checkpoints saved before runs
  could choose)."""
  return tuple(meta.get("targets", ATTN + MLP))
