"""jaxrl_post: RL post-training for language models as one JAX SPMD program."""

__version__ = "0.1.0"
