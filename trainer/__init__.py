"""The in-container side: elastic context, sampler, checkpoints, batch/LR plan application, job agent."""
