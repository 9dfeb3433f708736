"""Fleet simulator: wire-format traces with ground truth, from a lockstep model.

``spec``      what to simulate (jobs, islands, noise, faults), calibrated defaults
``model``     the lockstep model of one job, window by window
``faults``    when a fault is active and what it does to time and telemetry
``fleet``     records in arrival order, the WindowFrame fast path, the truth sidecar
``scenarios`` scenario suites drawn from data files (benchmarks/scenarios/)
``score``     matching incidents to the truth: recall, precision, cause accuracy

A Fleet is one pass: its jobs advance as records (or frames) are drawn.
"""

from artemisd.sim.fleet import Fleet, simulate_records, single_job, truth_path
from artemisd.sim.spec import AMD_MI300X, NVIDIA_H100, EnvSpec, FaultSpec, FleetSpec, IslandSpec, JobSpec, NoiseSpec

__all__ = [
    "AMD_MI300X", "NVIDIA_H100", "EnvSpec", "FaultSpec", "Fleet", "FleetSpec", "IslandSpec", "JobSpec",
    "NoiseSpec", "simulate_records", "single_job", "truth_path",
]
