"""Rotary position embeddings (rotate-half convention, as Llama; or interleaved pairs with
--rotary-interleaved), with Llama 3.1 scaling.

The rotation itself is `fusions.rotary` (or `fusions.rotary_interleaved`), applied by the
attention module."""
import math

import torch


def inverse_frequencies(config) -> torch.Tensor:
    # Multi-latent attention rotates a part of its own per head (--qk-pos-emb-head-dim).
    rotary_dim = (config.qk_pos_emb_head_dim if config.multi_latent_attention
                  else int(config.kv_channels * config.rotary_percent))
    inv_freq = 1.0 / (config.rotary_base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if config.use_rope_scaling:
        inv_freq = _llama31_scaling(inv_freq, config)
    return inv_freq.float()


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


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config, device):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", inverse_frequencies(config).to(device), persistent=False)
        self.interleaved = config.rotary_interleaved

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
        return angles.cos(), angles.sin()
