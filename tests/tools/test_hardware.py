"""jaxmp.tools hardware: device capabilities and the recommended set-up per device."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

F32, BF16, F16 = np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float16")


def _gpu(cc, kind="NVIDIA GPU"):
  return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc)


TPU = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
TPU_V6E = types.SimpleNamespace(platform="tpu", device_kind="TPU v6 lite")
TPU_V7 = types.SimpleNamespace(platform="tpu", device_kind="TPU7x")
CPU = types.SimpleNamespace(platform="cpu", device_kind="cpu")
ROCM = types.SimpleNamespace(platform="gpu", device_kind="AMD Instinct MI300X")
OTHER = types.SimpleNamespace(platform="METAL", device_kind="Apple M2")

# device, (bf16, fp16, fp8), compute dtype, loss scale class, fp8 suggested
CASES = [
    (TPU, (True, False, False), BF16, jaxmp.NoOpLossScale, False),
    # fp8 runs at the bfloat16 rate on v5e/v5p/v6e, about twice it on v7; yet no whole
    # train step compiled for v7 is estimated faster in fp8: not suggested there.
    (TPU_V6E, (True, False, False), BF16, jaxmp.NoOpLossScale, False),
    (TPU_V7, (True, False, True), BF16, jaxmp.NoOpLossScale, False),
    (_gpu("9.0", "NVIDIA H100 80GB HBM3"), (True, True, True), BF16, jaxmp.NoOpLossScale, True),
    (_gpu("8.9", "NVIDIA L4"), (True, True, True), BF16, jaxmp.NoOpLossScale, True),
    (_gpu("10.0"), (True, True, True), BF16, jaxmp.NoOpLossScale, True),
    (_gpu("8.6", "NVIDIA RTX 3090"), (True, True, False), BF16, jaxmp.NoOpLossScale, False),
    (_gpu("8.0", "NVIDIA A100"), (True, True, False), BF16, jaxmp.NoOpLossScale, False),
    (_gpu("7.5", "Tesla T4"), (False, True, False), F16, jaxmp.DynamicLossScale, False),
    (_gpu("7.0", "Tesla V100"), (False, True, False), F16, jaxmp.DynamicLossScale, False),
    (_gpu("6.1", "GTX 1080"), (False, False, False), F16, jaxmp.DynamicLossScale, False),
    (ROCM, (True, True, False), BF16, jaxmp.NoOpLossScale, False),
    (CPU, (False, False, False), F32, jaxmp.NoOpLossScale, False),
    (OTHER, (False, False, False), F32, jaxmp.NoOpLossScale, False),
]


@pytest.mark.parametrize("device, supports, compute, loss_scale, fp8", CASES,
                         ids=[c[0].device_kind for c in CASES])
def test_capabilities_and_recommendation(device, supports, compute, loss_scale, fp8):
  caps = jaxmp.tools.device_capabilities(device)
  assert (caps.supports_bf16, caps.supports_fp16, caps.supports_fp8) == supports
  assert caps.platform == device.platform and caps.device_kind == device.device_kind
  recommended = jaxmp.tools.recommended_policy(device)
  assert recommended.policy == jaxmp.Policy("float32", compute, "float32")
  assert type(recommended.loss_scale) is loss_scale
  assert (recommended.fp8 is not None) == fp8
  if fp8:
    assert isinstance(recommended.fp8, jaxmp.fp8.DelayedScaling)
  assert recommended.device == caps
  # Consistent with half_dtype wherever a 16-bit dtype is recommended.
  assert caps.half_dtype == jaxmp.half_dtype(device)
  if compute != F32:
    assert compute == jaxmp.half_dtype(device)


def test_compute_capability_parsing():
  assert jaxmp.tools.device_capabilities(_gpu("8.9")).compute_capability == (8, 9)
  assert jaxmp.tools.device_capabilities(_gpu(9.0)).compute_capability == (9, 0)
  assert jaxmp.tools.device_capabilities(_gpu("12")).compute_capability == (12, 0)
  assert jaxmp.tools.device_capabilities(ROCM).compute_capability is None
  assert jaxmp.tools.device_capabilities(TPU).compute_capability is None


def test_explanations():
  v100 = jaxmp.tools.recommended_policy(_gpu("7.0", "Tesla V100"))
  assert "dynamic loss scaling" in v100.reason
  assert "Tesla V100" in v100.reason
  pascal = jaxmp.tools.recommended_policy(_gpu("6.1", "GTX 1080"))
  assert "no float16 tensor cores either" in pascal.reason
  h100 = jaxmp.tools.recommended_policy(_gpu("9.0", "NVIDIA H100"))
  assert "fp8" in h100.reason and "no loss scale is needed" in h100.reason
  v7 = jaxmp.tools.recommended_policy(TPU_V7).reason
  assert "about twice the bfloat16 rate" in v7 and "0.86x" in v7 and "0.62x" in v7
  assert "recommend_precision" in v7 and "fp8 is not suggested" in v7
  cpu = jaxmp.tools.recommended_policy(CPU)
  assert "computes half precision through float32" in cpu.reason
  assert "float32 is faster" in cpu.reason
  caps = jaxmp.tools.device_capabilities(_gpu("8.6", "NVIDIA RTX 3090"))
  assert str(caps).splitlines()[0] == (
      "gpu (NVIDIA RTX 3090, compute capability 8.6): bfloat16 yes, float16 yes, fp8 no")
  assert "fp8 tensor cores need >= 8.9" in caps.explanation
  lines = str(h100).splitlines()
  assert lines[0] == "policy:     params=float32,compute=bfloat16,output=float32"
  assert lines[1].startswith("loss scale: NoOpLossScale")
  assert lines[2].startswith("fp8:        DelayedScaling(")
  assert lines[4].startswith("why:        NVIDIA H100 computes bfloat16 natively")


def test_default_device_is_the_first_local_device():
  device = jax.local_devices()[0]
  caps = jaxmp.tools.device_capabilities()
  assert caps == jaxmp.tools.device_capabilities(device)
  assert caps.platform == device.platform
  assert caps.half_dtype == jaxmp.half_dtype()
  assert jaxmp.tools.recommended_policy().policy == jaxmp.tools.recommended_policy(device).policy


def test_recommended_loss_scales_are_fresh_and_usable():
  a = jaxmp.tools.recommended_policy(_gpu("7.0"))
  tx = jaxmp.loss_scaling(optax.sgd(1.0), a.loss_scale)
  assert float(jaxmp.get_loss_scale(tx.init(jnp.ones(1))).loss_scale) == 2.0**15


@pytest.mark.parametrize("device, error, text", [
    ("cpu", TypeError, "got 'cpu' of type str"),
    (object(), TypeError, "of type object"),
    (types.SimpleNamespace(platform=3), TypeError, "namespace(platform=3)"),
    (_gpu("eight"), ValueError, "compute capability 'eight'"),
    (_gpu("8.x"), ValueError, "compute capability '8.x'"),
])
def test_bad_devices(device, error, text):
  for fun in (jaxmp.tools.device_capabilities, jaxmp.tools.recommended_policy):
    with pytest.raises(error, match=re.escape(text)):
      fun(device)
