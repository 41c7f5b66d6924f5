"""jaxmp.tools.Monitor: in-jit training metrics and the host-side anomaly monitor."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp

# ---- training_metrics ------------------------------------------------------------------------


def test_nonfinite_counts_per_top_level_key():
  grads = {"a": {"w": jnp.array([3.0, jnp.nan]), "b": jnp.array([jnp.inf, -jnp.inf])},
           "c": jnp.array([4.0]), "step": jnp.array(3)}
  metrics = jaxmp.tools.training_metrics(grads)
  assert {k: int(v) for k, v in metrics["nonfinite"].items()} == {"a": 3, "c": 0}
  assert metrics["nonfinite"]["a"].dtype == jnp.int32
  assert np.isnan(float(metrics["grad_norm"]))
  assert set(metrics) == {"grad_norm", "nonfinite"}


def test_grad_norm_in_float32_and_unscaled():
  grads = {"a": {"w": jnp.array([3.0], jnp.float16)}, "b": jnp.array([4.0])}
  assert float(jaxmp.tools.training_metrics(grads)["grad_norm"]) == 5.0
  assert float(jaxmp.tools.training_metrics(grads, loss_scale=2.0)["grad_norm"]) == 2.5
  assert float(jaxmp.tools.training_metrics(
      grads, loss_scale=jaxmp.StaticLossScale(0.5))["grad_norm"]) == 10.0
  # 300**2 overflows float16; the sum of squares is taken in float32.
  big = {"w": jnp.array([300.0, 400.0], jnp.float16)}
  norm = jaxmp.tools.training_metrics(big)["grad_norm"]
  assert norm.dtype == jnp.float32 and float(norm) == 500.0


def test_keys_for_lists_bare_arrays_nnx_and_empty_trees():
  assert list(jaxmp.tools.training_metrics([jnp.ones(1), jnp.ones(1)])["nonfinite"]) == ["0", "1"]
  assert list(jaxmp.tools.training_metrics(jnp.ones(2))["nonfinite"]) == ["<root>"]
  empty = jaxmp.tools.training_metrics({"ids": jnp.arange(3)})
  assert float(empty["grad_norm"]) == 0.0 and empty["nonfinite"] == {}

  class Net(nnx.Module):

    def __init__(self):
      self.body = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      self.head = nnx.Linear(2, 1, rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.head(self.body(x))

  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(Net())
  assert sorted(jaxmp.tools.training_metrics(grads)["nonfinite"]) == ["body", "head"]


def test_loss_scaling_entries_and_jit():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**15))
  state = tx.init({"w": jnp.ones(2)})
  grads = {"w": jnp.array([jnp.inf, 1.0])}
  _, state = tx.update(grads, state)
  for fun in (jaxmp.tools.training_metrics, jax.jit(jaxmp.tools.training_metrics)):
    metrics = fun(grads, state, loss_scale=jnp.float32(2.0**15))
    assert float(metrics["loss_scale"]) == 2.0**14
    assert int(metrics["skipped_steps"]) == 1
    assert not bool(metrics["last_step_finite"])
    assert int(metrics["nonfinite"]["w"]) == 1


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(loss_scale=0.0), ValueError, "got 0.0"),
    (dict(loss_scale=float("inf")), ValueError, "got inf"),
    (dict(loss_scale="2"), TypeError, "got '2' of type str"),
    (dict(loss_scale=jnp.ones(2)), ValueError, "shape (2,)"),
    (dict(opt_state=optax.sgd(1.0).init(jnp.ones(1))), ValueError, "no LossScalingState"),
])
def test_training_metrics_bad_inputs(kwargs, error, text):
  with pytest.raises(error, match=re.escape(text)):
    jaxmp.tools.training_metrics({"w": jnp.ones(2)}, **kwargs)


# ---- Monitor ---------------------------------------------------------------------------------


def _flagged(monitor, kind):
  return [a.step for a in monitor.anomalies if a.kind == kind]


def test_scale_collapse_is_flagged_when_it_starts():
  monitor = jaxmp.tools.Monitor(min_scale=1.0, collapse_factor=8.0)
  scales = [32768, 16384, 64, 16, 8, 4, 4, 16, 16, 8, 2]
  flagged = [bool(monitor.update({"loss_scale": jnp.float32(s)})) for s in scales]
  assert [i for i, f in enumerate(flagged) if f] == [4, 9]
  assert _flagged(monitor, "scale_collapse") == [4, 9]
  assert monitor.anomalies[0].message == ("loss scale 8 <= 8 x min_scale 1 (down from 32768): "
                                          "gradients overflow at almost any scale")


def test_fixed_small_scales_never_collapse():
  monitor = jaxmp.tools.Monitor()
  for _ in range(5):
    monitor.update({"loss_scale": 1.0, "last_step_finite": True})   # NoOpLossScale
  assert monitor.anomalies == ()
  monitor = jaxmp.tools.Monitor(min_scale=2.0, collapse_factor=2.0)
  assert [monitor.update({"loss_scale": s}) != () for s in (4.0, 4.0, 2.0)] == [
      False, False, True]


def test_skip_rate_over_a_window_names_the_modules():
  monitor = jaxmp.tools.Monitor(skip_window=4, max_skip_rate=0.25)
  skipped = [0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0]
  nonfinite = {1: {"head": 3, "body": 0}, 4: {"head": 1, "embed": 2}, 6: {"embed": 5}}
  for i, s in enumerate(skipped):
    monitor.update({"last_step_finite": jnp.array(not s),
                    "nonfinite": nonfinite.get(i, {"head": 0})})
  assert _flagged(monitor, "skip_rate") == [4, 6]
  assert monitor.anomalies[0].message == (
      "2 of the last 4 steps skipped (50% > 25%); non-finite gradients in head (4), embed (2)")
  assert monitor.anomalies[1].message.endswith("embed (7), head (1)")


def test_skip_rate_needs_a_full_known_window():
  monitor = jaxmp.tools.Monitor(skip_window=3, max_skip_rate=0.0)
  monitor.update({"last_step_finite": False})
  monitor.update({"last_step_finite": False})
  assert monitor.anomalies == ()
  monitor.update({})                                  # unknown: no check
  monitor.update({"last_step_finite": False})
  monitor.update({"last_step_finite": True})
  assert monitor.anomalies == ()
  monitor.update({"last_step_finite": True})        # window [F, T, T]: 1/3 > 0
  assert _flagged(monitor, "skip_rate") == [5]


def test_loss_spikes_and_nonfinite_losses():
  monitor = jaxmp.tools.Monitor(spike_window=3, spike_factor=2.0)
  losses = [1.0, 1.2, 0.8, 1.0, 2.5, 2.6, 1.0, float("nan"), 1.1, 5.0]
  for loss in losses:
    monitor.update({}, loss=jnp.float32(loss))
  assert _flagged(monitor, "loss_spike") == [4, 9]
  assert _flagged(monitor, "nonfinite_loss") == [7]
  assert monitor.anomalies[0].message == (
      "loss 2.5 > 2 x 1, the median of the previous 3 finite losses")
  assert str(monitor.anomalies[1]) == "step 7: nonfinite_loss: the loss is nan"


def test_no_spike_check_for_non_positive_median():
  monitor = jaxmp.tools.Monitor(spike_window=2)
  for loss in (-3.0, -2.0, 5.0):
    monitor.update({}, loss=loss)
  assert monitor.anomalies == ()


def test_history_steps_and_text():
  monitor = jaxmp.tools.Monitor(skip_window=2, max_skip_rate=0.4)
  metrics = jaxmp.tools.training_metrics({"head": jnp.array([jnp.inf]), "body": jnp.ones(1)})
  metrics.update(loss_scale=jnp.float32(4.0), last_step_finite=jnp.array(False))
  monitor.update(metrics, loss=2.0, step=10)
  monitor.update({"loss_scale": 4.0, "last_step_finite": True, "grad_norm": 0.5}, loss=1.5)
  monitor.update({"last_step_finite": False}, step=20)
  history = monitor.history()
  assert history["step"].tolist() == [10, 11, 20]
  assert history["loss"][:2].tolist() == [2.0, 1.5] and np.isnan(history["loss"][2])
  assert history["skipped"].tolist() == [1, 0, 1]
  assert history["loss_scale"][:2].tolist() == [4.0, 4.0]
  assert {k: v.tolist() for k, v in history["nonfinite"].items()} == {
      "body": [0, 0, 0], "head": [1, 0, 0]}
  assert monitor.steps == 3
  assert _flagged(monitor, "skip_rate") == [11]   # window [skipped, not]; still on at 20
  text = str(monitor).splitlines()
  assert text[0] == "Monitor: 3 steps, 2 skipped (66.7%)"
  assert text[1] == "1 anomalies:"
  assert text[2] == ("  step 11: skip_rate: 1 of the last 2 steps skipped (50% > 40%); "
                     "non-finite gradients in head (1)")
  assert str(jaxmp.tools.Monitor()) == "Monitor: no steps yet"


def test_a_real_collapsing_run_is_flagged():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(8.0, min_scale=1.0))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  monitor = jaxmp.tools.Monitor(skip_window=2, max_skip_rate=0.5, collapse_factor=2.0)

  @jax.jit
  def step(state):
    grads = {"w": jnp.array([jnp.inf, 0.0])}     # overflows at every scale
    _, state = tx.update(grads, state, params)
    return state, jaxmp.tools.training_metrics(grads, state)

  for _ in range(4):
    state, metrics = step(state)
    monitor.update(metrics, loss=1.0)
  # Scales seen: 4, 2, 1, 1. The first one seen is the reference.
  assert [(a.step, a.kind) for a in monitor.anomalies] == [(1, "scale_collapse"),
                                                           (1, "skip_rate")]


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(min_scale=0.0), ValueError, "min_scale must be finite and > 0, got 0.0"),
    (dict(min_scale="1"), TypeError, "min_scale must be a number, got '1'"),
    (dict(collapse_factor=0.5), ValueError, "collapse_factor must be finite and >= 1, got 0.5"),
    (dict(skip_window=0), ValueError, "skip_window must be finite and >= 1, got 0"),
    (dict(skip_window=1.5), TypeError, "skip_window must be an integer, got 1.5"),
    (dict(skip_window=True), TypeError, "skip_window must be an integer, got True"),
    (dict(max_skip_rate=1.0), ValueError, "max_skip_rate must be in [0, 1), got 1.0"),
    (dict(max_skip_rate=-0.1), ValueError, "max_skip_rate must be finite and >= 0, got -0.1"),
    (dict(spike_window=0), ValueError, "spike_window must be finite and >= 1, got 0"),
    (dict(spike_factor=1.0), ValueError, "spike_factor must be finite and > 1, got 1.0"),
    (dict(spike_factor=float("inf")), ValueError, "spike_factor must be finite and > 1, got inf"),
    (dict(max_consecutive_skips=0), ValueError,
     "max_consecutive_skips must be finite and >= 1, got 0"),
    (dict(max_consecutive_skips=2.0), TypeError, "max_consecutive_skips must be an integer"),
])
def test_monitor_bad_arguments(kwargs, error, text):
  with pytest.raises(error, match=re.escape(text)):
    jaxmp.tools.Monitor(**kwargs)


@pytest.mark.parametrize("call, error, text", [
    (lambda m: m.update([1.0]), TypeError, "metrics must be a mapping"),
    (lambda m: m.update({}, loss="1.0"), TypeError, "got '1.0' of type str"),
    (lambda m: m.update({}, loss=jnp.ones(2)), TypeError, "loss must be a real scalar"),
    (lambda m: m.update({"loss_scale": jnp.ones(2)}), ValueError,
     "metrics['loss_scale'] must be a scalar, got shape (2,)"),
    (lambda m: m.update({}, step=2.0), TypeError, "step must be an integer, got 2.0"),
    (lambda m: m.update({}, step=5), ValueError, "step must increase, got 5 after 5"),
    (lambda m: m.update({"loss_scael": 8.0}), ValueError,
     "unknown metric 'loss_scael'; accepted: 'grad_norm', 'nonfinite', 'loss_scale', "
     "'skipped_steps', 'last_step_finite', 'consecutive_skips'"),
    # Values are checked as well as keys: each would feed a check a number it misreads.
    (lambda m: m.update({"loss_scale": -1.0}), ValueError,
     "metrics['loss_scale'] must be positive and finite, got -1.0"),
    (lambda m: m.update({"loss_scale": jnp.float32(jnp.nan)}), ValueError,
     "metrics['loss_scale'] must be positive and finite, got nan"),
    (lambda m: m.update({"loss_scale": "8"}), TypeError,
     "metrics['loss_scale'] must be a real number, got '8'"),
    (lambda m: m.update({"last_step_finite": "yes"}), TypeError,
     "metrics['last_step_finite'] must be a bool (True: the step was applied), got 'yes'"),
    (lambda m: m.update({"last_step_finite": 1}), TypeError,
     "metrics['last_step_finite'] must be a bool (True: the step was applied), got 1"),
    (lambda m: m.update({"skipped_steps": -2}), ValueError,
     "metrics['skipped_steps'] must be a count >= 0, got -2"),
    (lambda m: m.update({"consecutive_skips": 1.5}), TypeError,
     "metrics['consecutive_skips'] must be an integer count, got 1.5"),
    (lambda m: m.update({"grad_norm": -0.5}), ValueError,
     "metrics['grad_norm'] must be >= 0 (or inf or NaN for non-finite gradients), got -0.5"),
    (lambda m: m.update({"nonfinite": 3}), TypeError,
     "metrics['nonfinite'] must be a mapping of top-level keys to counts, got 3"),
    (lambda m: m.update({"nonfinite": {"w": -1}}), ValueError,
     "metrics['nonfinite']['w'] must be a count >= 0, got -1"),
])
def test_monitor_update_bad_inputs(call, error, text):
  monitor = jaxmp.tools.Monitor()
  monitor.update({}, step=5)
  with pytest.raises(error, match=re.escape(text)):
    call(monitor)
  assert monitor.steps == 1    # nothing recorded by a refused update


def test_the_monitor_is_host_only_and_says_so_inside_jit():
  with pytest.raises(TypeError, match=re.escape(
      "Monitor.update reads the metrics and loss on the host, after the step: it cannot run "
      "inside jit")):
    jax.jit(lambda loss: jaxmp.tools.Monitor().update({}, loss=loss) and loss)(1.0)


def test_values_that_are_not_errors_are_recorded():
  monitor = jaxmp.tools.Monitor()
  monitor.update({"grad_norm": np.float32(np.inf), "loss_scale": 8, "skipped_steps": np.int32(0),
                  "last_step_finite": np.bool_(False), "nonfinite": {"w": np.int32(2)}})
  history = monitor.history()
  assert history["grad_norm"].tolist() == [np.inf] and history["loss_scale"].tolist() == [8.0]
  assert history["skipped"].tolist() == [1] and history["nonfinite"]["w"].tolist() == [2]


def test_text_shows_nonfinite_values_but_not_missing_ones():
  monitor = jaxmp.tools.Monitor()
  monitor.update({"grad_norm": jnp.float32(jnp.nan), "loss_scale": 8.0}, loss=float("inf"))
  assert str(monitor).splitlines()[0] == "Monitor: 1 steps, loss inf, grad norm nan, loss scale 8"
  monitor.update({})
  assert str(monitor).splitlines()[0] == "Monitor: 2 steps"


def test_a_streak_of_skipped_steps_is_flagged_once_when_it_reaches_the_limit():
  monitor = jaxmp.tools.Monitor(max_consecutive_skips=3, skip_window=1000)
  streak = [1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
  for count in streak:
    monitor.update({"consecutive_skips": jnp.int32(count), "loss_scale": 1.0,
                    "last_step_finite": count == 0})
  assert _flagged(monitor, "skip_streak") == [5, 11]
  assert monitor.anomalies[0].message == (
      "3 consecutive steps skipped (>= max_consecutive_skips 3) at loss scale 1: no step "
      "has been applied since step 2")


def test_the_streak_comes_from_a_real_run_with_the_state_metrics():
  import optax

  # min_scale = scale: the scale cannot fall, so only the streak is flagged.
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(4.0, min_scale=4.0))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  monitor = jaxmp.tools.Monitor(max_consecutive_skips=4)
  flagged = []
  for _ in range(5):
    _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
    flagged.append([a.kind for a in monitor.update(jaxmp.loss_scaling_metrics(state))])
  assert flagged == [[], [], [], ["skip_streak"], []]


# ---- the non-finite report ---------------------------------------------------------------------

_CALLS = (("", "__call__"), ("dense", "__call__"))
# Columns: input, output, output_grad, input_grad, param_grad, made_forward, made_backward,
# forward, backward, count (jaxmp._src.nonfinite.COLUMNS).
_INF = float("inf")
_CLEAN = [[1.0, 2.0, 1.0, 3.0, -_INF, 0.0, 0.0, 2.0, 1.0, 1.0],
          [1.0, 2.0, 1.0, 3.0, 4.0, 0.0, 0.0, 1.0, 2.0, 1.0]]
_OVERFLOW = [[1.0, _INF, _INF, _INF, -_INF, 0.0, 0.0, 2.0, 1.0, 1.0],   # dense made an inf
             [1.0, _INF, _INF, _INF, _INF, 1.0, 0.0, 1.0, 2.0, 1.0]]


def _trace_metrics(rows, finite):
  return {"nonfinite_trace": jaxmp.tools.NonfiniteTrace(_CALLS, jnp.array(rows, jnp.float32)),
          "last_step_finite": finite}


def test_the_nonfinite_report_is_of_the_last_step_that_overflowed_not_the_last_step():
  monitor = jaxmp.tools.Monitor()
  for rows, finite in ((_CLEAN, True), (_OVERFLOW, False), (_CLEAN, True), (_CLEAN, True)):
    monitor.update(_trace_metrics(rows, finite))
  report = monitor.nonfinite_report()   # at the end of the loop
  assert str(report.origin) == "forward output of dense"
  assert report.step == 1
  assert str(report).splitlines()[0] == (
      "Non-finite trace of step 1: first non-finite value: forward output of dense")
  # A later overflow replaces it; the step numbers are the ones given to update.
  monitor.update(_trace_metrics(_OVERFLOW, False), step=10)
  monitor.update(_trace_metrics(_CLEAN, True), step=11)
  assert monitor.nonfinite_report().step == 10


def test_with_no_overflow_the_nonfinite_report_is_of_the_latest_step():
  monitor = jaxmp.tools.Monitor()
  assert monitor.nonfinite_report() is None
  for _ in range(3):
    monitor.update(_trace_metrics(_CLEAN, True))
  report = monitor.nonfinite_report()
  assert report.step == 2 and report.origin is None
  assert str(report).splitlines()[0] == "Non-finite trace of step 2: every recorded value was finite"
  assert jaxmp.tools.nonfinite_report(_trace_metrics(_CLEAN, True)["nonfinite_trace"]).step is None


class _TracedMLP(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 4, rngs=rngs)

  def __call__(self, x):
    return self.hidden(x)


def test_the_probe_in_place_of_the_steps_trace_is_refused_before_anything_is_recorded():
  # The zero probe (what init returns) reads as "every value finite" forever; eagerly
  # training_metrics refuses it, inside jit the monitor does on the host.
  import flax.linen as nn
  model = jaxmp.linen.mixed_precision(nn.Dense(2), jaxmp.PolicyRules(
      "params=float32,compute=float16,output=float32", trace_nonfinite=True))
  variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
  probe = variables["jaxmp_nonfinite"]
  fix = "pass grads.nonfinite, the trace returned beside the gradients"
  with pytest.raises(ValueError, match="training_metrics: this non-finite trace recorded no "
                     "module call: it is the zero probe") as info:
    jaxmp.tools.training_metrics(variables["params"], nonfinite_trace=probe)
  assert fix in str(info.value)
  metrics = jax.jit(lambda p, t: jaxmp.tools.training_metrics(p, nonfinite_trace=t))(
      variables["params"], probe)
  monitor = jaxmp.tools.Monitor()
  with pytest.raises(ValueError, match=re.escape(
      "Monitor.update: metrics['nonfinite_trace']: this non-finite trace recorded no module "
      "call")) as info:
    monitor.update(metrics, loss=1.0)
  assert fix in str(info.value)
  assert monitor.steps == 0 and monitor.latest is None and monitor.nonfinite_report() is None
  # NNX: the same for its wrapper's probe, eagerly.
  wrapped = jaxmp.nnx.mixed_precision(_TracedMLP(nnx.Rngs(0)), jaxmp.PolicyRules(
      "float32", trace_nonfinite=True))
  _, grads = jaxmp.nnx.value_and_grad(lambda m: jnp.sum(m(jnp.ones((1, 3)))))(wrapped)
  assert jaxmp.tools.training_metrics(grads.params, nonfinite_trace=grads.nonfinite)[
      "nonfinite_trace"] is grads.nonfinite
  zero = jaxmp.tools.NonfiniteTrace(grads.nonfinite.calls, jnp.zeros_like(grads.nonfinite.values))
  with pytest.raises(ValueError, match="recorded no module call"):
    jaxmp.tools.training_metrics(grads.params, nonfinite_trace=zero)


_ORIGIN = jaxmp.tools.Origin("dense", "__call__", "forward", "output", float("inf"))


@pytest.mark.parametrize("fields, error, text", [
    (dict(skipped="no"), TypeError, "skipped must be True, False or None, got 'no'"),
    (dict(skipped=1), TypeError, "skipped must be True, False or None, got 1"),
    (dict(active="skip_rate scale_collapse"), TypeError,
     "active must be a set of anomaly kinds, got 'skip_rate scale_collapse'"),
    (dict(active=["scale_collapse"]), TypeError,
     "active must be a set of anomaly kinds, got ['scale_collapse']"),
    (dict(active=frozenset({"scale_colapse"})), ValueError,
     "unknown anomaly kind 'scale_colapse' in active; accepted: 'scale_collapse', "
     "'skip_rate', 'loss_spike', 'nonfinite_loss', 'skip_streak', 'nonfinite_origin'"),
    (dict(step=1.0), TypeError, "step must be an integer, got 1.0"),
    (dict(loss="2.0"), TypeError, "loss must be a real number or None, got '2.0'"),
    (dict(loss_scale=-8.0), ValueError, "loss_scale must be positive and finite or None, got -8.0"),
    (dict(origin="forward output of dense"), TypeError,
     "origin must be a jaxmp.tools.Origin or None, got 'forward output of dense'"),
    (dict(traced=False), ValueError, "an origin needs traced=True"),
    (dict(traced="yes"), TypeError, "traced must be True or False, got 'yes'"),
])
def test_a_step_record_is_checked_when_built(fields, error, text):
  good = dict(step=3, loss=2.0, skipped=True, loss_scale=8.0, origin=_ORIGIN, traced=True,
              active=frozenset({"scale_collapse"}))
  with pytest.raises(error, match=re.escape(f"StepRecord: {text}")):
    jaxmp.tools.StepRecord(**{**good, **fields})
  with pytest.raises(error, match=re.escape(f"StepRecord: {text}")):
    jaxmp.tools.StepRecord(**good)._replace(**fields)


def test_a_step_record_keeps_what_it_is_given_as_plain_values():
  record = jaxmp.tools.StepRecord(np.int64(3), np.float32(2.5), np.bool_(True), 8, None, False,
                                  {"skip_rate"})
  assert record == (3, 2.5, True, 8.0, None, False, frozenset({"skip_rate"}))
  assert [type(v) for v in record[:4]] == [int, float, bool, float]
  assert type(record.active) is frozenset


def test_latest_is_what_the_last_update_recorded():
  # What jaxmp.tools.PrecisionController reads: one record per step, the origin computed
  # once, and the anomaly kinds whose condition still holds (not only those that start).
  monitor = jaxmp.tools.Monitor(min_scale=1.0, collapse_factor=8.0)
  assert monitor.latest is None
  monitor.update({**_trace_metrics(_OVERFLOW, False), "loss_scale": 16.0}, loss=2.5)
  first = monitor.latest
  assert isinstance(first, jaxmp.tools.StepRecord)
  assert (first.step, first.loss, first.skipped, first.loss_scale, first.traced) == (
      0, 2.5, True, 16.0, True)
  assert str(first.origin) == "forward output of dense" and first.origin.path == "dense"
  assert first.active == frozenset({"nonfinite_origin"})
  for step, scale in ((5, 8.0), (6, 4.0)):  # collapsed: flagged once, active at both steps
    monitor.update({**_trace_metrics(_OVERFLOW, False), "loss_scale": scale}, step=step)
    assert monitor.latest.active == frozenset({"nonfinite_origin", "scale_collapse"})
  monitor.update({"last_step_finite": True})
  last = monitor.latest
  assert (last.step, last.loss, last.skipped, last.loss_scale, last.origin, last.traced) == (
      7, None, False, None, None, False)
  assert last.active == frozenset()
  monitor.update({})
  assert monitor.latest.skipped is None
