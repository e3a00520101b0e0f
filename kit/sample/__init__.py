"""Drawing validation images."""
