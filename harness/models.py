"""Model shapes the tests and benchmarks use, taken from the models' published configs.

One place, so that the CPU tier, the GPU tier and the benchmark test the same shapes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MHAShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class MLAShape:
    name: str
    layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class GDNShape:
    """A gated-delta-net hybrid (Qwen3.5 / Qwen3-Next): linear layers plus full attention."""

    name: str
    layers: int
    full_attention_interval: int
    kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @property
    def full_attention_layers(self) -> list[int]:
        step = self.full_attention_interval
        return [i for i in range(self.layers) if (i + 1) % step == 0]

    @property
    def linear_layers(self) -> list[int]:
        full = set(self.full_attention_layers)
        return [i for i in range(self.layers) if i not in full]

    def state_shape_kwargs(self, tp_size: int = 1) -> dict:
        """Mamba2StateShape.create arguments, as SGLang's Qwen3NextConfig derives them."""
        return dict(
            tp_world_size=tp_size,
            intermediate_size=self.linear_value_head_dim * self.linear_num_value_heads,
            n_groups=self.linear_num_key_heads,
            num_heads=self.linear_num_value_heads,
            head_dim=self.linear_value_head_dim,
            state_size=self.linear_key_head_dim,
            conv_kernel=self.linear_conv_kernel_dim,
        )

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        key_dim = self.linear_key_head_dim * self.linear_num_key_heads
        value_dim = self.linear_value_head_dim * self.linear_num_value_heads
        return (2 * key_dim + value_dim, self.linear_conv_kernel_dim - 1)

    @property
    def temporal_state_shape(self) -> tuple[int, int, int]:
        return (self.linear_num_value_heads, self.linear_value_head_dim, self.linear_key_head_dim)


QWEN25_7B = MHAShape("Qwen2.5-7B", layers=28, kv_heads=4, head_dim=128)
DEEPSEEK_V2_LITE = MLAShape("DeepSeek-V2-Lite", layers=27, kv_lora_rank=512, qk_rope_head_dim=64)
QWEN35_4B = GDNShape(
    "Qwen3.5-4B", layers=32, full_attention_interval=4, kv_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
)
QWEN3_NEXT_80B = GDNShape(
    "Qwen3-Next-80B-A3B", layers=48, full_attention_interval=4, kv_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
)
# gpt-oss-20b: 24 layers alternating sliding-window (128 tokens) and full attention, 8 KV heads x 64.
GPT_OSS_20B = MHAShape("gpt-oss-20b", layers=24, kv_heads=8, head_dim=64)
