"""jaxrl_post: RL post-training for language models as one JAX SPMD program."""

import os as _os

from jaxrl_post import _checkout, cuda_plugin, libtpu_plugin
from jaxrl_post.plugins import register  # Your own task or environment, in gin.

__version__ = "0.1.0"

_checkout.install(__name__, _os.path.dirname(__file__))
libtpu_plugin.quiet_without_tpu()  # Before jax starts a backend: every command imports us first.
cuda_plugin.quiet_without_gpu()
cuda_plugin.share_gpu_memory()
