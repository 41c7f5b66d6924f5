"""Per-module precision: which module computes in which dtype, and which uses fp8.

A :class:`PolicyRules` is a default :class:`~jaxmp.Policy` plus an ordered list of
:class:`Rule` overrides. Each module of a model is resolved by its class and its
'/'-joined path (``"Block_0/Attention_0/query"``; the root module's path is ``""``):
the first rule that matches wins, and a module no rule matches uses the default.

Normalization layers (a layer whose class, or a class it derives from, is named
``...Norm`` or ``...Normalization``: Flax's BatchNorm, LayerNorm, RMSNorm, GroupNorm,
InstanceNorm, linen and NNX, and a model's own, such as a published model's
``RMSNorm``) compute in float32 unless a rule says otherwise, because their mean and
variance lose too much in half precision. They store params in the default param dtype
and hand their output back in the caller's compute dtype.

Inside every module, the ops on the float32 op list (:mod:`jaxmp._src.float32_ops`:
softmax, log-softmax, logsumexp by default) compute in float32; ``float32_ops=`` on
:class:`PolicyRules` sets the list for the whole model, and on a :class:`Rule` for the
modules it matches (``()`` turns it off).

The policy governs: while a module runs under a wrapper, its own computation-dtype
field (``dtype`` on Flax layers, whatever the model's config set it to) is its
resolved compute dtype, so a published model whose config says ``dtype=float32``
computes in the policy's dtype. ``PolicyRules(module_dtypes="model")`` lets the
model's own dtype fields win instead.

An override is local: a module a rule matches hands its output back in the dtype of
the module that called it, unless the rule names an output dtype. A rule matches the
modules it matches, not their children: match a subtree with a regex such as
``r"encoder(/.*)?"``.

Example:
  >>> import flax.linen as nn
  >>> rules = jaxmp.PolicyRules("params=float32,compute=bfloat16,output=float32", [
  ...     jaxmp.Rule(r".*/head", "float32"),
  ... ])
  >>> print(rules.resolve("Block_0/head", nn.Dense).policy)
  params=float32,compute=float32,output=float32
  >>> print(rules.resolve("Block_0/LayerNorm_0", nn.LayerNorm).policy)
  params=float32,compute=float32,output=float32
  >>> print(rules.resolve("Block_0/Dense_0", nn.Dense).policy)
  params=float32,compute=bfloat16,output=float32
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxmp._src import checks
from jaxmp._src import dtypes as dtypes_lib
from jaxmp._src import float32_ops as float32_ops_lib
from jaxmp._src import policy as policy_lib
from jaxmp._src.fp8 import ops as fp8_ops
from jaxmp._src.fp8 import recipes as recipes_lib

_NORMALIZATION_NAME = re.compile(r".*(Norm|Normalization)")


def is_normalization(module_type: type) -> bool:
  """Whether ``module_type`` is a normalization layer (see the module docstring).

  By name, with no list of any framework's classes: the class or a class it derives
  from is named ``...Norm`` or ``...Normalization``. Flax's own (``BatchNorm``,
  ``LayerNorm``, ``RMSNorm``, ``GroupNorm``, ``InstanceNorm``, linen and NNX) are so
  named, and so are their subclasses' bases.

  Example:
    >>> from jaxmp._src import rules
    >>> class Scaled(type("RMSNorm", (), {})): pass
    >>> rules.is_normalization(Scaled), rules.is_normalization(int)
    (True, False)
  """
  return any(_NORMALIZATION_NAME.fullmatch(cls.__name__) is not None
             for cls in module_type.__mro__)


MODULE_DTYPES = ("policy", "model")
"""Who decides a module's computation dtype field: the resolved policy, or the model."""

Match = type | tuple | str

_OUTPUT_KEY = re.compile(r"(^|,)\s*(o|output)\s*=")


def _check_attention_window(rule: Any) -> None:
  """A Rule's ``attention_window``: None, or a positive int with causal attention."""
  window = rule.attention_window
  if window is None:
    return
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
    raise TypeError(f"Rule({rule.match!r}) attention_window must be a positive int or None, "
                    f"got {window!r} of type {type(window).__name__}.")
  if window < 1:
    raise ValueError(f"Rule({rule.match!r}) attention_window must be a positive int (the "
                     f"keys each query attends to, itself included), got {window}.")
  if not rule.causal_attention:
    raise ValueError(f"Rule({rule.match!r}) attention_window={window} needs "
                     "causal_attention=True: the window is placed on the causal mask.")
  object.__setattr__(rule, "attention_window", int(window))


