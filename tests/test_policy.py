"""Policies: jmp grammar parity, Keras names, round trips, jit, casting and bad input."""

import functools
import itertools

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxmp
from jaxmp._src import dtypes

KEYS = {"param_dtype": ("p", "params"), "compute_dtype": ("c", "compute"),
        "output_dtype": ("o", "output")}
VALUES = ("bf16", "bfloat16", "f16", "float16", "full", "f32", "float32", "f64", "float64",
          "half")


def _assert_same_as_jmp(spec):
  # jaxmp's "half" is jaxmp.half_dtype(), which differs from jmp's (float16 on every
  # GPU) on GPUs with compute capability >= 8.0: compare the grammar with jmp, and
  # "half" with jaxmp.half_dtype(), on every platform.
  ours = jaxmp.get_policy(spec)
  theirs = jmp.get_policy(spec.replace("half", jaxmp.half_dtype().name))
  assert ours.param_dtype == np.dtype(theirs.param_dtype), spec
  assert ours.compute_dtype == np.dtype(theirs.compute_dtype), spec
  assert ours.output_dtype == np.dtype(theirs.output_dtype), spec


@pytest.mark.parametrize("value", VALUES)
def test_bare_value_matches_jmp(value):
  _assert_same_as_jmp(value)


def _assignment_specs():
  """Every subset of keys, every spelling of each key, in every order, with values."""
  fields = list(KEYS)
  for n in (1, 2, 3):
    for chosen in itertools.permutations(fields, n):
      for spellings in itertools.product(*(KEYS[f] for f in chosen)):
        yield spellings


@pytest.mark.parametrize("keys", list(_assignment_specs()), ids=",".join)
def test_assignments_match_jmp(keys):
  # Every key spelling and order, crossed with a rotating choice of values so each
  # value appears under each key across the parametrization.
  for offset in range(len(VALUES)):
    values = [VALUES[(offset + 3 * i) % len(VALUES)] for i in range(len(keys))]
    _assert_same_as_jmp(",".join(f"{k}={v}" for k, v in zip(keys, values)))


def test_every_value_under_every_key_matches_jmp():
  for key, value in itertools.product(itertools.chain(*KEYS.values()), VALUES):
    _assert_same_as_jmp(f"{key}={value}")


def test_defaults_follow_jmp_rule():
  policy = jaxmp.get_policy("c=f16")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      jnp.float32, jnp.float16, jnp.float16)
  policy = jaxmp.get_policy("p=bf16")
  assert (policy.compute_dtype, policy.output_dtype) == (jnp.bfloat16, jnp.bfloat16)
  policy = jaxmp.get_policy("p=f32,o=bf16")
  assert (policy.compute_dtype, policy.output_dtype) == (jnp.float32, jnp.bfloat16)


F32 = np.dtype(jnp.float32)
HALF_SPECS = [  # spec, then which of (param, compute, output) are half, the rest float32
    ("half", (True, True, True)),
    ("p=half", (True, True, True)),
    ("c=half", (False, True, True)),
    ("o=half", (False, False, True)),
    ("p=f32,c=half", (False, True, True)),
    ("p=f32,c=half,o=f32", (False, True, False)),
    ("params=half,output=float32", (True, True, False)),
]


def _expected(half, is_half):
  return jaxmp.Policy(*(half if h else F32 for h in is_half))


@pytest.mark.parametrize("spec,is_half", HALF_SPECS)
def test_half_is_half_dtype(spec, is_half):
  assert jaxmp.get_policy(spec) == _expected(jaxmp.half_dtype(), is_half)


class _FakeDevice:

  def __init__(self, platform, compute_capability=None):
    self.platform = platform
    if compute_capability is not None:
      self.compute_capability = compute_capability


@pytest.mark.parametrize("device,half", [
    (_FakeDevice("cpu"), jnp.float16),
    (_FakeDevice("gpu", "7.0"), jnp.float16),
    (_FakeDevice("gpu", "8.0"), jnp.bfloat16),  # where jmp's "half" is float16
    (_FakeDevice("tpu"), jnp.bfloat16),
], ids=["cpu", "gpu-7.0", "gpu-8.0", "tpu"])
@pytest.mark.parametrize("spec,is_half", HALF_SPECS)
def test_half_follows_the_devices_half_dtype(monkeypatch, device, half, spec, is_half):
  monkeypatch.setattr(dtypes, "default_device", lambda: device)
  assert jaxmp.half_dtype() == np.dtype(half)
  assert jaxmp.get_policy(spec) == _expected(np.dtype(half), is_half)


@pytest.mark.parametrize("name,compute", [("mixed_float16", jnp.float16),
                                          ("mixed_bfloat16", jnp.bfloat16)])
def test_keras_mixed_names(name, compute):
  policy = jaxmp.get_policy(name)
  assert policy.param_dtype == jnp.float32
  assert policy.compute_dtype == compute
  # The model's output comes back in float32, as Keras's guide makes the last layer
  # float32 so that the loss sees float32 logits (issue 18).
  assert policy.output_dtype == jnp.float32


@pytest.mark.parametrize("name,dtype", [("float32", jnp.float32), ("bfloat16", jnp.bfloat16),
                                        ("float16", jnp.float16)])
def test_keras_plain_names(name, dtype):
  assert jaxmp.get_policy(name) == jaxmp.Policy(dtype, dtype, dtype)


def test_whitespace_around_parts_is_accepted():
  assert jaxmp.get_policy(" p=f32, c=bf16 ") == jaxmp.get_policy("p=f32,c=bf16")


