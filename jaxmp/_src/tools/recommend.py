"""``recommend_precision``: the candidate policy the compiler estimates fastest for a step.

:func:`jaxmp.tools.recommended_policy` is a static table per chip: it suggests fp8 on
TPU v7 and Hopper whatever the model. A narrow type makes the GEMMs cheaper but adds
scaling passes (amax reductions, quantizations) around them, and whether the sum is
faster depends on the step: by libtpu's cost model, int8 makes a Llama-shaped layer's
train step slower than bf16 on every TPU at 1 x 1024 tokens and faster on v5e and v5p
at 2 x 4096 (``benchmarks/RESULTS.md``).
:func:`recommend_precision` asks the compiler about the user's own step instead:

1. For each candidate (a name and its :class:`~jaxmp.PolicyRules`), ``build(rules)``
   returns ``(step_fn, args)``, and :func:`~jaxmp.tools.audit` compiles
   ``step_fn(*args)`` deviceless for ``target`` (or on the local backend).
2. Each compile's estimate is read by :func:`step_estimates`, one reading per
   platform. On a TPU: the sum of every kernel's cost-model ``estimated_cycles``, as
   ``benchmarks/gpu_report.py`` and ``benchmarks/RESULTS.md`` sum them (asynchronous
   copies and custom calls carry no cycles and count 0). Not libtpu's whole-program
   ``optimal_seconds`` (``AuditReport.estimated_seconds``), even where every compile
   has it: it prices an int8 and an fp8 4096^3 matmul alike on every TPU (v5e: 0.789
   ms each, bf16 0.880 ms), where the kernels' cycles give each chip's matrix rate
   (v5e: int8 542,476, fp8 1,088,142, bf16 1,082,356; v7: fp8 149,229, int8 323,195,
   bf16 312,832), and it is missing for many steps. On a GPU: the roofline estimate
   plus a stated overhead per kernel
   (:meth:`~jaxmp.tools.AuditReport.estimated_seconds_with_launches`).
3. :func:`choose` picks the candidate with the smallest estimate, but only if it is
   smaller than the baseline's; otherwise (ties included) the baseline.

These are estimates from the compiler's output and its cost model, never
measurements: they rank candidates, they do not time them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from jaxmp._src import rules as rules_lib
from jaxmp._src.tools import audit as audit_lib
from jaxmp._src.tools import isolated_compile
from jaxmp._src.tools import table as table_lib
from jaxmp._src.tools import targets as targets_lib

_WHERE = "recommend_precision"


@dataclasses.dataclass(frozen=True)
class CandidateEstimate:
  """One candidate's compiled step, by the compiler's estimate.

  Attributes:
    name: the candidate's name.
    rules: its rules.
    estimate: the step's estimate, in :attr:`PrecisionRecommendation.unit`.
    speedup: the baseline's estimate over this one (above 1: estimated faster).
    launches: the step's kernels per call.
  """

  name: str
  rules: rules_lib.PolicyRules
  estimate: float
  speedup: float
  launches: int


@dataclasses.dataclass(frozen=True)
class PrecisionRecommendation:
  """What :func:`recommend_precision` found; ``print`` it for the table.

  Attributes:
    target: the chip compiled for (``"v5e"``, ``"h100"``...; the local platform for
      ``target=None``).
    unit: ``"seconds"`` or ``"cycles"`` (the TPU cost model's), for every estimate.
    source: how the estimates were made, e.g. ``"GPU roofline estimate + 4 us per
      kernel launch"``.
    candidates: every candidate's estimate, in the order given.
    baseline: the baseline's name.
    chosen: the chosen candidate's name: the fastest by estimate if it is faster than
      the baseline, else the baseline.
    rules: the chosen candidate's rules.
    failed: ``(name, message)`` of each candidate whose compile crashed or failed
      (:class:`jaxmp.tools.CompileCrashError`), left out of
      the choice.
  """

  target: str
  unit: str
  source: str
  candidates: tuple[CandidateEstimate, ...]
  baseline: str
  chosen: str
  rules: rules_lib.PolicyRules
  failed: tuple[tuple[str, str], ...] = ()

  def __str__(self) -> str:
    def value(c: CandidateEstimate) -> str:
      if self.unit == "cycles":
        return f"{c.estimate:,.0f}"
      return f"{c.estimate * 1e6:.4g} us" if c.estimate < 1e-3 else f"{c.estimate * 1e3:.4g} ms"
    rows = [(c.name + (" (baseline)" if c.name == self.baseline else ""), value(c),
             f"{c.speedup:.2f}x", str(c.launches), "<- chosen" if c.name == self.chosen else "")
            for c in self.candidates]
    header = ("candidate", "estimate" if self.unit == "seconds" else "cycles",
              "vs baseline", "kernels", "")
    return (f"recommend_precision: {self.target}, {self.source}\n"
            + table_lib.text_table(header, rows, (False, True, True, True, False))
            + "".join(f"\n{name}: not compiled: {why}" for name, why in self.failed)
            + f"\nchosen: {self.chosen} (compiler/cost-model estimates, not measurements)")


# The seconds :func:`recommend_precision` adds per kernel on a GPU by default: what
# steps measured on an H200 cost beyond their H100 roofline estimate, per kernel, in the
# form that orders bf16 and fp8 as the chip did (benchmarks/RESULTS.md, "Third run":
# the state donated, steps dispatched back to back, as a training loop runs them). The
# demo step measured fp8 1.08x bf16 and is estimated at 1.07x with 4 us (24.6 / 20.5 ms
# of roofline, 985 / 1568 kernels); the Llama-3-8B layer with causal attention measured
# 1.29x and is estimated at 1.26x (7.7 / 5.6 ms, 61 / 164 kernels). Each step waited
# for before the next was launched, the host's time per step came on top (20 us per
# kernel fitted those earlier runs).
GPU_PER_KERNEL_S = 4e-6


def _report_cycles(report: audit_lib.AuditReport) -> int | None:
  """Every kernel's cost-model cycles per call (none: 0), or None where no kernel has any."""
  items = [*report.gemms, *report.kernels]
  if all(x.cycles is None for x in items):
    return None
  return sum((x.cycles or 0) * x.count for x in items)


def step_estimates(reports: Mapping[str, audit_lib.AuditReport],
                   per_launch: float = GPU_PER_KERNEL_S) -> tuple[dict[str, float], str, str]:
  """Each compiled step's estimate, in one unit for all of them.

  GPU reports (those with a roofline ``spec``): ``estimated_seconds_with_launches(
  per_launch)``. TPU reports: the sum of every kernel's cost-model ``cycles`` (never
  ``estimated_seconds``, libtpu's ``optimal_seconds``, which does not tell an int8
  GEMM from an fp8 one: see the module docstring).

  Args:
    reports: :func:`~jaxmp.tools.audit` reports by candidate name, one target.
    per_launch: seconds added per kernel launch on a GPU; 0 or more.

  Returns:
    ``(estimates, unit, source)``: the estimate by name, ``"seconds"`` or ``"cycles"``,
    and a description of how they were made.

  Raises:
    ValueError: if a report has no estimate (a CPU compile, or a TPU compile without
      cost-model cycles); the message names the candidate and the target.
  """
  per_launch = audit_lib.check_per_launch(per_launch)
  if all(r.spec is not None for r in reports.values()):
    seconds = {n: r.estimated_seconds_with_launches(per_launch) for n, r in reports.items()}
    source = f"GPU roofline estimate + {per_launch * 1e6:g} us per kernel launch"
    return _known(seconds, reports), "seconds", source
  if all(targets_lib.is_tpu(r.target) or r.device_kind.startswith("TPU")
         for r in reports.values()):
    cycles = {n: _report_cycles(r) for n, r in reports.items()}
    return _known(cycles, reports), "cycles", "TPU cost model (sum of kernels' estimated_cycles)"
  return _known(dict.fromkeys(reports), reports), "seconds", ""


def _known(estimates: Mapping[str, float | int | None],
           reports: Mapping[str, audit_lib.AuditReport]) -> dict[str, float]:
  for name, value in estimates.items():
    if value is None:
      report = reports[name]
      raise ValueError(
          f"{_WHERE}: the compile of candidate {name!r} for {report.target!r} "
          f"({report.device_kind}) gives no time estimate; estimates come from a GPU "
          f"target's roofline or a TPU target's cost model, e.g. target='h100' or "
          f"target='v5e' ({', '.join(repr(t) for t in targets_lib.TARGETS)}), not from a "
          "CPU compile.")
  return {n: float(v) for n, v in estimates.items() if v is not None}


def choose(estimates: Mapping[str, float], baseline: str) -> str:
  """The name with the smallest estimate if it is below the baseline's, else ``baseline``.

  Ties keep the baseline (and, among the others, the first in order): a candidate
  is chosen over the baseline only if it is estimated strictly faster.

  Args:
    estimates: the estimate of each candidate (any one unit; smaller is faster).
    baseline: a key of ``estimates``.

  Returns:
    The chosen name.

  Example:
    >>> from jaxmp._src.tools import recommend
    >>> recommend.choose({"bf16": 10.0, "fp8": 12.0, "int8": 9.0}, "bf16")
    'int8'
    >>> recommend.choose({"bf16": 10.0, "fp8": 12.0, "int8": 10.0}, "bf16")
    'bf16'
  """
  # The smallest estimate; on a tie the baseline sorts first, so another candidate wins
  # only if strictly smaller (and among tied others, min keeps the first).
  return min(estimates, key=lambda n: (estimates[n], n != baseline))


def _check_build_output(out: Any, name: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  if not (isinstance(out, tuple) and len(out) == 2 and callable(out[0])
          and isinstance(out[1], tuple)):
    raise TypeError(
        f"{_WHERE}: build(rules) must return (step_fn, args): a callable and a tuple of its "
        f"arguments (arrays, jax.ShapeDtypeStruct or jax.eval_shape output); for candidate "
        f"{name!r} it returned {out!r:.200} of type {type(out).__name__}.")
  return out[0], out[1]


def recommend_precision(
    build: Callable[[rules_lib.PolicyRules], tuple[Callable[..., Any], tuple[Any, ...]]],
    candidates: Mapping[str, rules_lib.PolicyRules], *, target: str | None,
    baseline: str = "bf16", per_launch: float = GPU_PER_KERNEL_S,
    compiler_options: Mapping[str, Any] | None = None) -> PrecisionRecommendation:
  """The candidate rules whose compiled step is estimated fastest, never slower than baseline.

  For each candidate, ``build(rules)`` gives ``(step_fn, args)``;
  :func:`~jaxmp.tools.audit` compiles ``step_fn(*args)`` for ``target`` (deviceless
  for a named chip); ``step_estimates`` reads the estimates (TPU: the cost
  model's kernel cycles, summed; GPU: the roofline plus ``per_launch`` per kernel);
  ``choose`` picks the smallest, if smaller than the baseline's, else the
  baseline. The result holds compiler and cost-model estimates, not measurements.

  Args:
    build: ``build(rules) -> (step_fn, args)``: the user's train step for those rules
      and its arguments (arrays, or ``jax.ShapeDtypeStruct`` / ``jax.eval_shape``
      output, since fp8 state depends on the rules).
    candidates: the rules to compare by name, e.g. ``{"bf16": ..., "int8": ...}``.
    target: ``"h100"``, ``"a100"``, ``"b200"``, ``"v5e"``, ``"v5p"``, ``"v6e"``,
      ``"v7"`` (deviceless: needs the CUDA plugin or libtpu, see
      :func:`~jaxmp.tools.audit`), or None for the local backend.
    baseline: the candidate kept unless another is estimated faster.
    per_launch: seconds added per kernel on GPU targets (0 or more). The default,
      4 us, is fitted to train steps measured on an H200 (state donated, steps
      dispatched back to back): with it the estimates order bf16 and fp8 as the chip
      did on both steps measured; the roofline alone (0) favours many small kernels.
    compiler_options: XLA options for every compile (see
      :func:`~jaxmp.tools.audit`).

  Returns:
    A frozen :class:`PrecisionRecommendation`; ``print`` it for the table.

  Raises:
    TypeError: if ``build`` is not callable, ``candidates`` is not a mapping of names
      to :class:`~jaxmp.PolicyRules`, or ``build`` does not return
      ``(callable, tuple)``; also :func:`~jaxmp.tools.audit`'s errors.
    ValueError: for an unknown target, no candidates, a baseline not among them, a
      negative ``per_launch``, or a compile that gives no estimate (a CPU).
    RuntimeError: :class:`jaxmp.tools.CompileCrashError` if the baseline's compile crashes or fails
      (another candidate's is left out with a ``RuntimeWarning`` naming it, and listed
      in ``failed``).

  Example:
    >>> import flax.linen as nn
    >>> bf16 = "params=float32,compute=bfloat16,output=float32"
    >>> candidates = {
    ...     "bf16": jaxmp.PolicyRules(bf16),
    ...     "int8": jaxmp.PolicyRules(bf16, [jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.Int8Scaling())])}
    >>> def build(rules):
    ...   model = jaxmp.linen.mixed_precision(nn.Dense(256), rules)
    ...   x = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    ...   variables = jax.eval_shape(model.init, jax.random.key(0), x)
    ...   loss = lambda v, x: model.apply(v, x).sum()
    ...   return jax.grad(loss), (variables, x)
    >>> jaxmp.tools.recommend_precision(build, candidates, target=None)
    Traceback (most recent call last):
    ValueError: recommend_precision: the compile of candidate 'bf16' for 'cpu' ...
    >>> print(jaxmp.tools.recommend_precision(build, candidates, target="v5e"))  # doctest: +SKIP
    recommend_precision: v5e, TPU cost model (sum of kernels' estimated_cycles)
    candidate        cycles  vs baseline  kernels
    ---------------  ------  -----------  -------  ---------
    bf16 (baseline)   6,820        1.00x        3  <- chosen
    int8             16,710        0.41x        9
    chosen: bf16 (compiler/cost-model estimates, not measurements)

    On a CPU there is no estimate (first call); deviceless for TPU v5e (needs libtpu)
    this Dense's int8 step is estimated 2.4x slower than bf16's (its scaling passes
    cost more than its GEMM saves at this size), so bf16 is kept.
  """
  if not callable(build):
    raise TypeError(f"{_WHERE}: build must be a callable rules -> (step_fn, args), got "
                    f"{build!r} of type {type(build).__name__}.")
  if not isinstance(candidates, Mapping) or not candidates:
    raise (TypeError if not isinstance(candidates, Mapping) else ValueError)(
        f"{_WHERE}: candidates must be a non-empty mapping of names to jaxmp.PolicyRules, "
        f"got {candidates!r}.")
  for name, rules in candidates.items():
    if not isinstance(name, str) or not isinstance(rules, rules_lib.PolicyRules):
      raise TypeError(
          f"{_WHERE}: candidates must map names (str) to jaxmp.PolicyRules; candidate "
          f"{name!r} is {rules!r} of type {type(rules).__name__} (wrap a policy string as "
          "jaxmp.PolicyRules('params=float32,compute=bfloat16,output=float32')).")
  if baseline not in candidates:
    raise ValueError(f"{_WHERE}: baseline {baseline!r} is not among the candidates; "
                     f"accepted: {', '.join(repr(n) for n in candidates)}.")
  per_launch = audit_lib.check_per_launch(per_launch)
  if target is not None:
    targets_lib.check_target(target, _WHERE)
  reports, failed = {}, []
  for name, rules in candidates.items():
    step_fn, args = _check_build_output(build(rules), name)
    try:
      reports[name] = audit_lib.audit(step_fn, *args, target=target,
                                      compiler_options=compiler_options)
    except isolated_compile.CompileCrashError as e:
      if name == baseline:
        raise  # nothing to compare the others with
      # The compiler died on this candidate alone (in a child process): the others
      # can still be compared.
      warnings.warn(f"{_WHERE}: left out candidate {name!r}: {e}", RuntimeWarning,
                    stacklevel=2)
      failed.append((name, str(e)))
  estimates, unit, source = step_estimates(reports, per_launch)
  chosen = choose(estimates, baseline)
  base = estimates[baseline]
  rows = tuple(CandidateEstimate(n, candidates[n], e, base / e if e > 0 else math.inf,
                                 reports[n].launches) for n, e in estimates.items())
  return PrecisionRecommendation(next(iter(reports.values())).target, unit, source, rows,
                                 baseline, chosen, candidates[chosen], tuple(failed))


__all__ = ("CandidateEstimate", "PrecisionRecommendation", "choose", "recommend_precision",
           "step_estimates")
