"""`python -m jaxrl_post.serve` driven by the official tinker SDK, as a user's program would.

One server (the tiny Llama fixture, 8 CPU devices) for the module: two adapters train at
once on different targets in shared batched programs and stay apart; a sampler per adapter
samples with the logprobs a forward pass gives; importance_sampling and ppo steps run;
saved state brings a new client (and a restarted server) back to the same loss; bad
requests fail at once with a message naming the field.
"""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl_post.serve.app import wait_until_serving
from tests.rollout.helpers import LOGPROB_TOL
from tests.sharding.test_multiprocess import free_port
from tests.xla import host_flags

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "hf", "tiny_llama")
pytestmark = [pytest.mark.xdist_group("serve-sdk"),
              pytest.mark.slow(reason="a server process compiled and driven over HTTP")]


class Server:
  def __init__(self, workdir):
    self.workdir, self.port, self.proc = str(workdir), free_port(), None

  def start(self):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=host_flags(8))
    self.log = open(os.path.join(self.workdir, "server.log"), "a")
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "jaxrl_post.serve", f"--port={self.port}", f"--model={MODEL}",
         f"--workdir={self.workdir}", "--gin_param=ServeConfig.max_adapters=4",
         "--gin_param=ServeConfig.poll_seconds=5"], env=env, stdout=self.log, stderr=self.log)
    if wait_until_serving(self.url, lambda: self.proc.poll() is None, 120):
      return self
    assert self.proc.poll() is None, open(os.path.join(self.workdir, "server.log")).read()[-3000:]
    raise AssertionError("the server did not start")

  @property
  def url(self):
    return f"http://127.0.0.1:{self.port}"

  def stop(self):
    self.proc.kill()
    self.proc.wait()
    self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  os.environ.setdefault("TINKER_API_KEY", "tml-local-tests")
  os.environ["TINKER_TELEMETRY"] = "0"
  s = Server(tmp_path_factory.mktemp("serve")).start()
  yield s
  s.stop()


@pytest.fixture(scope="module")
def service(server):
  client = tinker.ServiceClient(base_url=server.url)
  yield client
  client.close("success").result()


def _datum(seq, weights=None):
  n = len(seq) - 1
  return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                     loss_fn_inputs={"target_tokens": seq[1:],
                                     "weights": weights if weights is not None else [1.0] * n})


X = [7, 19, 23, 101, 57, 3, 88, 250, 11, 42, 9, 17]
Y = [300, 2, 64, 128, 5, 77, 13, 201, 44, 8, 90, 31]
ADAM = types.AdamParams(learning_rate=1e-2)


def _loss(client, seq):
  return client.forward([_datum(seq)], "cross_entropy").result().metrics["loss:sum"]


@pytest.fixture(scope="module")
def trained(service):
  """Two adapters, trained concurrently: a on X, b on Y (both queued before either waits)."""
  a = service.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
  b = service.create_lora_training_client(base_model=MODEL, rank=8, seed=2).result()
  shared = []
  for _ in range(12):
    fa = a.forward_backward([_datum(X)], "cross_entropy")
    fb = b.forward_backward([_datum(Y)], "cross_entropy")
    oa, ob = a.optim_step(ADAM), b.optim_step(ADAM)
    shared += [fa.result().metrics["batch_adapters:max"], fb.result().metrics["batch_adapters:max"]]
    oa.result(), ob.result()
  return a, b, shared


def test_two_adapters_train_concurrently_in_shared_programs_and_stay_apart(trained):
  a, b, shared = trained
  assert max(shared) == 2  # Some steps ran both adapters as one program.
  ax, ay, bx, by = _loss(a, X), _loss(a, Y), _loss(b, X), _loss(b, Y)
  # Each learned its own sequence (from about 11 x log(320) = 63), not the other's.
  # (Measured with these seeds: 57.8, 63.6, 63.3, 56.7. LoRA on a random tiny model learns
  # slowly: each path through an adapted block is a product of two adapters that start at
  # zero.)
  assert ax < min(ay, bx) - 4 and by < min(ay, bx) - 4, (ax, ay, bx, by)


def test_each_adapters_samples_carry_the_logprobs_of_a_forward_pass(trained, service):
  """Samplers of both adapters and of the base, their requests all queued before any is
  awaited (they decode in one engine, each sequence with its own adapter)."""
  a, b, _ = trained
  fresh = service.create_lora_training_client(base_model=MODEL, rank=8).result()  # B = 0
  samplers = [(a, a.save_weights_and_get_sampling_client().result(), X),
              (b, b.save_weights_and_get_sampling_client().result(), Y),
              (fresh, service.create_sampling_client(base_model=MODEL).result(), X)]
  params = types.SamplingParams(max_tokens=6, temperature=1.0)
  futures = [(client, seq[:4], sampler.sample(prompt=types.ModelInput.from_ints(seq[:4]),
                                                num_samples=3, sampling_params=params))
             for client, sampler, seq in samplers]
  for client, prompt, future in futures:
    out = future.result()
    assert len(out.sequences) == 3
    for s in out.sequences:
      full = prompt + list(s.tokens)
      fwd = client.forward([_datum(full)], "cross_entropy").result()
      want = fwd.loss_fn_outputs[0]["logprobs"].data[len(prompt) - 1:]
      np.testing.assert_allclose(s.logprobs, want, atol=LOGPROB_TOL)


def test_policy_gradient_losses_run_and_give_their_logprobs(trained):
  a, _, _ = trained
  n = len(X) - 1
  q = a.forward([_datum(X)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
  for loss_fn in ("importance_sampling", "ppo"):
    datum = types.Datum(model_input=types.ModelInput.from_ints(X[:-1]),
                        loss_fn_inputs={"target_tokens": X[1:], "logprobs": q,
                                        "advantages": [1.0] * n})
    out = a.forward_backward([datum], loss_fn).result()
    # At ratio 1 both are -sum(advantages) = -n; the logprobs are the current policy's.
    assert out.metrics["loss:sum"] == pytest.approx(-n, rel=1e-4)
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].data, q, atol=1e-5)