def test_get_policy_accepts_policies():
  policy = jaxmp.Policy("float32", "bfloat16", "float32")
  assert jaxmp.get_policy(policy) is policy
  from_jmp = jaxmp.get_policy(jmp.get_policy("p=f32,c=bf16,o=f32"))
  assert from_jmp == policy


def test_to_jmp_round_trip():
  policy = jaxmp.get_policy("p=f32,c=f16,o=bf16")
  as_jmp = jaxmp.get_policy(policy).to_jmp()
  assert isinstance(as_jmp, jmp.Policy)
  assert str(as_jmp) == "p=full,c=f16,o=bf16"
  assert jaxmp.get_policy(as_jmp) == policy


@pytest.mark.parametrize("spec", ["f32", "bf16", "c=f16", "p=f16,c=bf16,o=f32", "mixed_float16",
                                  "params=bfloat16,compute=float32,output=float16"])
def test_str_parses_back(spec):
  policy = jaxmp.get_policy(spec)
  assert jaxmp.get_policy(str(policy)) == policy
  assert str(jaxmp.get_policy(str(policy))) == str(policy)


def test_str_format():
  policy = jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
  assert str(policy) == "params=float32,compute=bfloat16,output=float32"
  assert repr(policy) == (
      "Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)")


def test_constructor_defaults_follow_jmp_rule():
  assert jaxmp.Policy() == jaxmp.get_policy("f32")
  assert jaxmp.Policy("float32", "bfloat16") == jaxmp.get_policy("c=bf16")


def test_equality_and_hash_by_dtypes():
  a = jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
  b = jaxmp.Policy("f32", "bf16", "full")
  c = jaxmp.Policy(np.dtype("float32"), np.dtype(jnp.bfloat16), np.float32)
  assert a == b == c
  assert hash(a) == hash(b) == hash(c)
  assert len({a, b, c}) == 1
  assert a != jaxmp.Policy(jnp.float32, jnp.float16, jnp.float32)


def test_frozen():
  policy = jaxmp.Policy()
  with pytest.raises(AttributeError):
    policy.compute_dtype = jnp.bfloat16


def test_with_methods():
  policy = jaxmp.Policy("f32", "f32", "f32")
  assert policy.with_param_dtype("bf16") == jaxmp.Policy("bf16", "f32", "f32")
  assert policy.with_compute_dtype("bf16") == jaxmp.Policy("f32", "bf16", "f32")
  assert policy.with_output_dtype("f16") == jaxmp.Policy("f32", "f32", "f16")
  assert policy == jaxmp.Policy("f32", "f32", "f32")


def test_static_jit_argument_without_retracing():
  traces = []

  @functools.partial(jax.jit, static_argnums=1)
  def cast(x, policy):
    traces.append(policy)
    return policy.cast_to_compute(x)

  x = jnp.ones(3)
  assert cast(x, jaxmp.get_policy("c=bf16")).dtype == jnp.bfloat16
  assert cast(x, jaxmp.Policy("float32", "bfloat16")).dtype == jnp.bfloat16
  assert len(traces) == 1
  assert cast(x, jaxmp.get_policy("c=f16")).dtype == jnp.float16
  assert len(traces) == 2


def test_casting_methods():
  policy = jaxmp.get_policy("p=f32,c=bf16,o=f16")
  tree = {"w": jnp.ones((2, 2), jnp.float32), "ids": jnp.arange(3)}
  assert policy.cast_to_compute(tree)["w"].dtype == jnp.bfloat16
  assert policy.cast_to_output(tree)["w"].dtype == jnp.float16
  assert policy.cast_to_param(policy.cast_to_compute(tree))["w"].dtype == jnp.float32
  assert policy.cast_to_compute(tree)["ids"].dtype == tree["ids"].dtype


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec,named", [
    ("c=int8", "'int8'"),
    ("p=f32,c=bool", "'bool'"),
    ("int8", "'int8'"),
    ("c=fp16", "'fp16'"),
    ("x=f16", "'x'"),
    ("param=f16", "'param'"),
    ("c=f16,", "''"),
    ("c=f16,bf16", "'bf16'"),
    ("c=f16=bf16", "'c=f16=bf16'"),
    ("c=f16,c=bf16", "compute_dtype twice"),
    ("e4m3", "'e4m3'"),
    ("mixed_float8", "'mixed_float8'"),
])
def test_bad_strings_name_the_bad_part_and_list_accepted(spec, named):
  with pytest.raises(ValueError) as info:
    jaxmp.get_policy(spec)
  message = str(info.value)
  assert named in message
  assert "accepted" in message
  assert "bf16" in message and "compute" in message


@pytest.mark.parametrize("spec", ["", "   "])
def test_empty_string(spec):
  with pytest.raises(ValueError, match="Empty policy string.*accepted"):
    jaxmp.get_policy(spec)


@pytest.mark.parametrize("spec", [None, 3, jnp.float32, {"c": "f16"}])
def test_non_string_spec_is_type_error(spec):
  with pytest.raises(TypeError, match="get_policy expects"):
    jaxmp.get_policy(spec)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.uint8, jnp.bool_, "int8"])
def test_policy_rejects_non_float_dtype(dtype):
  with pytest.raises(ValueError, match="int8|int32|uint8|bool"):
    jaxmp.Policy(jnp.float32, dtype)


def test_policy_rejects_fp8_with_pointer_to_recipes():
  with pytest.raises(ValueError, match="float8_e4m3fn.*jaxmp.fp8"):
    jaxmp.Policy(jnp.float32, jnp.float8_e4m3fn)


def test_policy_error_names_the_field():
  with pytest.raises(ValueError, match="output_dtype"):
    jaxmp.Policy("f32", "bf16", "int32")
  with pytest.raises(TypeError, match="param_dtype"):
    jaxmp.Policy(3)
