"""Saved adapters under the server's directory, addressed by tinker:// paths.

tinker://<model_id>/<kind>/<name> is <workdir>/runs/<model_id>/<kind>/<name>/: kind
`weights` holds an adapter with its optimizer state (save_state), `sampler_weights` the
adapter alone. Orbax writes the arrays into a temporary directory it renames when done;
meta.json is written after that, so a directory without it (a save cut off) is never
listed or loaded.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from typing import Any, Optional

import numpy as np
import orbax.checkpoint as ocp

from jaxrl_post.errors import UserError

KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def tinker_path(model_id: str, kind: str, name: str) -> str:
  return f"tinker://{model_id}/{kind}/{name}"


def check_name(name: str) -> str:
  if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
    raise UserError(f"path: {name!r} is not a checkpoint name (letters, digits, '.', '_', '-')")
  return name


def parse(path: str) -> tuple[str, str, str]:
  """(model_id, kind, name) of a tinker:// path."""
  parts = path[len("tinker://"):].split("/") if isinstance(path, str) else []
  if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KINDS:
    raise UserError(f"path: {path!r} is not tinker://<model_id>/<weights|sampler_weights>/<name>")
  check_name(parts[2])
  return parts[0], parts[1], parts[2]


class Store:
  def __init__(self, workdir: str):
    self.root = os.path.join(os.path.abspath(workdir), "runs")
    os.makedirs(self.root, exist_ok=True)

  def _dir(self, model_id: str, kind: str = "", name: str = "") -> str:
    return os.path.join(self.root, model_id, kind, name)

  # ---------------------------------------------------------------- runs

  def write_run(self, model_id: str, meta: dict) -> None:
    os.makedirs(self._dir(model_id), exist_ok=True)
    _write_json(os.path.join(self._dir(model_id), "run.json"), meta)

  def run(self, model_id: str) -> Optional[dict]:
    return _read_json(os.path.join(self._dir(model_id), "run.json"))

  def runs(self) -> list[str]:
    return sorted(m for m in os.listdir(self.root) if self.run(m) is not None)

  # ---------------------------------------------------------------- checkpoints

  def save(self, path: str, tree: dict, meta: dict) -> None:
    model_id, kind, name = parse(path)
    where = self._dir(model_id, kind, name)
    if os.path.exists(os.path.join(where, "meta.json")):
      raise UserError(f"path: {path} exists already")
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(os.path.join(where, "arrays"), tree, force=True)
      ckpt.wait_until_finished()
    _write_json(os.path.join(where, "meta.json"), {**meta, "time": _now()})

  def meta(self, path: str) -> dict:
    model_id, kind, name = parse(path)
    meta = _read_json(os.path.join(self._dir(model_id, kind, name), "meta.json"))
    if meta is None:
      raise UserError(f"path: {path} does not exist on this server")
    return meta

  def load(self, path: str, like: Any) -> Any:
    """The arrays saved at `path`, as the abstract tree `like` says."""
    self.meta(path)
    model_id, kind, name = parse(path)
    with ocp.StandardCheckpointer() as ckpt:
      return ckpt.restore(os.path.join(self._dir(model_id, kind, name), "arrays"), like)

  def checkpoints(self, model_id: str) -> list[dict]:
    """The complete checkpoints of a run, as the REST API lists them."""
    out = []
    for kind in KINDS:
      where = self._dir(model_id, kind)
      for name in sorted(os.listdir(where)) if os.path.isdir(where) else ():
        meta = _read_json(os.path.join(where, name, "meta.json"))
        if meta is not None:
          out.append({"checkpoint_id": f"{kind}/{name}", "time": meta["time"],
                      "checkpoint_type": "training" if kind == "weights" else "sampler",
                      "tinker_path": tinker_path(model_id, kind, name), "public": False})
    return out


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat()


def _write_json(path: str, value: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, default=_plain)
  os.replace(tmp, path)  # Whole or absent, never half written.


def _plain(x):
  return x.item() if isinstance(x, np.generic) else str(x)


def _read_json(path: str) -> Optional[dict]:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None
