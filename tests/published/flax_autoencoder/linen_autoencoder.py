# Copied verbatim from https://github.com/google/flax/blob/18f8f311c275d57f46d95e41b15aa97b454754c0/docs_nnx/migrating/linen_to_nnx.rst#L317-L334 (the Linen side of the "Using multiple methods" codediff, dedented; only import lines added).
from flax import linen as nn  # jaxmp: import path


class AutoEncoder(nn.Module):
  embed_dim: int
  output_dim: int

  def setup(self):
    self.encoder = nn.Dense(self.embed_dim)
    self.decoder = nn.Dense(self.output_dim)

  def encode(self, x):
    return self.encoder(x)

  def decode(self, x):
    return self.decoder(x)

  def __call__(self, x):
    x = self.encode(x)
    x = self.decode(x)
    return x
