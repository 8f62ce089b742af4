"""Training-stability machinery: spike detection, the recovery policy, the loss-scale watchdog, telemetry, and
fault injection for the drills.

May import: `pretrain.ranges`, `pretrain.model`; it decides, the trainer acts (rollback, skips, LR cooling).
"""