def _check_match(match: Any) -> re.Pattern | None:
  """Validates a rule's match; returns the compiled regex for a string match."""
  if isinstance(match, str):
    try:
      return re.compile(match)
    except re.error as e:
      raise ValueError(f"Rule match {match!r} is not a valid regular expression: {e}.") from None
  classes = match if isinstance(match, tuple) else (match,)
  if classes and all(isinstance(c, type) for c in classes):
    return None
  raise TypeError(
      f"Rule match must be a module class, a tuple of classes, or a regex string over the "
      f"'/'-joined module path; got {match!r} of type {type(match).__name__}.")


def _check_fp8(recipe: Any) -> None:
  if recipe is not None:
    fp8_ops.check(recipe, where="Rule fp8")


def _named_output(policy: Any, parsed: policy_lib.Policy) -> np.dtype | None:
  """The output dtype a rule's policy names, or None where it only follows compute."""
  if isinstance(policy, str):
    return parsed.output_dtype if _OUTPUT_KEY.search(policy) else None
  return parsed.output_dtype if parsed.output_dtype != parsed.compute_dtype else None


@dataclasses.dataclass(frozen=True, init=False)
class Rule:
  """Gives the modules that ``match`` a policy, an fp8 recipe, or both.

  Args:
    match: a module class or tuple of classes (matched with ``isinstance``), or a regex
      ``re.fullmatch``-ed against the module's '/'-joined path.
    policy: the policy for matched modules (anything :func:`jaxmp.get_policy`
      accepts); ``None`` keeps the default policy.
    fp8: an fp8 recipe (``jaxmp.fp8.DelayedScaling()``, ``jaxmp.fp8.CurrentScaling()``,
      ``RowwiseScaling()``, ``BlockScaling()``, ``MXScaling()``, or a ``GemmRecipes``)
      that turns the matched matmul layers' dot products into fp8; ``None`` for none.
    output_dtype: the dtype matched modules hand their output back in. By default an
      override is local: the output goes back in the caller's compute dtype. A policy
      string with an explicit ``o=``/``output=`` key, or a Policy object whose output
      dtype differs from its compute dtype, names the output dtype too.
    float32_ops: the ops that compute in float32 inside matched modules, replacing
      the rules' list (``()`` for none, ``("softmax",)``...); ``None`` keeps it.
    causal_attention: declares that the matched attention layers (those with an
      ``attention_fn``) attend causally, each query to itself and the keys before it:
      they compute with the fused attention of ``PolicyRules(fused_attention=True)``
      in its causal mode (cuDNN's CAUSAL mask on GPUs, which skips the blocks above
      the diagonal), and the mask the layer is handed is not read. Right padding is
      harmless (a real token never attends to the padding after it; the loss ignores
      padded positions); left padding and packed sequences are not: keep the mask
      for those. A call whose query and keys differ in length (decoding with a cache)
      uses the mask it is given. The declaration is about self-attention: a call
      given keys or values from another sequence (an ``inputs_k``, ``inputs_v`` or
      ``inputs_kv`` other than the very ``inputs_q`` object, as a decoder's
      encoder-decoder attention) computes as the layer does, with its mask, and
      warns naming the layer; match only the self-attention layers (a path regex) to
      leave those out. ``True`` or ``False`` (a NumPy bool too); default ``False``.
    attention_window: with ``causal_attention=True``, a sliding window: each query
      attends to itself and the ``attention_window - 1`` keys before it (Mistral's
      ``sliding_window``; cuDNN's causal sliding-window mode on GPUs, which skips the
      blocks outside the band). A positive int, or ``None`` (default) for the whole
      causal prefix. A call whose query and keys differ in length (decoding with a
      cache) cannot place the window: the layer's mask runs, and a warning says so.
      Like the causal declaration, it applies to self-attention calls only.
    padded_attention: declares that the masks the matched attention layers are handed
      are right-padding masks, the same for every head: each sequence's real tokens
      first, then padding, as ``nn.make_attention_mask(tokens > 0, tokens > 0)`` makes
      them; combined with a causal mask only where ``causal_attention=True`` too (the
      padding mode is causal only then). The fused attention reads each sequence's
      query and key lengths from the mask and computes with them (cuDNN's padding mode
      on GPUs), no dense mask reaching the kernel. Every real query's output is the
      masked attention's; the padding queries' outputs are not. Left padding, packed
      sequences and masks that differ by head are not right padding: keep the mask
      for those. A mask the wrapper can read (a concrete array, outside ``jit``) is
      checked and refused with a ``ValueError`` if it is not of this form; under
      ``jit`` it cannot be read ahead, and the declaration is trusted. A call whose
      query and keys differ in length (decoding with a cache) uses the mask.
      ``True`` or ``False`` (a NumPy bool too); default ``False``.

  Raises:
    TypeError: for a match that is neither a class nor a string, a bad fp8 recipe, or
      ``float32_ops`` that is not a tuple of names.
    ValueError: for an invalid regex, a policy that does not parse, or an unknown op.

  Example:
    >>> import flax.linen as nn
    >>> rule = jaxmp.Rule(nn.LayerNorm, "float32")
    >>> rule.matches("Block_0/LayerNorm_0", nn.LayerNorm)
    True
    >>> jaxmp.Rule(r"decoder/.*", "c=f32,o=bf16").output_dtype
    dtype(bfloat16)
  """

  match: Match
  policy: policy_lib.Policy | None
  fp8: recipes_lib.Recipe | None
  output_dtype: np.dtype | None
  float32_ops: frozenset | None
  causal_attention: bool
  attention_window: int | None
  padded_attention: bool
  _regex: re.Pattern | None = dataclasses.field(
      default=None, init=False, repr=False, compare=False)

  # The constructor takes what users write (a policy string, a dtype name, a tuple of
  # op names); the fields hold the parsed values (``dataclasses.replace`` calls this too).
  def __init__(self, match: Match, policy: policy_lib.PolicyLike | None = None,
               fp8: recipes_lib.Recipe | None = None,
               output_dtype: dtypes_lib.DTypeLike | None = None,
               float32_ops: Collection[str] | None = None, causal_attention: bool = False,
               attention_window: int | None = None, padded_attention: bool = False):
    for name, value in (("match", match), ("policy", policy), ("fp8", fp8),
                        ("output_dtype", output_dtype), ("float32_ops", float32_ops),
                        ("causal_attention", causal_attention),
                        ("attention_window", attention_window),
                        ("padded_attention", padded_attention)):
      object.__setattr__(self, name, value)
    self.__post_init__()

  def __post_init__(self):
    object.__setattr__(self, "_regex", _check_match(self.match))
    _check_fp8(self.fp8)
    for name in ("causal_attention", "padded_attention"):
      object.__setattr__(self, name,
                         checks.flag(getattr(self, name), name, where=f"Rule({self.match!r})"))
    _check_attention_window(self)
    if self.float32_ops is not None:
      object.__setattr__(self, "float32_ops",
                         float32_ops_lib.check(self.float32_ops, f"Rule({self.match!r})"))
    explicit_output = (None if self.output_dtype is None
                       else dtypes_lib.parse_dtype(self.output_dtype))
    if self.policy is None:
      object.__setattr__(self, "output_dtype", explicit_output)
      return
    parsed = policy_lib.get_policy(self.policy)
    named = _named_output(self.policy, parsed)
    if explicit_output is not None and named is not None and named != explicit_output:
      raise ValueError(
          f"Rule for {self.match!r} names two output dtypes: {named.name} in its policy "
          f"and output_dtype={explicit_output.name}.")
    object.__setattr__(self, "policy", parsed)
    object.__setattr__(self, "output_dtype", explicit_output or named)

  def matches(self, path: str, module_type: type) -> bool:
    """Whether this rule applies to a module of ``module_type`` at ``path``."""
    if self._regex is not None:
      return self._regex.fullmatch(path) is not None
    # No regex: the match is a class or a tuple of classes.
    return not isinstance(self.match, str) and issubclass(module_type, self.match)

  def describe(self) -> str:
    """A short human-readable form of the match, for tables and warnings."""
    if isinstance(self.match, str):
      return repr(self.match)
    classes = self.match if isinstance(self.match, tuple) else (self.match,)
    return "|".join(c.__name__ for c in classes)


