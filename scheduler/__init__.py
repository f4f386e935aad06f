"""Scheduler process: consumes reports, runs the planner, publishes decisions."""
