"""Planning a run before it starts: whether it fits.

- `memory.py`: each rank's memory estimate, part by part and phase by phase of a step
  (`estimate_memory`, `--estimate-memory`), and the fit check that refuses a run whose
  estimate exceeds what a rank may use (`check_fits`, against measure/capacity.py).
"""
