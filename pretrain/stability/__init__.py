"""Training-stability machinery: spike detection, recovery policy, telemetry."""
