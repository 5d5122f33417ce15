"""Worker exit codes: the contract between the trainer, torchrun and the operator's exit-code classes."""

import enum


class ExitCode(enum.IntEnum):
    """How a trainer process ended. Codes 0-2 and >128 keep their usual meanings (ok, error, usage, signal)."""

    SUCCESS = 0
    """Training reached maxSteps/maxSamples."""
    DRAINED = 83
    """A checkpoint was committed at a step boundary on drain or SIGTERM, then the process exited: no work lost."""
    REFORM = 84
    """The process exited at once on a reform signal (or a collective failed); resume from the last checkpoint."""
    PERMANENT = 85
    """A user error that a restart cannot fix (invalid world size, changed dataset, bad contract)."""


DEFAULT_PERMANENT_EXIT_CODES: tuple[int, ...] = (int(ExitCode.PERMANENT),)
