"""cast_tree, all_finite and select_tree over every kind of leaf, inside and outside jit."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src import tree as tree_lib

FLOATS = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)


def _mixed_tree():
  return {
      "f32": jnp.ones((2, 3), jnp.float32),
      "f16": jnp.ones((4,), jnp.float16),
      "bf16": jnp.ones((), jnp.bfloat16),
      "np_f64": np.ones(2, np.float64),
      "int": jnp.arange(3, dtype=jnp.int32),
      "uint": jnp.arange(3, dtype=jnp.uint8),
      "bool": jnp.array([True, False]),
      "key": jax.random.key(0),
      "raw_key": jax.random.PRNGKey(0),
      "none": None,
      "py_float": 1.5,
      "py_int": 3,
      "string": "label",
      "nested": [jnp.zeros(2, jnp.float32), (jnp.arange(2),)],
  }


PASSTHROUGH = ("int", "uint", "bool", "key", "raw_key", "none", "py_float", "py_int", "string")


def _check_cast(out, tree, dtype):
  for name in ("f32", "f16", "bf16", "np_f64"):
    assert out[name].dtype == dtype, name
  assert out["nested"][0].dtype == dtype
  assert out["nested"][1][0].dtype == tree["nested"][1][0].dtype
  for name in PASSTHROUGH:
    if isinstance(tree[name], (jax.Array, np.ndarray)):
      assert out[name].dtype == tree[name].dtype, name
      if name == "key":
        np.testing.assert_array_equal(jax.random.key_data(out[name]),
                                      jax.random.key_data(tree[name]))
      else:
        np.testing.assert_array_equal(out[name], tree[name])
    else:
      assert out[name] is tree[name] or out[name] == tree[name], name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_cast_tree_eager(dtype):
  tree = _mixed_tree()
  _check_cast(jaxmp.cast_tree(tree, dtype), tree, np.dtype(dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cast_tree_under_jit(dtype):
  tree = _mixed_tree()
  arrays = {k: v for k, v in tree.items() if k not in ("py_float", "py_int", "string", "none")}
  out = jax.jit(lambda t: jaxmp.cast_tree(t, dtype))(arrays)
  for name in ("f32", "f16", "bf16", "np_f64"):
    assert out[name].dtype == dtype
  assert out["int"].dtype == jnp.int32
  assert out["uint"].dtype == jnp.uint8
  assert out["bool"].dtype == jnp.bool_
  assert out["raw_key"].dtype == jnp.uint32
  np.testing.assert_array_equal(out["raw_key"], tree["raw_key"])
  assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)


def test_cast_tree_accepts_names_and_fp8():
  out = jaxmp.cast_tree({"x": jnp.array([1.0, 2.0])}, "bf16")
  assert out["x"].dtype == jnp.bfloat16
  out = jaxmp.cast_tree({"x": jnp.array([1.0, 2.0])}, "float8_e4m3fn")
  assert out["x"].dtype == jnp.float8_e4m3fn


def test_cast_tree_same_dtype_is_identity_and_adds_no_ops():
  x = jnp.ones(3)
  assert jaxmp.cast_tree({"x": x}, jnp.float32)["x"] is x
  hlo = jax.jit(lambda t: jaxmp.cast_tree(t, jnp.float32)).lower({"x": x}).as_text()
  assert "convert" not in hlo


def test_cast_tree_keeps_numpy_leaves_on_host():
  out = jaxmp.cast_tree({"x": np.ones(2, np.float64)}, jnp.float32)
  assert isinstance(out["x"], np.ndarray)


@pytest.mark.parametrize("bad", [jnp.int32, "int8", jnp.bool_])
def test_cast_tree_rejects_non_float_target(bad):
  with pytest.raises(ValueError, match="accepted"):
    jaxmp.cast_tree({"x": jnp.ones(2)}, bad)


# ---- all_finite ------------------------------------------------------------------------------


def test_all_finite_returns_scalar_bool_array():
  out = jaxmp.all_finite({"a": jnp.ones(3)})
  assert isinstance(out, jax.Array)
  assert out.shape == () and out.dtype == jnp.bool_
  assert bool(out)


def test_all_finite_empty_trees():
  for tree in ({}, [], None, (), {"a": None}):
    assert bool(jaxmp.all_finite(tree))
  assert bool(jax.jit(jaxmp.all_finite)({}))


# float8_e4m3fn has no infinity (inf casts to NaN), so it is checked with NaN only.
@pytest.mark.parametrize("dtype,bad", [
    (d, b) for d in FLOATS for b in (np.inf, -np.inf, np.nan)
    if not (d == jnp.float8_e4m3fn and np.isinf(b))])
def test_all_finite_detects_each_dtype(dtype, bad):
  clean = {"x": jnp.ones((3, 4), dtype), "ids": jnp.arange(4)}
  poisoned = {"x": clean["x"].at[1, 2].set(bad), "ids": clean["ids"]}
  for fn in (jaxmp.all_finite, jax.jit(jaxmp.all_finite)):
    assert bool(fn(clean))
    assert not bool(fn(poisoned))


def test_all_finite_large_finite_values_are_finite():
  # x * 0 for the largest finite value must stay 0, not overflow.
  tree = [jnp.full((5,), jnp.finfo(d).max, d) for d in FLOATS]
  assert bool(jax.jit(jaxmp.all_finite)(tree))


def test_all_finite_mixed_dtypes_one_bad_leaf():
  tree = {d.__name__ if hasattr(d, "__name__") else str(d): jnp.ones(8, d) for d in FLOATS}
  tree["ints"] = jnp.arange(3)
  tree["bools"] = jnp.array([True])
  tree["key"] = jax.random.key(1)
  assert bool(jax.jit(jaxmp.all_finite)(tree))
  for name in list(tree)[:len(FLOATS)]:
    poisoned = dict(tree)
    poisoned[name] = tree[name].at[3].set(np.nan)
    assert not bool(jax.jit(jaxmp.all_finite)(poisoned)), name


def test_all_finite_ignores_integer_only_trees():
  assert bool(jaxmp.all_finite({"a": jnp.arange(3), "b": np.arange(2)}))


def test_all_finite_accepts_numpy_and_python_leaves():
  assert not bool(jaxmp.all_finite({"a": np.array([np.nan]), "b": 1.0}))


def test_all_finite_accepts_every_number_bool_key_and_none():
  tree = {name: leaf for name, leaf in _mixed_tree().items() if name != "string"}
  tree.update(complex=1j, np_int=np.int8(3), np_bool=np.bool_(True),
              np_bf16=np.ones(2, jnp.bfloat16), np_complex=np.ones(2, np.complex64))
  for fn in (jaxmp.all_finite, jax.jit(jaxmp.all_finite)):
    assert bool(fn(tree))
    assert not bool(fn({**tree, "bad": jnp.array([np.nan])}))


@pytest.mark.parametrize("bad", ["hello", b"bytes", object(), np.array(["a", "b"]),
                                 np.array([1.0, None], dtype=object), np.str_("x"),
                                 jax.ShapeDtypeStruct((2,), jnp.float32)])
def test_all_finite_refuses_leaves_that_are_not_numbers(bad):
  # all_finite("hello") used to say True: a tree that is not gradients was taken as finite.
  with pytest.raises(TypeError, match=r"all_finite: leaf \['b'\] is .* of type "
                                      + re.escape(type(bad).__name__)):
    jaxmp.all_finite({"a": jnp.ones(2), "b": bad})
  with pytest.raises(TypeError, match=r"leaf \(the tree itself\)"):
    jaxmp.all_finite(bad)


@pytest.mark.on_cpu  # checks the CPU's form of the finite check (GPUs: the next test)
def test_all_finite_common_path_has_no_large_temporaries():
  # float32 and bfloat16 leaves (the CPU backend widens float16 before reducing it).
  tree = {"a": jnp.ones((256, 256)), "b": jnp.ones((64,), jnp.bfloat16),
          "c": jnp.ones((128, 128), jnp.bfloat16)}
  hlo = jax.jit(jaxmp.all_finite).lower(tree).compile().as_text()
  entry = hlo[hlo.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  # The top-level ops outside the exact fallback branch: reductions to scalars, and no
  # array as large as a big leaf (which would be a materialized copy or mask).
  ops = [line for line in entry.splitlines()[1:]
         if "parameter(" not in line and " tuple(" not in line]
  sizes = [math.prod(int(d) for d in dims.split(",") if d)
           for line in ops for dims in re.findall(r"^\s*%\S+ = \w+\[([\d,]*)\]", line)]
  assert max(sizes) < 128 * 128, entry
  assert "concatenate" not in entry
  assert "conditional(" in entry


def test_all_finite_sum_overflow_falls_back_to_exact_check():
  big = jnp.full((4,), jnp.finfo(jnp.float32).max)
  for fn in (jaxmp.all_finite, jax.jit(jaxmp.all_finite)):
    assert bool(fn({"a": big, "b": -big}))
    assert bool(fn([big, big]))
    assert not bool(fn([big, big.at[2].set(jnp.nan)]))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_all_finite_on_accelerators_is_one_reduction_per_leaf_without_a_branch(platform):
  # A conditional taking the gradients as operands would make XLA write them to memory.
  tree = {"w": jnp.ones((8, 8)), "b": jnp.ones(8, jnp.bfloat16)}
  lower = lambda p: jax.jit(jaxmp.all_finite).trace(tree).lower(lowering_platforms=(p,)).as_text()
  text, cpu = lower(platform), lower("cpu")
  # One reduction per leaf, of x * 0; the CPU form adds the exact check's own
  # reductions behind one more conditional (the platform choice is a conditional on a
  # constant, which XLA removes).
  assert text.count("stablehlo.reduce") == 2 and text.count("stablehlo.multiply") == 2
  assert cpu.count("stablehlo.reduce") > 2
  assert text.count("stablehlo.case") == cpu.count("stablehlo.case") - 1


@pytest.mark.parametrize("dtype", FLOATS)
def test_all_finite_accelerator_form_is_exact(dtype):
  # The GPU/TPU form (sum of x * 0), run here directly: exact for every value.
  biggest = jnp.finfo(dtype).max
  finite = [jnp.full((6,), biggest, dtype), jnp.full((6,), -biggest, dtype), jnp.zeros(3, dtype)]
  assert bool(tree_lib._finite_by_zero_product(*finite))
  for bad in (np.inf, -np.inf, np.nan):
    if dtype == jnp.float8_e4m3fn and np.isinf(bad):
      continue  # no infinity in e4m3fn
    poisoned = finite[:1] + [finite[1].at[4].set(bad)]
    assert not bool(tree_lib._finite_by_zero_product(*poisoned)), (dtype, bad)


# ---- select_tree -----------------------------------------------------------------------------


def test_select_tree_picks_branch_eager_and_jit():
  a = {"x": jnp.ones(3), "n": jnp.array(1), "k": jax.random.key(0)}
  b = {"x": jnp.zeros(3), "n": jnp.array(2), "k": jax.random.key(1)}
  for fn in (jaxmp.select_tree, jax.jit(jaxmp.select_tree)):
    out = fn(jnp.array(True), a, b)
    np.testing.assert_array_equal(out["x"], a["x"])
    assert int(out["n"]) == 1
    np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(a["k"]))
    out = fn(jnp.array(False), a, b)
    np.testing.assert_array_equal(out["x"], b["x"])
    assert int(out["n"]) == 2


def test_select_tree_python_bool_and_empty():
  assert jaxmp.select_tree(True, {}, {}) == {}
  out = jaxmp.select_tree(False, (jnp.ones(1),), (jnp.zeros(1),))
  assert float(out[0][0]) == 0.0


def test_select_tree_traced_predicate():
  @jax.jit
  def f(x):
    return jaxmp.select_tree(jnp.all(x > 0), {"v": x}, {"v": -x})
  np.testing.assert_array_equal(f(jnp.array([1.0, 2.0]))["v"], [1.0, 2.0])
  np.testing.assert_array_equal(f(jnp.array([1.0, -2.0]))["v"], [-1.0, 2.0])


@pytest.mark.parametrize("pred", [jnp.array([True, False]), jnp.ones((1,), bool)])
def test_select_tree_rejects_non_scalar_pred(pred):
  with pytest.raises(ValueError, match="scalar predicate.*shape"):
    jaxmp.select_tree(pred, {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})


@pytest.mark.parametrize("pred", [jnp.array(1), 1, jnp.array(1.0)])
def test_select_tree_rejects_non_bool_pred(pred):
  with pytest.raises(TypeError, match="boolean predicate"):
    jaxmp.select_tree(pred, {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})


def test_select_tree_rejects_mismatched_structure():
  with pytest.raises(ValueError, match="same structure"):
    jaxmp.select_tree(True, {"a": jnp.ones(2)}, {"b": jnp.ones(2)})
  with pytest.raises(ValueError, match="same structure"):
    jaxmp.select_tree(True, [jnp.ones(2)], [jnp.ones(2), jnp.ones(2)])


def test_select_tree_rejects_mismatched_leaves():
  with pytest.raises(ValueError, match=r"\['a'\].*shape \(2,\).*\(3,\)"):
    jaxmp.select_tree(True, {"a": jnp.ones(2)}, {"a": jnp.ones(3)})
  with pytest.raises(TypeError, match=r"\['a'\].*float32.*bfloat16"):
    jaxmp.select_tree(True, {"a": jnp.ones(2)}, {"a": jnp.ones(2, jnp.bfloat16)})


@pytest.mark.parametrize("bad", [math.nan, math.inf, np.float32(np.nan), np.float16(np.inf),
                                 np.float64(-np.inf), np.array(np.nan, np.float64)])
def test_all_finite_checks_numpy_scalars_and_python_floats_like_arrays(bad):
  for fn in (jaxmp.all_finite, jax.jit(jaxmp.all_finite)):
    assert not bool(fn({"w": jnp.ones(2), "b": bad}))
  assert not bool(jaxmp.all_finite(bad))
  assert bool(jaxmp.all_finite({"w": jnp.ones(2), "b": 1.5, "c": np.float16(2), "n": 3}))


def test_all_finite_checks_numpy_values_in_their_own_dtype():
  # 1e300 is a finite float64 that would overflow float32.
  assert bool(jaxmp.all_finite({"a": np.float64(1e300), "b": np.array([1e300])}))
