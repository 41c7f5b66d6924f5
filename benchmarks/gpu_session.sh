#!/usr/bin/env bash
# One prepared run on a machine with a GPU (benchmarks/gpu_session.py says what it runs):
# the GPU's tests, the measured tables, the block GEMM and quantize benchmarks, in 9
# minutes, results under benchmarks/results/ (or --out DIR). Every session lent a GPU
# runs it first; CONTRIBUTING.md ("A machine with a GPU") gives the device command.
#
#   benchmarks/gpu_session.sh [--out DIR] [--commit SHA] [--stages tests,llama,...]
#   benchmarks/gpu_session.sh --dry-run    # every stage on the CPU at tiny sizes
#
# The interpreter is $JAXMP_PYTHON, else python3 (a GPU machine's image: its JAX with
# the CUDA plugin). A Python package it lacks and jaxmp needs (jmp) can come as wheels
# in .whl/ at the repository's root (git ignores it): they are installed into a
# temporary folder, nothing is downloaded.
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
python="${JAXMP_PYTHON:-python3}"
if ! "$python" -c "import jax, flax, optax, chex, jmp" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    site="$(mktemp -d)"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$site" .whl/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if ! "$python" -c "import jax, flax, optax, chex, jmp"; then
    echo "gpu_session.sh: $python lacks a package jaxmp needs (above); put its wheel in .whl/" >&2
    exit 1
  fi
fi
export PYTHONUNBUFFERED=1
exec "$python" benchmarks/gpu_session.py "$@"
