"""Optax transforms that save optimizer memory; re-exported by :mod:`jaxmp.optim`."""
