"""Fitting hardware profiles to measurements: micro-benchmarks (``calibrate``) and measured
runs (``fit``, ``runs``, ``report``). Above the planner: a plan's time on a candidate profile
comes from ``recost.recost``, so ``cost/`` stays pure functions of a profile and a graph."""
