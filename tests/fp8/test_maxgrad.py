"""max_float32: cotangents of repeated reads combine by max under every transform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp._src.fp8 import maxgrad

W = jnp.array([[1.0, 5.0], [3.0, 2.0], [0.0, 9.0]])


def _repeated_reads(h):
  h = maxgrad.to_max_float32(h)
  return sum(jnp.sum(maxgrad.from_max_float32(h) * w) for w in W)


def _scanned_reads(h):
  h = maxgrad.to_max_float32(h)

  def body(c, w):
    return c + jnp.sum(maxgrad.from_max_float32(h) * w), None

  return jax.lax.scan(body, 0.0, W)[0]


@pytest.mark.parametrize("fn", [_repeated_reads, _scanned_reads])
@pytest.mark.parametrize("transform", [
    lambda f: f, jax.jit, jax.checkpoint, lambda f: jax.jit(jax.checkpoint(f))])
def test_repeated_reads_take_the_max(fn, transform):
  g = jax.grad(transform(fn))(jnp.zeros(2))
  assert g.dtype == jnp.float32
  np.testing.assert_array_equal(g, [3.0, 9.0])  # a plain float32 read would give [4, 16]


def test_vmapped_grads():
  g = jax.vmap(jax.grad(_repeated_reads))(jnp.zeros((4, 2)))
  np.testing.assert_array_equal(g, np.tile([3.0, 9.0], (4, 1)))


def test_an_unused_value_gets_a_zero_cotangent():
  def f(h):
    h = maxgrad.to_max_float32(h)
    return 0.0 * jnp.sum(jax.lax.stop_gradient(maxgrad.from_max_float32(h)))

  np.testing.assert_array_equal(jax.grad(f)(jnp.ones(2)), [0.0, 0.0])


def test_the_autodiff_zero_is_minus_inf():
  # What an unused read contributes: the cotangent of an input the function ignores.
  def ignores(h):
    return jnp.float32(1.0)

  _, vjp = jax.vjp(ignores, maxgrad.to_max_float32(jnp.zeros(2)))
  (ct,) = vjp(jnp.float32(1.0))
  np.testing.assert_array_equal(maxgrad.from_max_float32(ct), [-np.inf, -np.inf])


def test_conversions():
  x = jnp.array([1.0, -2.0])
  m = maxgrad.to_max_float32(x)
  assert maxgrad.is_max_float32(m) and maxgrad.is_max_float32(m.dtype)
  assert not maxgrad.is_max_float32(x)
  assert maxgrad.to_max_float32(m) is m
  np.testing.assert_array_equal(maxgrad.from_max_float32(m), x)
  assert maxgrad.from_max_float32(x) is x
  assert repr(maxgrad.max_float32) == "max_float32"
  with pytest.raises(TypeError, match="must be float32 to accumulate by max, got .* bfloat16"):
    maxgrad.to_max_float32(x.astype(jnp.bfloat16))


def test_eager_vjp_of_a_max_float32_value():
  m = maxgrad.to_max_float32(jnp.zeros(2))
  (ct,) = jax.vjp(lambda h: maxgrad.from_max_float32(h) * 2, m)[1](jnp.ones(2))
  assert maxgrad.is_max_float32(ct)
  np.testing.assert_array_equal(maxgrad.from_max_float32(ct), [2.0, 2.0])