@dataclasses.dataclass(frozen=True)
class ModulePrecision:
  """How one module computes, as resolved by :meth:`jaxmp.PolicyRules.resolve`.

  Attributes:
    policy: the module's policy: params stored in ``policy.param_dtype``, inputs and
      params cast to ``policy.compute_dtype``.
    output_dtype: the dtype the module's output is handed back in, or ``None`` for
      "the caller's compute dtype" (the default for every module).
    fp8: the fp8 recipe of the module's matmuls, or ``None``.
    rule: the rule that matched, or ``None`` where the default applies.
    float32_ops: the ops that compute in float32 inside the module.
    causal_attention: whether the module's attention is declared causal
      (:class:`Rule`'s ``causal_attention``).
    attention_window: the declared sliding window (:class:`Rule`'s
      ``attention_window``), or ``None``.
    padded_attention: whether the module's attention masks are declared right-padding
      masks (:class:`Rule`'s ``padded_attention``).
  """

  policy: policy_lib.Policy
  output_dtype: np.dtype | None
  fp8: Any
  rule: Rule | None
  float32_ops: frozenset = frozenset(float32_ops_lib.DEFAULT)
  causal_attention: bool = False
  attention_window: int | None = None
  padded_attention: bool = False


def _normalization_policy(default: policy_lib.Policy) -> policy_lib.Policy:
  if default.compute_dtype.itemsize >= 4:
    return default
  return default.with_compute_dtype(np.float32)


