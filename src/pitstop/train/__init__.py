"""The training loop and what one step needs: the Runner, launch facts, precision, compile, LR schedules,
the task, seeds, batches, the parameter digest and step metering (FLOPs, throughput)."""
