"""Surviving failures: hang detection (watchdog), preemption notices (preempt), injected faults (fault)."""