@dataclasses.dataclass(frozen=True, init=False)
class PolicyRules:
  """A default policy plus ordered per-module overrides; the first matching rule wins.

  Args:
    default: the policy of every module no rule matches; its output dtype is the dtype
      of the model's output.
    rules: :class:`Rule` objects, tried in order.
    float32_normalization: whether normalization layers compute in float32 when no
      rule matches them (default ``True``).
    float32_ops: the ops that compute in float32 inside every module a rule does not
      give its own list (default ``jaxmp._src.float32_ops.DEFAULT``: softmax,
      log_softmax, logsumexp; ``()`` for none). An op jaxmp cannot intercept
      (``exp``, ... ``jaxmp._src.float32_ops.UNINTERCEPTABLE``) is accepted, as in
      a :class:`Rule`, and warned about with the paths it would apply to when the
      model first runs.
    module_dtypes: ``"policy"`` (default): a module's own computation-dtype field
      (``dtype``) is its resolved compute dtype while it runs; ``"model"``: the fields
      keep what the model set, and a field that says float32 computes in float32.
    fused_attention: whether Flax attention layers (those with an ``attention_fn``)
      compute attention with ``jax.nn.dot_product_attention``: cuDNN's fused kernel
      on GPUs, XLA's elsewhere (``jaxmp._src.attention``). Default ``False``.
    trace_nonfinite: record, inside the compiled step, whether each module call's
      output and the gradient flowing back into it held inf or NaN, and their absolute
      max (``jaxmp._src.nonfinite``; the wrappers then carry a probe and jaxmp's
      ``value_and_grad`` returns ``Gradients.nonfinite``). Default ``False``: the
      compiled step is exactly what it is without tracing.

  Frozen and hashable, so it can be a static argument of ``jax.jit``.

  Example:
    >>> import flax.linen as nn
    >>> rules = jaxmp.PolicyRules("mixed_bfloat16", [jaxmp.Rule(nn.Dense, fp8=None)])
    >>> print(rules.default)
    params=float32,compute=bfloat16,output=float32
  """

  default: policy_lib.Policy
  rules: tuple[Rule, ...]
  float32_normalization: bool
  float32_ops: frozenset
  module_dtypes: str
  fused_attention: bool
  trace_nonfinite: bool

  # As for Rule: the constructor takes a policy spec and any sequence of rules; the
  # fields hold the parsed policy and a tuple.
  def __init__(self, default: policy_lib.PolicyLike, rules: Sequence[Rule] = (),
               float32_normalization: bool = True,
               float32_ops: Collection[str] = frozenset(float32_ops_lib.DEFAULT),
               module_dtypes: str = "policy", fused_attention: bool = False,
               trace_nonfinite: bool = False):
    for name, value in (("default", default), ("rules", rules),
                        ("float32_normalization", float32_normalization),
                        ("float32_ops", float32_ops), ("module_dtypes", module_dtypes),
                        ("fused_attention", fused_attention),
                        ("trace_nonfinite", trace_nonfinite)):
      object.__setattr__(self, name, value)
    self.__post_init__()

  def __post_init__(self):
    object.__setattr__(self, "default", policy_lib.get_policy(self.default))
    for flag in ("float32_normalization", "fused_attention", "trace_nonfinite"):
      object.__setattr__(self, flag, checks.flag(getattr(self, flag), flag, where="PolicyRules"))
    object.__setattr__(self, "float32_ops",
                       float32_ops_lib.check(self.float32_ops, "PolicyRules"))
    if not isinstance(self.module_dtypes, str):
      raise TypeError(f"PolicyRules module_dtypes must be one of {MODULE_DTYPES}, got "
                      f"{self.module_dtypes!r} of type {type(self.module_dtypes).__name__}.")
    if self.module_dtypes not in MODULE_DTYPES:
      raise ValueError(f"PolicyRules module_dtypes must be one of {MODULE_DTYPES}, got "
                       f"{self.module_dtypes!r}.")
    if isinstance(self.rules, (Rule, str)) or not isinstance(self.rules, Sequence):
      raise TypeError(
          f"PolicyRules rules must be a sequence of jaxmp.Rule, got {self.rules!r}.")
    for rule in self.rules:
      if not isinstance(rule, Rule):
        raise TypeError(
            f"PolicyRules rules must be jaxmp.Rule objects, got {rule!r} of type "
            f"{type(rule).__name__}.")
    object.__setattr__(self, "rules", tuple(self.rules))

  def resolve(self, path: str, module_type: type) -> ModulePrecision:
    """The precision of a module of ``module_type`` at ``path`` ('/'-joined)."""
    for rule in self.rules:
      if rule.matches(path, module_type):
        policy = self.default if rule.policy is None else rule.policy
        ops = self.float32_ops if rule.float32_ops is None else rule.float32_ops
        return ModulePrecision(policy, rule.output_dtype, rule.fp8, rule, ops,
                               rule.causal_attention, rule.attention_window,
                               rule.padded_attention)
    if self.float32_normalization and is_normalization(module_type):
      return ModulePrecision(_normalization_policy(self.default), None, None, None,
                             self.float32_ops)
    return ModulePrecision(self.default, None, None, None, self.float32_ops)