def test_saved_state_reproduces_the_loss_in_a_new_client_and_a_restarted_server(
    trained, service, server):
  a, _, _ = trained
  path = a.save_state("ckpt").result().path
  assert path == f"tinker://{a.model_id}/weights/ckpt"
  want = _loss(a, X)
  again = service.create_training_client_from_state_with_optimizer(path).result()
  assert _loss(again, X) == pytest.approx(want, rel=1e-5)
  server.stop()  # Killed; restarted on the same directory.
  server.start()
  fresh = tinker.ServiceClient(base_url=server.url)
  rest = tinker.RestClient(base_url=server.url)
  ids = [c.checkpoint_id for c in rest.list_checkpoints(a.model_id).result().checkpoints]
  assert "weights/ckpt" in ids
  restored = fresh.create_training_client_from_state(path).result()
  assert _loss(restored, X) == pytest.approx(want, rel=1e-5)
  fresh.close("success").result()


@pytest.mark.parametrize("datum,loss_fn,message", [
    (_datum(X), "nope", "not a known loss_fn"),
    (_datum([5, 999999, 3]), "cross_entropy", "outside the vocabulary"),
    (_datum(X, weights=[1.0, 1.0]), "cross_entropy", "shape [2], expected [11]"),
    (_datum(list(range(3000))), "cross_entropy", "tokens (1 to 2048 allowed)"),
])
def test_bad_requests_fail_at_once_with_the_field_named(service, datum, loss_fn, message):
  client = service.create_lora_training_client(base_model=MODEL, rank=4).result()
  start = time.monotonic()
  with pytest.raises(Exception, match=re.escape(message)):
    client.forward_backward([datum], loss_fn).result()
  assert time.monotonic() - start < 15
  assert _loss(client, X) > 0  # The server (and this client) serve on.


def test_an_adapter_without_mlp_trains_attention_only_and_says_so(server):
  client = tinker.ServiceClient(base_url=server.url)
  try:  # Closed whatever happens: its slot is one of the four the next test counts.
    lora = client.create_lora_training_client(base_model=MODEL, rank=2, train_mlp=False,
                                              seed=1).result()
    losses = [_loss(lora, X)]
    for _ in range(3):  # A rank-2 adapter: at 1e-2 its loss swings; at 2e-3 it falls.
      lora.forward_backward([_datum(X)], "cross_entropy")
      lora.optim_step(types.AdamParams(learning_rate=2e-3)).result()
      losses.append(_loss(lora, X))
    assert losses == sorted(losses, reverse=True), losses
    path = lora.save_state("attention").result().path
    rest = tinker.RestClient(base_url=server.url)
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, False, False)
    with pytest.raises(Exception, match="train_attn and train_mlp are both false"):
      client.create_lora_training_client(base_model=MODEL, rank=2, train_attn=False,
                                         train_mlp=False).result()
  finally:
    client.close("success").result()


def test_a_finished_session_gives_its_adapter_slots_back(server):
  """max_adapters = 4: a fifth adapter of one rank is refused while four live, and a
  client that closes its session frees its four for the next."""
  for _ in range(2):
    client = tinker.ServiceClient(base_url=server.url)
    for _ in range(4):
      client.create_lora_training_client(base_model=MODEL, rank=2).result()
    client.close("success").result()
  client = tinker.ServiceClient(base_url=server.url)
  for _ in range(4):
    client.create_lora_training_client(base_model=MODEL, rank=2).result()
  with pytest.raises(Exception, match="all 4 adapter slots of rank 2 are in use"):
    client.create_lora_training_client(base_model=MODEL, rank=2).result()
  client.close("success").result()


def test_the_throughput_benchmark_reports_concurrent_and_sequential_rates(server):
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "bench_serve.py"), f"--model={MODEL}",
       f"--base_url={server.url}", "--adapters=1,2", "--steps=1", "--tokens=16", "--rank=8",
       "--repeats=1"],
      capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  for a in ("1", "2"):
    row = out["tokens_per_s"][a]
    assert row["concurrent"] > 0 and row["sequential"] > 0
    assert row["ratio"] == pytest.approx(row["concurrent"] / row["sequential"], rel=0.02)


def test_a_workdir_that_is_a_file_is_one_line_error_before_the_model_loads(tmp_path, capsys):
  from jaxrl_post.serve.__main__ import main

  (tmp_path / "taken").write_text("")
  assert main([f"--workdir={tmp_path / 'taken'}", "--model=/no/such/model"]) == 2
  err = capsys.readouterr().err
  assert err == f"error: --workdir={tmp_path / 'taken'}: cannot be used as a directory " \
                f"(File exists: {tmp_path / 'taken'})\n", err


def test_a_port_in_use_or_out_of_range_is_one_line_error_before_the_model_loads(tmp_path,
                                                                                 capsys):
  """The port is taken before the model loads (a bogus --model here would fail later), and
  a port past 65535, on which uvicorn hangs, is refused by the flag itself."""
  import socket

  from jaxrl_post.serve.__main__ import main

  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    assert main([f"--port={port}", f"--workdir={tmp_path}", "--model=/no/such/model"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: --host=127.0.0.1 --port={port}: cannot listen there (")
  assert err.count("\n") == 1, err
  with pytest.raises(SystemExit):
    main(["--port=99999", f"--workdir={tmp_path}"])
  assert "argument --port: 99999 is not a TCP port (1-65535)" in capsys.readouterr().err
