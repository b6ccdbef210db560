import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


HAS_CUDA = _has_cuda()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA Hopper GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """A fresh, empty cache root for this test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FLINTGEN_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="session")
def sm90():
    from flintgen.kernels.base import Target

    return Target("sm_90a", 132)


def pytest_report_header(config):
    return f"flintgen tests: CUDA {'available' if HAS_CUDA else 'not available (gpu tests skip)'}; " \
           f"cache {os.environ.get('FLINTGEN_CACHE_DIR', '<default>')}"
