# Copied verbatim from https://github.com/google/flax/blob/18f8f311c275d57f46d95e41b15aa97b454754c0/docs_nnx/migrating/linen_to_nnx.rst#L341-L358 (the NNX side of the "Using multiple methods" codediff, dedented; only import lines added).
from flax import nnx  # jaxmp: import path


class AutoEncoder(nnx.Module):



  def __init__(self, in_dim: int, embed_dim: int, output_dim: int, rngs):
    self.encoder = nnx.Linear(in_dim, embed_dim, rngs=rngs)
    self.decoder = nnx.Linear(embed_dim, output_dim, rngs=rngs)

  def encode(self, x):
    return self.encoder(x)

  def decode(self, x):
    return self.decoder(x)

  def __call__(self, x):
    x = self.encode(x)
    x = self.decode(x)
    return x
