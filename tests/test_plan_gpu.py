"""The rollout's decode loop as XLA:GPU compiles it for an H100, on this CPU host (the
gpu-plan extra: jax's CUDA plugin and ptxas): each layer's weights are read in place.

XLA:GPU copies a scanned layer's slice of a stacked weight into a buffer of its own
before a matmul reads it; on a GPU the engine holds its weights one buffer per layer
(rollout.weights) so no such copy is left in the loop. The stacked form compiled beside it
shows the copies, so the check sees them where they are.
"""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_post.plan import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = """
import json
from jaxrl_post.plan import targets
target = targets.resolve("h100x1")
targets.prepare(target)
import jax, numpy as np
from jax.sharding import Mesh
from jaxrl_post.models import ModelConfig
from jaxrl_post.plan import memory
from jaxrl_post.plan.hlo_cost import loop_launches
from jaxrl_post.rollout.layout import RolloutLayout
from jaxrl_post.sharding import AXES
cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=64, param_dtype="bfloat16",
                  compute_dtype="bfloat16", max_position_embeddings=256)
device = targets.target_devices(target).devices[0]
mesh = Mesh(np.asarray([device], dtype=object).reshape((1,) * len(AXES)), AXES)
out = {}
for split in (False, True):
  layout = RolloutLayout.build(cfg, mesh, split)
  args = memory.decode_operands(cfg, 8, 1 + 8 * 4, 16, 4, "bfloat16", "bfloat16", 8, layout)
  text = memory.lower_decode(cfg, *args, 4, layout, False).compile().as_text()
  out["split" if split else "stacked"] = loop_launches(text)
print(json.dumps(out))
"""


@pytest.mark.skipif(not targets.has_cuda_compiler(),
                    reason="needs the gpu-plan extra (jax's CUDA plugin and ptxas)")
def test_the_h100_decode_loop_copies_no_layer_weights():
  out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  launches = json.loads(out.stdout.strip().splitlines()[-1])
  stacked, split = launches["stacked"]["by_kind"], launches["split"]["by_kind"]
  assert stacked.get("slice_copy", 0) >= 3 * 7  # 7 matrices (and norms) per layer
  assert "slice_copy" not in split and "copy" not in split, split
  # A layer is a handful of launches: norms, 4 matmuls, the K/V write, attention, adds.
  assert launches["split"]["total"] <= 3 * 20 + 20, launches["split"]
