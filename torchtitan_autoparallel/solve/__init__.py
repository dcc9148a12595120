"""The one MILP builder (HiGHS) and the one search loop over candidates."""
