"""A clip's sound as LTX-2 reads it: a stereo waveform → log-mel spectrogram → audio latents.

diffusers ships LTX-2's audio VAE (mel spectrogram ↔ latents) and vocoder (mel → waveform) but
not the waveform → mel step, which the vocoder's training fixed: 16 kHz stereo, a Hann window of
1024 samples every `mel_hop_length` (160) samples, centred with reflection padding, magnitudes
(power 1) through `mel_bins` (64) Slaney-normalised Slaney-scale mel filters from 0 Hz to Nyquist,
then log(max(·, 1e-5)), as Lightricks' ltx-core audio processor computes it. The rate, hop and
bin count are read from the audio VAE's config; the filters come from transformers'
`mel_filter_bank`, the short-time transform from `torch.stft`.

How many audio latents a clip has is the pipeline's own rule: `round(seconds · rate / hop / 4)`
(`LTX2Pipeline.__call__`, `audio_num_frames`), four mel frames per latent.
"""

from __future__ import annotations

from typing import Any

import torch

N_FFT = 1024
"""Window and FFT size of the mel spectrogram (ltx-core's audio processor)."""
LOG_FLOOR = 1e-5
"""Magnitudes below this are clamped before the log (ltx-core's, and the vocoder's `MelSTFT`)."""


def latent_count(seconds: float, audio_config: Any, temporal_ratio: int = 4) -> int:
    """Audio latents for a clip of `seconds`, as `LTX2Pipeline` counts them."""
    per_second = audio_config.sample_rate / audio_config.mel_hop_length / float(temporal_ratio)
    return round(seconds * per_second)


def log_mel(waveform: torch.Tensor, audio_config: Any) -> torch.Tensor:
    """(B, 2, samples) at the VAE's rate → (B, 2, frames, mel_bins) log-mel, in float32."""
    from transformers.audio_utils import mel_filter_bank

    rate, hop, bins = audio_config.sample_rate, audio_config.mel_hop_length, audio_config.mel_bins
    filters = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1,
        num_mel_filters=bins,
        min_frequency=0.0,
        max_frequency=rate / 2.0,
        sampling_rate=rate,
        norm="slaney",
        mel_scale="slaney",
    )
    b, c, n = waveform.shape
    spec = torch.stft(
        waveform.reshape(b * c, n).float(),
        n_fft=N_FFT,
        hop_length=hop,
        win_length=N_FFT,
        window=torch.hann_window(N_FFT, device=waveform.device),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    ).abs()
    fb = torch.from_numpy(filters).to(spec.device, torch.float32)  # (freq, mels)
    mel = torch.einsum("fm,bft->btm", fb, spec)
    return torch.log(mel.clamp_min(LOG_FLOOR)).reshape(b, c, -1, bins)


def window_samples(latents: int, audio_config: Any, temporal_ratio: int = 4) -> int:
    """Waveform samples that give at least `latents` audio latents (the surplus is cut)."""
    return latents * temporal_ratio * audio_config.mel_hop_length
