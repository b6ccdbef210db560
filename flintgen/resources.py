"""Where flintgen's own files are: a source checkout or an installed package.

flintgen runs *from a checkout* when the directory above the package holds the
flintgen ``pyproject.toml`` and ``templates/`` (an editable install, or
``PYTHONPATH`` pointing at the checkout). Only then are the checkout's
``templates/`` and ``cache/`` used; an installed package (wheel or sdist) reads
its templates from inside the package through ``importlib.resources``, never
from a ``templates/`` folder some other distribution left in site-packages.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_PROJECT_NAME = re.compile(r'^\s*name\s*=\s*"flintgen"\s*$', re.M)


@functools.lru_cache(maxsize=None)
def checkout_root() -> str | None:
    """The source checkout flintgen runs from, or None for an installed package."""
    root = os.path.dirname(PACKAGE_DIR)
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            is_ours = bool(_PROJECT_NAME.search(f.read()))
    except OSError:
        return None
    return root if is_ours and os.path.isdir(os.path.join(root, "templates")) else None


@functools.lru_cache(maxsize=None)
def template_dir() -> str:
    """The directory holding the ``*.py.j2`` kernel templates."""
    root = checkout_root()
    if root is not None:
        return os.path.join(root, "templates")
    # Installed: the build maps the checkout's templates/ to flintgen/templates.
    path = importlib.resources.files("flintgen").joinpath("templates")
    if not isinstance(path, os.PathLike) or not os.path.isdir(path):
        raise RuntimeError(
            f"flintgen's templates are missing from the installed package ({path}): "
            "reinstall flintgen from a wheel or sdist built with `python -m build`"
        )
    return os.fspath(path)
