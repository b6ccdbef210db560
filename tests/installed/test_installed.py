"""Run by tests/test_packaging.py inside a fresh venv holding the flintgen
wheel (skipped when flintgen runs from a checkout)."""

import os
import sys
import sysconfig

import pytest

import flintgen
from flintgen import cache, resources

pytestmark = pytest.mark.skipif(resources.checkout_root() is not None,
                                reason="flintgen runs from a checkout: these check an installed wheel")


def test_imported_from_this_venvs_site_packages():
    site = sysconfig.get_paths()["purelib"]
    assert sys.prefix != sys.base_prefix, "not a venv"
    assert os.path.dirname(os.path.dirname(os.path.abspath(flintgen.__file__))) == site, flintgen.__file__


def test_no_editable_finder_is_active():
    finders = [type(f).__module__ + "." + type(f).__name__ for f in sys.meta_path]
    assert not any("editable" in f for f in finders), finders
    site = sysconfig.get_paths()["purelib"]
    pth = [f for f in os.listdir(site) if f.endswith(".pth") and "flintgen" in f.lower()]
    assert pth == [], pth


def test_templates_come_from_the_package():
    assert resources.template_dir() == os.path.join(os.path.dirname(flintgen.__file__), "templates")
    for t in ("rms_norm.py.j2", "qkv_gemv.py.j2", "decode_attention.py.j2"):
        assert os.path.isfile(os.path.join(resources.template_dir(), t))


def test_cache_root_is_the_user_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("FLINTGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.default_root() == os.path.join(str(tmp_path), "flintgen")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.default_root() == os.path.join(os.path.expanduser("~"), ".cache", "flintgen")
