# Copied verbatim from https://github.com/google/flax/blob/18f8f311c275d57f46d95e41b15aa97b454754c0/docs_nnx/examples/vit_training.md#L26-L28 and #L49-L230 (the imports cell and the model cell, without the cell's demo lines after the model).
import jax
import jax.numpy as jnp
from flax import nnx

from dataclasses import dataclass

from jax.sharding import PartitionSpec as P


@dataclass(slots=True, frozen=True)
class ShardingConfig:

    attn_qkvo_weight_ndh: P | None = None  # sharding for Q, K, V, Out weights
    mlp_weight_df: P | None = None
    mlp_weight_fd: P | None = None
    act_btd: P | None = None  # sharding of the activation (B, T, D)
    act_btf: P | None = None
    act_btnh: P | None = None
    act_bc: P | None = None  # sharding of the final logits

    fsdp_axis_name: str = "fsdp"

    @staticmethod
    def no_sharding():
        return ShardingConfig()

    @staticmethod
    def fsdp_sharding(fsdp_axis_name: str = "fsdp"):
        fsdp = fsdp_axis_name
        return ShardingConfig(
            attn_qkvo_weight_ndh=P(None, fsdp, None),
            mlp_weight_df=P(fsdp, None),
            mlp_weight_fd=P(None, fsdp),
            act_btd=P(fsdp, None, None),
            act_btf=P(fsdp, None, None),
            act_btnh=P(fsdp, None, None, None),
            act_bc=P(fsdp, None),
            fsdp_axis_name=fsdp_axis_name,
        )


@dataclass(slots=True, frozen=True)
class ModelConfig:
    num_classes: int = 1000
    in_channels: int = 3
    img_size: int = 224
    patch_size: int = 16
    num_layers: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    hidden_size: int = 768
    dropout_rate: float = 0.1
    sharding: ShardingConfig = ShardingConfig.no_sharding()
    use_bfloat16: bool = True


class VisionTransformer(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
    ):
        act_dtype = jnp.bfloat16 if config.use_bfloat16 else jnp.float32
        param_dtype = jnp.float32

        n_patches = (config.img_size // config.patch_size) ** 2
        self.patch_embeddings = nnx.Conv(
            config.in_channels,
            config.hidden_size,
            kernel_size=(config.patch_size, config.patch_size),
            strides=(config.patch_size, config.patch_size),
            padding="VALID",
            use_bias=True,
            dtype=act_dtype,  # activations dtype
            param_dtype=param_dtype,  # weights dtype
            rngs=rngs,
        )

        initializer = jax.nn.initializers.truncated_normal(stddev=0.02)
        self.position_embeddings = nnx.Param(
            initializer(rngs.params(), (1, n_patches + 1, config.hidden_size), param_dtype)
        ) # Shape `(1, n_patches +1, hidden_size`)
        self.dropout = nnx.Dropout(config.dropout_rate)

        self.cls_token = nnx.Param(jnp.zeros((1, 1, config.hidden_size), dtype=param_dtype))
        self.encoder = nnx.Sequential(*[
            TransformerEncoder(config, rngs=rngs) for i in range(config.num_layers)
        ])
        self.final_norm = nnx.LayerNorm(
            config.hidden_size, rngs=rngs, dtype=act_dtype, param_dtype=param_dtype
        )
        self.classifier = nnx.Linear(
            config.hidden_size, 
            config.num_classes, 
            rngs=rngs, 
            dtype=act_dtype, 
            param_dtype=param_dtype,
        )
        self.config = config

    def embed(self, x: jax.Array) -> jax.Array:
        patches = self.patch_embeddings(x, out_sharding=self.config.sharding.act_btd)
        batch_size = patches.shape[0]
        patches = patches.reshape(batch_size, -1, patches.shape[-1])
        cls_token = jnp.tile(self.cls_token.astype(x.dtype), (batch_size, 1, 1))
        if self.config.sharding.act_btd is not None:
            cls_token = jax.device_put(cls_token, device=self.config.sharding.act_btd)
        x = jnp.concat([cls_token, patches], axis=1)
        return x + self.position_embeddings.astype(x.dtype)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = self.embed(x)
        x = self.dropout(x, rngs=rngs)
        x = self.encoder(x, rngs=rngs)
        x = self.final_norm(x)
        x = x[:, 0]
        return self.classifier(x, out_sharding=self.config.sharding.act_bc)


class TransformerEncoder(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        act_dtype = jnp.bfloat16 if config.use_bfloat16 else jnp.float32
        param_dtype = jnp.float32

        self.norm1 = nnx.LayerNorm(
            config.hidden_size, rngs=rngs, dtype=act_dtype, param_dtype=param_dtype
        )
        self.mha = nnx.MultiHeadAttention(
            num_heads=config.num_heads,
            in_features=config.hidden_size,
            dropout_rate=config.dropout_rate,
            broadcast_dropout=False,
            decode=False,
            deterministic=False,
            kernel_metadata={"out_sharding": config.sharding.attn_qkvo_weight_ndh},
            out_kernel_metadata={"out_sharding": config.sharding.attn_qkvo_weight_ndh},
            keep_rngs=False,
            dtype=act_dtype, 
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(config.hidden_size, rngs=rngs)
        self.mlp_up_proj = nnx.Linear(
            config.hidden_size,
            config.mlp_dim,
            kernel_metadata={"out_sharding": config.sharding.mlp_weight_df},
            dtype=act_dtype, 
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.mlp_down_proj = nnx.Linear(
            config.mlp_dim,
            config.hidden_size,
            kernel_metadata={"out_sharding": config.sharding.mlp_weight_fd},
            dtype=act_dtype, 
            param_dtype=param_dtype,
            rngs=rngs
        )
        self.mlp_drop = nnx.Dropout(config.dropout_rate, rngs=rngs)
        self.config = config

    def attn(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        return self.mha(
            x,
            rngs=rngs,
            out_sharding=self.config.sharding.act_btd,
            qkv_sharding=self.config.sharding.act_btnh,
        )

    def mlp(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = self.mlp_up_proj(x, out_sharding=self.config.sharding.act_btf)
        x = nnx.gelu(x)
        x = self.mlp_drop(x, rngs=rngs)
        x = self.mlp_down_proj(x, out_sharding=self.config.sharding.act_btd)
        return self.mlp_drop(x, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = x + self.attn(self.norm1(x), rngs=rngs)
        x = x + self.mlp(self.norm2(x), rngs=rngs)
        return x
