"""Compiling the engine's programs before a job needs them, on a thread of their own.

A job's first prefill, first-token and decode programs would otherwise compile one after
another on the caller's thread; `CompileAhead` compiles the ones a job will need while the
caller prefills, and a launch waits only for the program it is about to run.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.rollout import compact, programs
from jaxrl_post.rollout.pages import cdiv
from jaxrl_post.rollout.sampling import SamplingParams


class CompileAhead:
  """Programs compiled in order on one thread, each under a key that names its shape."""

  def __init__(self, jobs: dict[Hashable, Callable[[], Any]]):
    self._done = threading.Condition()
    self._pending = list(jobs)
    # Not a daemon: the interpreter's exit waits for it, as a compile cut off in XLA's
    # code at exit aborts the process.
    threading.Thread(target=self._run, args=(jobs,), name="compile-ahead").start()

  def _run(self, jobs: dict[Hashable, Callable[[], Any]]) -> None:
    for key, build in jobs.items():
      try:
        build()
      except Exception:  # pylint: disable=broad-except
        pass  # The call compiles its own program, and raises there if it must.
      with self._done:
        self._pending.remove(key)
        self._done.notify_all()

  def wait(self, key: Hashable) -> None:
    """Returns once the program under `key` is not being compiled here (or never was)."""
    with self._done:
      self._done.wait_for(lambda: key not in self._pending)

  def join(self) -> None:
    """Returns once every program is compiled (or failed to)."""
    with self._done:
      self._done.wait_for(lambda: not self._pending)


class CompileAheadMixin:
  """The Engine's compile-ahead calls (see the module docstring)."""

  def compile_ahead(self, sampling: SamplingParams, prompt_len: int, prompts: int,
                    n: int = 1) -> None:
    """Starts compiling, on a thread, the programs this engine's first calls run for a job
    of `prompts` prompts of up to `prompt_len` tokens, `n` samples each, all sampled with
    `sampling`: the first prefill call's first-token program, the first decode call's, and
    (for a job of more than one decode call) the next narrower width's, which the second
    runs once a quarter of the sequences have ended. A call that needs one of them waits
    for it. For a caller with the whole job in hand, which prefills it first (the generate
    CLI): XLA compiles on one core, so the programs build beside the first prefill compile
    and the prefill instead of on the calls' path. A guess that misses costs the job
    nothing but a core for a while."""
    if self.cascade or self._ahead is not None:
      return
    self._ahead = CompileAhead({**self._first_token_ahead(sampling, prompts, n),
                                 **self._decode_ahead(sampling, prompt_len, prompts * n)})

  def _first_token_ahead(self, sampling: SamplingParams, prompts: int, n: int) -> dict:
    """The first prefill call's first-token program, for prompts it prefills whole."""
    chunks = min(prompts, self.config.prefill_rows * self.shards)
    rows, samples = cdiv(chunks, 8) * 8, cdiv(chunks * n, 8) * 8
    shape = lambda size, dtype: jax.ShapeDtypeStruct(size, dtype, sharding=self.layout.replicated)
    operands = [shape((rows, self.model_config.vocab_size), jnp.float32)] + [
        shape((samples,), dt) for dt in programs.FIRST_TOKEN_OPERANDS]
    static = dict(layout=self.layout, truncation=sampling.truncates, draws=sampling.draws)
    key = ("first", rows, samples, sampling.truncates, sampling.draws)
    return {key: lambda: programs.sample_first.lower(*operands, **static).compile()}

  def _decode_ahead(self, sampling: SamplingParams, prompt_len: int, sequences: int) -> dict:
    """The first decode call's program and, for more than one call, the next narrower."""
    steps, ps = self.config.decode_steps, self.page_size
    written = min(prompt_len + steps, prompt_len + sampling.max_tokens - 1)
    active = np.zeros((self.shards, self.slots_per_shard), bool)
    active[:, :cdiv(min(sequences, self.num_slots), self.shards)] = True
    first = compact.call_width(active.reshape(-1), self.shards, self.config.decode_buckets)
    options = compact.widths(self.slots_per_shard, self.config.decode_buckets)
    at = options.index(first or self.slots_per_shard)
    guesses = [first] + ([options[at - 1]] if at and sampling.max_tokens > steps else [])
    static = dict(cfg=self.model_config, steps=steps, layout=self.layout,
                  width=self._table_width(max(cdiv(written, ps), 1)),
                  truncation=sampling.truncates, draws=sampling.draws)
    # The weights as they are (arrays a prefill never donates: an uncommitted one must stay
    # so, or the program differs); the pool and slots as shapes, since prefill calls on
    # the caller's thread donate them meanwhile.
    shapes = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    operands = (self.params, shapes(self.pool), shapes(self._device_slots), None,
                shapes(self._window_operand()))
    program = programs.decode_program(self.layout)
    build = lambda rows: lambda: program.lower(*operands, rows=rows, **static).compile()
    return {("decode", rows): build(rows) for rows in guesses}
