"""What is trained: adapters, full fine-tuning, textual inversion."""

from kit.methods.network import build_network as get_method

__all__ = ["get_method"]
