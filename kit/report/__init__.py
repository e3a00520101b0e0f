"""After a run: the doctor, the run archive, plots."""
