"""fp8 by rule, step by step: what delayed scaling keeps and how it trains.

An MLP regression written in plain linen is trained with bfloat16 compute and its
hidden layers' matmuls in fp8 (E4M3 forward, E5M2 gradients, delayed scaling), with no
change to the model. The script prints the precision table (`jaxmp.tools.summary`), then the
first layer's fp8 state as training goes (each scale is the largest amax recorded in
the history of the *previous* steps divided by 448, the E4M3 maximum; the scale used
at a step does not yet know that step's amax), and finally the loss next to the same model trained
in bfloat16 without fp8.

Run: ``python examples/train_fp8.py`` (a few seconds on a CPU, where fp8 is emulated).
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxmp


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = nn.gelu(nn.Dense(256, name=f"hidden_{i}")(x))
    return nn.Dense(1, name="head")(x)


def make_rules(fp8: bool) -> jaxmp.PolicyRules:
  rules = [jaxmp.Rule("head")]  # first match wins: the output layer stays out of fp8
  if fp8:
    rules.append(jaxmp.Rule(nn.Dense, fp8=jaxmp.fp8.DelayedScaling(amax_history_length=16)))
  return jaxmp.PolicyRules("params=float32,compute=bfloat16,output=float32", rules)


def data(key, n: int):
  x = jax.random.normal(key, (n, 32))
  y = jnp.sin(x[:, :1] * 3.0) + 0.5 * x[:, 1:2] ** 2
  return x, y


def train(fp8: bool, args, verbose: bool):
  model = jaxmp.linen.mixed_precision(MLP(), make_rules(fp8))
  x, y = data(jax.random.key(1), args.batch)
  if verbose:
    print(jaxmp.tools.summary(model, None, x), "\n")
  state = jaxmp.linen.TrainState.create(
      apply_fn=model.apply, variables=model.init(jax.random.key(0), x),
      tx=jaxmp.loss_scaling(optax.adam(args.lr), jaxmp.NoOpLossScale()))

  @jax.jit
  def step(state, x, y):
    loss_fn = lambda variables: jnp.mean((state.apply_fn(variables, x) - y) ** 2)
    loss, grads = state.value_and_grad(loss_fn)()
    return state.apply_gradients(grads), loss

  for i in range(args.steps):
    x, y = data(jax.random.key(i + 2), args.batch)
    state, loss = step(state, x, y)
    if verbose and i in (0, 1, 2, 10, args.steps - 1):
      meta = state.fp8["hidden_0"]["Fp8DotGeneral_0"]
      history = meta["input_amax_history"]
      print(f"step {i:>3}  loss {float(loss):.4f}  input scale used {float(meta['input_scale'][0]):.3e}"
            f" (next: max of {int((history > 0).sum())} recorded amaxes {float(history.max()):.3f}"
            f" / 448 = {float(history.max()) / 448:.3e})"
            f"  kernel scale {float(meta['kernel_scale'][0]):.3e}"
            f"  grad scale {float(meta['output_grad_scale'][0]):.3e}")
  x, y = data(jax.random.key(10_000), 4096)
  return float(jnp.mean((model.apply(state.variables, x) - y) ** 2))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--lr", type=float, default=2e-3)
  args = parser.parse_args(argv)
  fp8_loss = train(True, args, verbose=True)
  bf16_loss = train(False, args, verbose=False)
  print(f"\nheld-out MSE: bfloat16 + fp8 {fp8_loss:.4f}, bfloat16 {bf16_loss:.4f} "
        f"({(fp8_loss - bf16_loss) / bf16_loss * 100:+.1f}%)")
  return fp8_loss, bf16_loss


if __name__ == "__main__":
  main()
