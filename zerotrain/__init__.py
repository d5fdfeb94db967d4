"""zerotrain: a DeepSpeed-centric training toolkit for decoder-only language models.

One import namespace. The repository keeps its folders and installs them under it (setup.cfg's
package_dir): launcher/ -> zerotrain.launcher, modeling/ -> zerotrain.modeling, dataio/ ->
zerotrain.dataio, and the data folders ds_configs/ (hardware profiles) and recipes/ as
zerotrain.ds_configs and zerotrain.recipes. Shipped files are found with importlib.resources
(`resource_dir`), never relative to a source file, so a wheel install works like a checkout.

This module imports nothing of the project: every layer may use it.
"""
from __future__ import annotations

import importlib.resources
from pathlib import Path

__version__ = "0.2.0"


def resource_dir(package: str, *parts: str) -> Path:
    """The directory of shipped files `parts` inside `package` (e.g. "zerotrain.ds_configs").

    zerotrain installs as plain files (a wheel unpacked into site-packages, or an editable
    checkout), so the package's resources are a real directory; a zip import would not be, and is
    refused here rather than failing later with an odd path error.
    """
    root = importlib.resources.files(package)
    for part in parts:
        root = root / part
    if not isinstance(root, Path):
        raise RuntimeError(f"{package}: zerotrain must be installed as files, not imported from a zip ({root})")
    return root
