"""The planner: compile one training step's programs ahead of time on simulated devices and
read what they need (tools/plan.py is its command line; docs/scaling.md its results).

  topology.py  chips and topologies (memory, FLOP/s, bandwidths); no jax import
  programs.py  the step's programs compiled with abstract inputs carrying the run's shardings
  estimate.py  the hand estimate of each program's memory, formulas written out
  hlo_analysis.py  reading compiled HLO: collectives with loop counts, those a loop repeats on
               unchanged values, matmul FLOPs, the HLO right after SPMD partitioning
  slots.py     slot utilisation of a completion length profile, fixed vs continuous batching
  report.py    the printed tables
"""
