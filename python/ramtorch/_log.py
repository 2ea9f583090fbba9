"""The ``ramtorch`` logger: what the library reports that is not a warning or an error.

Messages go to ``logging.getLogger("ramtorch")`` (INFO: the plan ``gpu_budget="auto"`` chose, ...);
show them with ``logging.basicConfig(level=logging.INFO)`` or a handler of your own. Conditions the
user should act on are :class:`UserWarning` s (``warnings``), errors are exceptions, and progress bars
are tqdm bars on stderr.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("ramtorch")
# A library leaves the handlers to the application (the logging HOWTO's advice for libraries).
logger.addHandler(logging.NullHandler())
