"""Where the package keeps what it builds and exports on this machine (a leaf: imports nothing of the package).

Exported models, built extensions and hosts, calibrations: all under one root, so that a user can
find, list and clear them (``ov-kvcrush export --list`` / ``--clear``).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_root() -> Path:
    """Where exported and assembled models live: ``$OV_KVCRUSH_CACHE`` or the XDG user cache dir."""
    env = os.environ.get("OV_KVCRUSH_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("ov_kvcrush"))
