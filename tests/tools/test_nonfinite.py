"""jaxmp.tools.nonfinite_report, first_nonfinite and Origin: a step's trace read on the host.

What a trace holds is tested in ``tests/test_nonfinite.py``; locating overflows end to end
in ``tests/test_nonfinite_locate.py``. Here: what the reading refuses.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxmp
from jaxmp._src.tools import nonfinite as nonfinite_report

FP16 = jaxmp.PolicyRules("params=float32,compute=float16,output=float32", trace_nonfinite=True)
X = jnp.ones((4, 3))
BIG = jnp.full((4, 3), 6e4)   # overflows float16 in `hidden`
INF = float("inf")


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="head")(nn.relu(nn.Dense(4, name="hidden")(x)))


@pytest.fixture(scope="module")
def traced():
  model = jaxmp.linen.mixed_precision(_MLP(), FP16)
  variables = model.init(jax.random.key(0), X)
  loss = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
  _, grads = jax.jit(jaxmp.linen.value_and_grad(loss))(variables, BIG)
  return variables, grads


def test_the_probe_in_place_of_the_steps_trace_is_refused_naming_the_trace_to_pass(traced):
  # The zero probe init returns has the trace's type and calls, and reads as "every value
  # finite" forever: a trace that recorded no module call is never a step's.
  variables, grads = traced
  probe = variables["jaxmp_nonfinite"]
  for read in (jaxmp.tools.nonfinite_report, nonfinite_report.first_nonfinite):
    with pytest.raises(ValueError, match=re.escape(
        "recorded no module call: it is the zero probe")) as info:
      read(probe)
    assert "pass grads.nonfinite" in str(info.value)
  assert str(nonfinite_report.first_nonfinite(grads.nonfinite)) == "forward output of hidden"


def test_reading_a_trace_inside_jit_is_refused_as_host_only(traced):
  _, grads = traced
  with pytest.raises(TypeError, match=re.escape(
      "nonfinite_report reads the trace on the host, after the step: it cannot run inside "
      "jit")):
    jax.jit(lambda t: jaxmp.tools.nonfinite_report(t).loss_scale)(grads.nonfinite)
  with pytest.raises(TypeError, match="first_nonfinite reads the trace on the host"):
    jax.jit(lambda t: nonfinite_report.first_nonfinite(t).amax)(grads.nonfinite)


@pytest.mark.parametrize("fields, error, text", [
    (("hidden", "__call__", "sideways", "output", INF), ValueError,
     "direction must be 'forward' or 'backward', got 'sideways'"),
    (("hidden", "__call__", "forward", "outptu", INF), ValueError,
     "a forward value must be 'input' or 'output', got 'outptu'"),
    (("hidden", "__call__", "forward", "param_grad", INF), ValueError,
     "a forward value must be 'input' or 'output', got 'param_grad'"),
    (("hidden", "__call__", "backward", "output", INF), ValueError,
     "a backward value must be 'output_grad', 'input_grad' or 'param_grad', got 'output'"),
    ((3, "__call__", "forward", "output", INF), TypeError, "path must be a string, got 3"),
    (("hidden", None, "forward", "output", INF), TypeError, "method must be a string, got None"),
    (("hidden", "__call__", "forward", "output", -1.0), ValueError,
     "amax must be >= 0 (inf for inf or NaN), got -1.0"),
    (("hidden", "__call__", "forward", "output", float("nan")), ValueError,
     "amax must be >= 0 (inf for inf or NaN), got nan"),
    (("hidden", "__call__", "forward", "output", "inf"), TypeError,
     "amax must be a real number, got 'inf'"),
])
def test_an_origin_is_checked_when_built(fields, error, text):
  with pytest.raises(error, match=re.escape(f"Origin: {text}")):
    jaxmp.tools.Origin(*fields)
  good = jaxmp.tools.Origin("hidden", "__call__", "forward", "output", INF)
  with pytest.raises(error, match=re.escape(f"Origin: {text}")):
    good._replace(**dict(zip(good._fields, fields)))


def test_a_valid_origin_is_a_plain_record():
  origin = jaxmp.tools.Origin("block/mlp", "attend", "backward", "param_grad", 3)
  assert origin == ("block/mlp", "attend", "backward", "param_grad", 3.0)
  assert type(origin.amax) is float
  assert str(origin) == "backward parameter gradient of block/mlp.attend"
  assert origin._replace(amax=INF).amax == INF
