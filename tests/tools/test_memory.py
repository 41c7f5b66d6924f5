"""jaxmp.tools.memory_report: bytes per parameter by role, and the compiled step's memory."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp

N = 256 * 128 + 128  # param values
COUNTERS = 4  # Adam's int32 count, in bytes


def _params(dtype):
  return {"w": jnp.ones((256, 128), dtype), "b": jnp.zeros(128, dtype)}


def _adamw():
  return optax.adamw(1e-3)


def _bf16_adamw():
  return jaxmp.optim.state_dtypes(_adamw(), "bfloat16")


@pytest.mark.parametrize("name, dtype, tx, expected", [
    ("float32 Adam", jnp.float32, _adamw(), (4, 0, 8, 4)),
    ("bf16 params + f32 master + bf16 moments", jnp.bfloat16,
     jaxmp.optim.master_weights(_bf16_adamw()), (2, 4, 4, 2)),
    ("the same with remainders", jnp.bfloat16,
     jaxmp.optim.master_weights(_bf16_adamw(), remainders=True), (2, 2, 4, 2)),
    ("pure bf16", jnp.bfloat16, _bf16_adamw(), (2, 0, 4, 2)),
    ("pure bf16 + Kahan", jnp.bfloat16,
     jaxmp.optim.kahan_summation(_bf16_adamw()), (2, 0, 6, 2)),
])
def test_bytes_per_param_of_each_role(name, dtype, tx, expected):
  params = _params(dtype)
  report = jaxmp.tools.memory_report(params, tx.init(params))
  assert report.num_params == N
  params_b, master_b, opt_b, grads_b = expected
  assert report.param_bytes == params_b * N
  assert report.master_bytes == master_b * N
  assert report.opt_state_bytes == opt_b * N + COUNTERS
  assert report.grad_bytes == grads_b * N
  assert report.bytes_per_param()["master"] == master_b
  assert report.state_bytes == (params_b + master_b + opt_b) * N + COUNTERS


def test_the_compiled_step_adds_xla_memory_analysis():
  params = _params(jnp.bfloat16)
  tx = jaxmp.optim.master_weights(_bf16_adamw())
  opt_state = tx.init(params)

  def step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]).astype(jnp.float32) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x = jnp.ones((8, 256), jnp.bfloat16)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, x).compile()
  report = jaxmp.tools.memory_report(params, opt_state, compiled=compiled)
  stats = compiled.memory_analysis()
  assert report.argument_bytes == stats.argument_size_in_bytes
  assert report.temp_bytes == stats.temp_size_in_bytes
  assert report.peak_bytes == (stats.argument_size_in_bytes + stats.output_size_in_bytes
                               + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  # The arguments are the state (params, master, moments, count) and the batch.
  assert report.argument_bytes == report.state_bytes + x.size * 2
  assert report.alias_bytes > 0  # donated state reused for the new state
  text = str(report)
  assert "bytes/param" in text and "memory_analysis" in text and "10.00" in text


def test_gradients_given_are_counted_as_they_are():
  params = _params(jnp.bfloat16)
  grads = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  assert jaxmp.tools.memory_report(params, grads=grads).grad_bytes == 4 * N


def test_a_jitted_function_is_not_a_compiled_step():
  with pytest.raises(TypeError, match=r"\.lower\(\*args\)\.compile\(\)"):
    jaxmp.tools.memory_report(_params(jnp.float32), compiled=jax.jit(lambda x: x))
