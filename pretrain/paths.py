"""Where ayumi finds its configs and puts its artifacts (never inside the packages)."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout ayumi runs from (installed editable, so conf/ sits beside the packages)."""

CONF_DIR = Path(os.environ.get("AYUMI_CONF_DIR", REPO_ROOT / "conf"))
"""Hydra's config root; AYUMI_CONF_DIR points elsewhere for a site-specific copy."""
