"""jaxmp implementation; the public API is re-exported from the jaxmp package."""
