"""How a job is started and restarted: the launch mode, pitstop's supervisor, torch's elastic agent,
rendezvous and SLURM node lists, and the forensics of a failed rank (launcher.py)."""
