"""The training loop: the Runner, the Stepper that takes one step, and their bookkeeping (assembly from the config,
the train state a checkpoint restores, step planning and metering, the sample log, the summary). The parts a step
is made of live below the components, in ``pitstop.parts``."""
