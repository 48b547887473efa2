"""A Tinker-compatible service: many LoRA adapters trained and sampled over one base model.

`python -m jaxrl_post.serve` (see __main__.py). The modules, from the wire in:
app (HTTP routes) -> requests (bodies checked) -> service (queues and the worker) ->
adapters (the batched multi-LoRA programs) and sampling (the rollout engines); wire is the
protobuf codec, losses the loss functions clients name, store the saved adapters.
"""
