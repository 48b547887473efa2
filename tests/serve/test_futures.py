"""The service's request results: kept while a client may poll them, then dropped."""

import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.serve.config import ServeConfig
from jaxrl_post.serve.futures import Futures


class Clock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def test_results_are_dropped_keep_s_after_they_are_ready_and_pending_ones_never():
  clock = Clock()
  futures = Futures(keep_s=60, clock=clock)
  done, pending = futures.create(), futures.create()
  futures.resolve(done, {"ok": 1})
  clock.now += 59
  assert futures.wait(done, 0).payload == {"ok": 1}  # Still there to poll again.
  clock.now += 2
  later = futures.create()  # Creating a request drops what expired.
  assert futures.held() == 2  # `pending` and `later`; `done`'s result is gone.
  assert futures.known(done)  # An id this server gave out, not an unknown one...
  dropped = futures.wait(done, 0)  # ...whose poll says what happened.
  assert dropped.failed and "dropped 60 s after it was ready" in dropped.payload["error"]
  clock.now += 10_000
  assert futures.wait(pending, 0) is None  # Pending for hours: still the client's.
  futures.fail(pending, "boom")
  assert futures.wait(pending, 0).payload == {"error": "boom", "category": "user"}
  futures.resolve(later, b"\x08\x01")
  futures.fail(later, "too late")  # A result once set stays.
  assert futures.wait(later, 0).payload == b"\x08\x01"


@pytest.mark.parametrize("rid", ["req-3", "req-01", "req--1", "req-", "3", "", None])
def test_ids_this_server_never_gave_out_are_unknown(rid):
  futures = Futures(keep_s=ServeConfig().keep_results_s)
  for _ in range(3):
    futures.create()
  assert not futures.known(rid)
  assert futures.known("req-2") and futures.known("req-0")


def test_results_kept_under_a_minute_are_refused():
  with pytest.raises(UserError, match="ServeConfig.keep_results_s: must be >= 60, got 5"):
    ServeConfig(keep_results_s=5)