PolicyOrRules = PolicyRules | policy_lib.PolicyLike


def check_rules(rules: Any, where: str) -> PolicyRules:
  """``rules`` if it is :class:`PolicyRules`.

  Raises:
    TypeError: for anything else (a policy string too: where rules replace rules,
      nothing is guessed).
  """
  if not isinstance(rules, PolicyRules):
    raise TypeError(f"{where}: rules must be jaxmp.PolicyRules, got {rules!r} of type "
                    f"{type(rules).__name__}.")
  return rules


def as_rules(policy_or_rules: PolicyOrRules) -> PolicyRules:
  """Turns a policy (any form :func:`jaxmp.get_policy` takes) or rules into PolicyRules.

  Raises:
    TypeError: for anything else.
  """
  if isinstance(policy_or_rules, PolicyRules):
    return policy_or_rules
  if isinstance(policy_or_rules, Rule) or (
      isinstance(policy_or_rules, (list, tuple)) and policy_or_rules):
    raise TypeError(
        f"Expected a policy or jaxmp.PolicyRules, got {policy_or_rules!r}; wrap rules as "
        f"jaxmp.PolicyRules(default_policy, rules).")
  return PolicyRules(policy_lib.get_policy(policy_or_rules))


__all__ = (
    "MODULE_DTYPES",
    "ModulePrecision",
    "PolicyOrRules",
    "PolicyRules",
    "Rule",
    "as_rules",
    "check_rules",
    "is_normalization",
)
