"""The run folder: its layout (the only owner of run paths), checkpoints, the machine."""
