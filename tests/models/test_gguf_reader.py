"""models.gguf_reader against the gguf package's reader on the embedded SmolLM2 file, and
models.gguf_file's whole-array dequantisation against the package's."""

import struct

import gguf
import numpy as np
import pytest

from jaxrl_post.models import gguf_file
from jaxrl_post.models.gguf_reader import read_gguf
from jaxrl_post.models.presets import embedded_path

PATH = embedded_path("smollm2-135m-instruct")


def test_metadata_and_tensor_bytes_equal_the_gguf_packages_reader():
  meta, tensors = read_gguf(PATH)
  ref = gguf.GGUFReader(PATH)
  assert meta == {k: f.contents() for k, f in ref.fields.items()}
  assert len(meta["tokenizer.ggml.tokens"]) == 49152  # Arrays of strings, whole.
  assert list(tensors) == [t.name for t in ref.tensors]
  for t in ref.tensors:
    ours = tensors[t.name]
    assert ours.shape == tuple(int(s) for s in t.shape) and ours.tensor_type == t.tensor_type
    theirs = np.asarray(t.data).view(np.uint8).reshape(ours.data.shape)  # Same bytes.
    assert np.array_equal(ours.data, theirs), t.name
    np.testing.assert_array_equal(gguf.quants.dequantize(ours.data, ours.tensor_type),
                                  gguf.quants.dequantize(t.data, t.tensor_type))
  kinds = {t.tensor_type.name for t in ref.tensors}
  assert {"F32", "Q4_1", "Q8_0"} <= kinds  # Plain and block-quantised rows both read.


@pytest.mark.parametrize("keep", [3, 100, 2_000_000, -1000])
def test_a_cut_or_foreign_file_raises(tmp_path, keep):
  data = open(PATH, "rb").read()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[:keep] if keep > 0 else data[:keep])
  with pytest.raises((ValueError, struct.error)):
    read_gguf(str(cut))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_whole_array_dequantisation_equals_the_gguf_packages_to_the_bit(qtype):
  qtype = gguf.GGMLQuantizationType[qtype]
  x = np.random.default_rng(3).standard_normal((48, 256)).astype(np.float32) * 3
  raw = gguf.quants.quantize(x, qtype)
  ours = gguf_file._WHOLE_ARRAY[int(qtype)](raw)
  theirs = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(-1)
  np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
  with pytest.raises(ValueError, match="whole number"):
    gguf_file._WHOLE_ARRAY[int(qtype)](raw.reshape(-1)[:-1])
