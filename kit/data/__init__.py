"""Scan → buckets → pixels → cache: what the trainer reads, and the reports on it."""
