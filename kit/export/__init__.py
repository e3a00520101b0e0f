"""Exports for each client, verified by that client's rules."""
