"""Hugging Face hub ids ("Qwen/Qwen3-0.6B") as model sources, through the hub's own cache.

An id resolves to the snapshot directory huggingface_hub keeps (HF_HUB_CACHE, else
HF_HOME/hub, else ~/.cache/huggingface/hub), downloading only what a model directory here
needs: config.json, the tokenizer files and the safetensors shards. HF_HUB_OFFLINE=1 reads
the cache alone; a hub that cannot be reached falls back to the cache too. Everything after
resolution is the local-directory path (models.hf).
"""

from __future__ import annotations

import os
import re

from jaxrl_post.errors import UserError

# owner/name as the hub spells ids: letters, digits, "-", "_" and "." (not leading).
_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
WEIGHTS = ["*.safetensors", "*.safetensors.index.json"]
CONFIG = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja"]


def is_hub_id(source: str) -> bool:
  """Whether `source` reads as a hub id and names nothing on this disk."""
  return bool(_ID.fullmatch(source)) and not os.path.exists(source)


def snapshot(repo_id: str, weights: bool = True) -> str:
  """The local directory of hub model `repo_id` (downloaded into the hub cache if needed).

  weights False fetches config and tokenizer only (enough to plan a run).

  Raises:
    UserError: the id is neither cached nor downloadable (one line naming it).
  """
  from huggingface_hub import snapshot_download
  from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                      RepositoryNotFoundError, RevisionNotFoundError)

  patterns = CONFIG + (WEIGHTS if weights else [])
  try:
    path = snapshot_download(repo_id, allow_patterns=patterns)
  except LocalEntryNotFoundError as e:
    raise UserError(f"model {repo_id!r}: not in the Hugging Face cache and the hub cannot "
                    "be reached (or HF_HUB_OFFLINE is set); download it once with network "
                    "access, or give a local directory") from e
  except (RepositoryNotFoundError, RevisionNotFoundError) as e:
    raise UserError(f"model {repo_id!r}: no such model on the Hugging Face hub") from e
  except GatedRepoError as e:
    raise UserError(f"model {repo_id!r}: gated on the Hugging Face hub; accept its terms "
                    "and log in (HF_TOKEN)") from e
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise UserError(f"model {repo_id!r}: its hub snapshot {path} has no config.json")
  return path


def local_source(source: str, weights: bool = True) -> str:
  """`source` itself, or for a hub id its snapshot directory (see snapshot)."""
  return snapshot(source, weights) if is_hub_id(source) else source
