"""The project's tests: every variant and backend against the float64 reference (outputs and
gradients), and the harness, its configs, sweeps, launchers, results store and reports, run for real
on small sizes; tests that need CUDA are marked ``gpu`` and skip without it.
"""
