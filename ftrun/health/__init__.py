"""GPU health: signals read from NVML, and the policy that turns each signal into an action."""

from ftrun.health.signals import Action, Decision, HealthSignal

__all__ = ["Action", "Decision", "HealthSignal"]
