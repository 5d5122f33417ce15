"""The mark of a worker leaving its process group under a hang guard (:func:`disttrain.trainer.teardown.hang_guard`).

The guard can only end a worker whose teardown hangs with exit code 1 (``faulthandler``'s); while the mark exists the
launcher reads that exit as a reform, not as the user's failure (:func:`disttrain.trainer.launch.launcher.
is_user_failure`). No torch: both sides import it.
"""

from __future__ import annotations

import pathlib
import tempfile


def marker(pid: int) -> pathlib.Path:
    """The file that says worker ``pid`` is leaving its group under a hang guard."""
    return pathlib.Path(tempfile.gettempdir()) / f"disttrain-leaving-{pid}"
