"""A drafter whose training has gone bad stops with one line and an exit code of its own, which nothing restarts.

Gone bad: a loss or gradient norm that is not finite for train.max_nonfinite_steps optimizer steps in a row
(consumer/training/nonfinite.py), or weights that are not finite where a checkpoint would hold them
(consumer/training/checkpoint.py). Training on would only write NaN curves, and checkpoints a successor resumes into the
same NaN, until the run ends
with exit 0. A restart cannot help either: it resumes from the last checkpoint with the same settings and data, and
diverges again. So the code is its own, EXIT_DIVERGED, and final: the drafter units list it in
RestartPreventExitStatus= (Restart=on-failure restarts any other failure), chaos's restarter leaves it down
(tools/restarter.py), and the launcher ends with it (the highest exit code of the run). The one line says which
steps, the loss and grad_norm, and what to change; the operator restarts the drafter once it is changed.

Import-light (no torch): the CLI and the tools read the code.
"""

from __future__ import annotations

# 0 ends a run, 1 is a failure (a traceback), 2 a refusal (common/refusal.py), 3 the supervisor's end after a fence.
EXIT_DIVERGED = 4


class Diverged(Exception):
    """Training that has gone bad (not an input refused: a run's own state); the message is one line naming the
    step, what is not finite and what to change. cli.main prints it and exits EXIT_DIVERGED."""
