"""The protobuf codec against the client SDK's own generated classes and decoders."""

import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.serve import wire

pb = pytest.importorskip("tinker.proto.tinker_public_pb2")
conv = pytest.importorskip("tinker.proto.response_conv")


def _request() -> bytes:
  msg = pb.ForwardBackwardRequest(model_id="s:train:3", seq_id=7, loss_fn="ppo",
                                  forward_only=True)
  msg.loss_fn_config["clip_low_threshold"] = 0.9
  msg.loss_fn_config_v2["clip_low_threshold"].number = 0.9
  msg.loss_fn_config_v2["note"].text = "x"
  datum = msg.data.add()
  for part in ([5, 6], [300000]):  # Two chunks: one model input.
    datum.model_input.add().encoded_text.tokens = np.asarray(part, "<i4").tobytes()
  t = datum.loss_fn_inputs["target_tokens"]
  t.dense, t.dtype = np.asarray([6, 7, -2], "<i8").tobytes(), pb.DTYPE_INT64
  t.shape.append(3)
  a = datum.loss_fn_inputs["advantages"]
  a.dense, a.dtype = np.asarray([0.5, -1.0, 2.0], "<f4").tobytes(), pb.DTYPE_FLOAT32
  w = datum.loss_fn_inputs["weights"]  # Sparse [2, 3]: (0, 1) = 1.5, (1, 2) = -3.
  w.dtype = pb.DTYPE_FLOAT32
  w.shape.extend([2, 3])
  w.sparse_csr.values = np.asarray([1.5, -3.0], "<f4").tobytes()
  w.sparse_csr.crow_indices = np.asarray([0, 1, 2], "<i8").tobytes()
  w.sparse_csr.col_indices = np.asarray([1, 2], "<i8").tobytes()
  msg.data.add().model_input.add().encoded_text.tokens = np.asarray([1], "<i4").tobytes()
  return msg.SerializeToString()


def test_a_forward_backward_request_reads_as_the_sdk_wrote_it():
  req = wire.forward_backward_request(_request())
  assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("s:train:3", 7, "ppo", True)
  assert req.loss_fn_config == {"clip_low_threshold": pytest.approx(0.9), "note": "x"}
  first, second = req.data
  assert first.tokens.tolist() == [5, 6, 300000] and second.tokens.tolist() == [1]
  assert first.inputs["target_tokens"].tolist() == [6, 7, -2]
  assert first.inputs["advantages"].dtype == np.float32
  np.testing.assert_array_equal(first.inputs["weights"], [[0, 1.5, 0], [0, 0, -3]])
  assert second.inputs == {}


def test_a_cut_off_body_is_one_clear_error():
  with pytest.raises(UserError, match="cut off"):
    wire.forward_backward_request(_request()[:-3])


def test_outputs_decode_with_the_sdks_decoders():
  lps = [np.asarray([-1.0, -2.5], np.float32), np.asarray([-0.25], np.float32)]
  out = conv.deserialize_forward_backward_output(
      wire.forward_backward_output({"logprobs": lps}, {"loss:sum": 3.75}))
  assert out.metrics == {"loss:sum": 3.75}
  assert [o["logprobs"].data for o in out.loss_fn_outputs] == [[-1.0, -2.5], [-0.25]]
  seqs = [wire.Sequence([4, 2], [-0.5, -0.75], stop=True), wire.Sequence([9], [-2.0], stop=False)]
  prompt = np.asarray([np.nan, -1.5, -0.5], np.float32)
  sample = conv.deserialize_sample_response(wire.sample_response(seqs, prompt))
  assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
      ([4, 2], [-0.5, -0.75], "stop"), ([9], [-2.0], "length")]
  assert sample.prompt_logprobs == [None, -1.5, -0.5]
