"""The parts of a step that the loop and the components share, below both: seeds, batches (placing them on the
device), precision, compile, LR schedules, the task (loss and metrics), the parameter digest, and the launch facts
a launcher hands down. They import nothing of pitstop above ``config`` and ``errors``."""
