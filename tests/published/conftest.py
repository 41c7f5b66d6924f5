"""The copied published models are third-party code: pytest collects no doctests from them."""

collect_ignore_glob = ["flax_*", "bonsai_*", "t5x_*"]
