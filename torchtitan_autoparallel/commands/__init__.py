"""The user-facing commands: plan, predict, explain, show, diff, fit, calibrate."""
