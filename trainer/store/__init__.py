"""The job's store, as every process of a job uses it: each value sealed with the job's secret and verified on read.

May import: ``disttrain.api`` and torch. Nothing else of the trainer: the agent, the launcher and the training loop
all build on it."""
