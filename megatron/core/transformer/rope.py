"""Rotary position embeddings (rotate-half convention, as Llama; or interleaved pairs with
--rotary-interleaved), with Llama 3.1 scaling (--use-rope-scaling) or, for multi-latent attention,
YaRN (--rope-type yarn: Megatron-Core's YarnRotaryEmbedding, DeepSeek-V3's rope_scaling).

The rotation itself is `fusions.rotary` (or `fusions.rotary_interleaved`), applied by the
attention module."""
import math

import torch


def inverse_frequencies(config) -> torch.Tensor:
    # Multi-latent attention rotates a part of its own per head (--qk-pos-emb-head-dim).
    rotary_dim = (config.qk_pos_emb_head_dim if config.multi_latent_attention
                  else int(config.kv_channels * config.rotary_percent))
    inv_freq = 1.0 / (config.rotary_base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if uses_yarn(config):
        return _yarn_scaling(rotary_dim, config)
    if config.use_rope_scaling:
        inv_freq = _llama31_scaling(inv_freq, config)
    return inv_freq.float()


def uses_yarn(config) -> bool:
    return config.multi_latent_attention and config.rope_type == "yarn"


def _llama31_scaling(inv_freq: torch.Tensor, config) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated."""
    factor, low, high = config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    original = config.rope_original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength, high_freq_wavelength = original / low, original / high
    smooth = (original / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    middle = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(middle, interpolated, scaled)


def _yarn_scaling(rotary_dim: int, config) -> torch.Tensor:
    """YaRN's frequencies, in fp32 as Megatron-Core and transformers compute them: frequency i is
    extrapolated (kept) for the channels below the band `yarn_band`, interpolated (divided by the
    factor) above it, and mixed linearly across it."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    kept = 1.0 / config.rotary_base ** exponents
    interpolated = 1.0 / (config.rotary_scaling_factor * config.rotary_base ** exponents)
    low, high = yarn_band(rotary_dim, config)
    if low == high:
        high += 0.001  # a band of no width: a step (as Megatron-Core)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return interpolated * ramp + kept * (1 - ramp)  # ramp 0: kept (fast), 1: interpolated (slow)


def yarn_band(rotary_dim: int, config) -> tuple:
    """(low, high): the frequency indices between which YaRN interpolates. Frequency i turns
    L / (2 pi base^(2i/d)) times over the original context L; `low` is where that count falls to
    --yarn-beta-fast, `high` where it falls to --yarn-beta-slow (rounded outwards to whole indices
    unless --no-yarn-correction-range-round-to-int), both clamped to [0, d - 1]."""
    def index_turning(turns: float) -> float:
        original, base = config.yarn_original_max_position_embeddings, config.rotary_base
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = index_turning(config.yarn_beta_fast), index_turning(config.yarn_beta_slow)
    if config.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_concentration(config) -> float:
    """The factor YaRN multiplies cos and sin by (so the rotated channels of queries and keys):
    mscale(factor, --mscale) / mscale(factor, --mscale-all-dim); 1 without YaRN."""
    if not uses_yarn(config):
        return 1.0
    factor = config.rotary_scaling_factor
    return _yarn_mscale(factor, config.mscale) / _yarn_mscale(factor, config.mscale_all_dim)


def yarn_softmax_correction(config) -> float:
    """What multi-latent attention multiplies its softmax scale by under YaRN:
    mscale(factor, --mscale-all-dim)^2 (Megatron-Core's MLASelfAttention.softmax_scale and
    DeepSeek-V3's); 1 without YaRN."""
    if not uses_yarn(config):
        return 1.0
    return _yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config, device):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", inverse_frequencies(config).to(device), persistent=False)
        self.interleaved = config.rotary_interleaved
        self.concentration = yarn_concentration(config)

    def reset_buffers(self) -> None:
        """Recomputes the frequencies where the buffer now lives (after a model built on the meta
        device is moved to a real one: its non-persistent buffers hold no values)."""
        self.inv_freq = inverse_frequencies(self.config).to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, s] -> (cos, sin), each [s, b, 1, rotary_dim] in fp32."""
        angles = position_ids.t().unsqueeze(-1).float() * self.inv_freq  # [s, b, rotary_dim/2]
        if self.interleaved:  # f0 f0 f1 f1 ...: channels 2i and 2i+1 share frequency i
            angles = angles.repeat_interleave(2, dim=-1).unsqueeze(2)
        else:                 # f0 f1 ... f0 f1 ...: channels i and i + rotary_dim/2 share frequency i
            angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)
        if self.concentration != 1.0:
            return angles.cos() * self.concentration, angles.sin() * self.concentration
        return angles.cos(), angles.sin()
