"""Fine-tune diffusion models on your own images."""
