"""dtype names, parsing, float formats and half_dtype."""

import types

import jax
import jax.numpy as jnp
import numpy as np

import pytest

import jaxmp
from jaxmp._src import dtypes


@pytest.mark.parametrize("name,expected", [
    ("bf16", jnp.bfloat16), ("bfloat16", jnp.bfloat16), ("f16", jnp.float16),
    ("float16", jnp.float16), ("full", jnp.float32), ("f32", jnp.float32),
    ("float32", jnp.float32), ("f64", jnp.float64), ("float64", jnp.float64),
])
def test_parse_names(name, expected):
  assert jaxmp.tools.parse_dtype(name) == np.dtype(expected)


@pytest.mark.parametrize("value", [jnp.bfloat16, np.float16, np.dtype("float32"), "float64"])
def test_parse_dtype_objects(value):
  assert jaxmp.tools.parse_dtype(value) == np.dtype(value)


def test_fp8_only_when_allowed():
  assert jaxmp.tools.parse_dtype("e4m3", allow_fp8=True) == np.dtype(jnp.float8_e4m3fn)
  assert jaxmp.tools.parse_dtype("float8_e5m2", allow_fp8=True) == np.dtype(jnp.float8_e5m2)
  with pytest.raises(ValueError, match="e4m3"):
    jaxmp.tools.parse_dtype("e4m3")
  with pytest.raises(ValueError, match="float8_e5m2.*jaxmp.fp8"):
    jaxmp.tools.parse_dtype(jnp.float8_e5m2)


@pytest.mark.parametrize("bad", [jnp.int8, jnp.uint32, jnp.bool_, jnp.complex64, "int8"])
def test_parse_rejects_non_float(bad):
  with pytest.raises(ValueError, match="accepted"):
    jaxmp.tools.parse_dtype(bad, allow_fp8=True)


@pytest.mark.parametrize("bad", [None, 1, 2.0, True, object()])
def test_parse_rejects_non_dtypes(bad):
  with pytest.raises(TypeError, match="Expected a dtype"):
    jaxmp.tools.parse_dtype(bad)


def test_half_dtype_on_this_backend_follows_jaxmps_rule():
  platform = jax.local_devices()[0].platform
  expected = jnp.bfloat16 if platform == "tpu" else jnp.float16
  if platform == "gpu":
    capability = dtypes.gpu_compute_capability(jax.local_devices()[0], "test")
    expected = jnp.bfloat16 if capability is None or capability >= (8, 0) else jnp.float16
  assert jaxmp.half_dtype() == np.dtype(expected)
  assert jaxmp.tools.parse_dtype("half") == jaxmp.half_dtype()


H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                             compute_capability="9.0")


def _default_backend_is(device, monkeypatch):
  """``jax.devices()`` returns ``device`` (a machine whose default backend is a GPU);
  ``jax.devices("cpu")`` the real CPU."""
  real = jax.devices
  monkeypatch.setattr(jax, "devices", lambda backend=None: [device] if backend is None
                      else real(backend))


def test_half_dtype_answers_for_the_device_jax_computes_on_by_default(monkeypatch):
  # On a machine with a GPU, `with jax.default_device(cpu):` computes on the CPU.
  _default_backend_is(H100, monkeypatch)
  assert jaxmp.half_dtype() == jnp.bfloat16
  with jax.default_device(jax.devices("cpu")[0]):
    assert jaxmp.half_dtype() == jnp.float16
    assert dtypes.default_device() is jax.devices("cpu")[0]
  with jax.default_device("cpu"):
    assert dtypes.default_device().platform == "cpu"


class _FakeDevice:

  def __init__(self, platform, compute_capability=None):
    self.platform = platform
    if compute_capability is not None:
      self.compute_capability = compute_capability


@pytest.mark.parametrize("device,expected", [
    (_FakeDevice("cpu"), jnp.float16),
    (_FakeDevice("tpu"), jnp.bfloat16),
    (_FakeDevice("gpu", "7.0"), jnp.float16),
    (_FakeDevice("gpu", "7.5"), jnp.float16),
    (_FakeDevice("gpu", "8.0"), jnp.bfloat16),
    (_FakeDevice("gpu", "9.0"), jnp.bfloat16),
])
def test_half_dtype_by_device(device, expected):
  assert jaxmp.half_dtype(device) == np.dtype(expected)


@pytest.mark.parametrize("name,max_,min_normal,mant,has_inf", [
    ("float16", 65504.0, 2.0**-14, 10, True),
    ("bfloat16", float(jnp.finfo(jnp.bfloat16).max), 2.0**-126, 7, True),
    ("float32", float(np.finfo(np.float32).max), 2.0**-126, 23, True),
    ("float8_e4m3fn", 448.0, 2.0**-6, 3, False),
    ("float8_e5m2", 57344.0, 2.0**-14, 2, True),
])
def test_float_formats(name, max_, min_normal, mant, has_inf):
  fmt = jaxmp.tools.float_format(name)
  assert fmt.dtype == np.dtype(name)
  assert fmt.max == max_
  assert fmt.min_normal == min_normal
  assert fmt.mantissa_bits == mant
  assert fmt.has_inf == has_inf
  assert 0 < fmt.min_subnormal < fmt.min_normal


def test_float_format_subnormals():
  assert jaxmp.tools.float_format("f16").min_subnormal == 2.0**-24
  assert jaxmp.tools.float_format("e4m3").min_subnormal == 2.0**-9
  assert jaxmp.tools.float_format("e5m2").min_subnormal == 2.0**-16


def test_is_float_dtype():
  assert dtypes.is_float_dtype(jnp.float8_e4m3fn)
  assert dtypes.is_float_dtype(jnp.bfloat16)
  assert not dtypes.is_float_dtype(jnp.int32)
  assert not dtypes.is_float_dtype(jax.random.key(0).dtype)
  assert not dtypes.is_float_dtype("not a dtype")


def test_dtype_name():
  assert dtypes.dtype_name("bf16") == "bfloat16"
  assert dtypes.dtype_name(jnp.float8_e4m3fn) == "float8_e4m3fn"
