"""Shared pytest set-up: names the docstring examples use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
  doctest_namespace.update(jax=jax, jnp=jnp, np=np, jaxmp=jaxmp)
