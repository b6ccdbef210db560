"""flintgen installs the way users install it: a wheel (or sdist) holding every
module and template, found through importlib.resources, used from outside any
checkout. The wheel test builds the wheel, installs it non-editable into a
fresh venv and runs the CLI and ``tests/installed/`` against it there."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
from test_cache_faults import flint_variants

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkout_files():
    out = set()
    for d, _, files in os.walk(os.path.join(REPO, "flintgen")):
        if "__pycache__" in d:
            continue
        out.update(os.path.relpath(os.path.join(d, f), REPO) for f in files if f.endswith(".py"))
    out.update(f"flintgen/templates/{t}" for t in os.listdir(os.path.join(REPO, "templates")) if t.endswith(".j2"))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    p = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), REPO],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (whl,) = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".whl")]
    return whl


@pytest.mark.compile
def test_wheel_holds_every_module_and_template(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _checkout_files() - names
    assert not missing, f"the wheel lacks {sorted(missing)}: list the package in pyproject.toml"
    assert not any(n.startswith("templates/") for n in names)  # mapped into the package, not beside it


@pytest.mark.compile
def test_sdist_holds_the_templates(tmp_path):
    p = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), REPO],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    import tarfile

    (sd,) = [f for f in os.listdir(tmp_path) if f.endswith(".tar.gz")]
    names = {n.split("/", 1)[1] for n in tarfile.open(tmp_path / sd).getnames() if "/" in n}
    for t in os.listdir(os.path.join(REPO, "templates")):
        assert f"templates/{t}" in names
    assert "flintgen/device/ptx.py" in names and "pyproject.toml" in names


_DECOY = textwrap.dedent("""
    import os, sys
    import flintgen
    from flintgen import cache, codegen, resources
    assert flintgen.__file__.startswith(sys.argv[1]), flintgen.__file__
    assert resources.checkout_root() is None
    assert resources.template_dir() == os.path.join(sys.argv[1], "flintgen", "templates")
    from flintgen.kernels import get_def
    from flintgen.kernels.base import Target
    from flintgen.presets import FLINT
    rms = get_def("rms_norm")   # the def's own parameters: a template parameter added later needs no edit here
    v = rms.variants(FLINT, Target("sm_90a", 132))[1]
    src = codegen.render(v.kernel, rms.template, dict(rms.render_params(FLINT, v)))
    assert "DECOY" not in src and "HIDDEN = 2048" in src
    os.environ.pop("FLINTGEN_CACHE_DIR", None)
    os.environ["XDG_CACHE_HOME"] = sys.argv[2]
    assert cache.default_root() == os.path.join(sys.argv[2], "flintgen"), cache.default_root()
    print("OK")
""")


def test_installed_layout_ignores_a_decoy_templates_folder(tmp_path):
    """The wheel's layout (flintgen/templates inside the package) in a fake
    site-packages that also holds another distribution's templates/ and
    pyproject.toml: the package's own templates win, the cache root is the
    user cache dir."""
    site = tmp_path / "site-packages"
    shutil.copytree(os.path.join(REPO, "flintgen"), site / "flintgen",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(REPO, "templates"), site / "flintgen" / "templates")
    (site / "templates").mkdir()
    for t in os.listdir(os.path.join(REPO, "templates")):
        (site / "templates" / t).write_text("DECOY {{ undefined_name }}\n")
    (site / "pyproject.toml").write_text('[project]\nname = "otherpkg"\n')
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run([sys.executable, "-c", _DECOY, str(site), str(tmp_path / "xdg")], capture_output=True,
                       text=True, cwd=outside, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stdout + p.stderr


def test_checkout_is_recognized():
    from flintgen import cache, resources

    assert resources.checkout_root() == REPO
    assert resources.template_dir() == os.path.join(REPO, "templates")
    if not os.environ.get("FLINTGEN_CACHE_DIR"):
        assert cache.default_root() == os.path.join(REPO, "cache")


def _venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


@pytest.mark.compile
def test_installed_wheel_builds_and_serves(wheel, tmp_path):
    """Fresh venv (no system site-packages), the wheel installed non-editable,
    then from a directory outside the checkout: the tests in tests/installed/,
    ``flintgen build --preset flint --arch sm_90a`` and ``flintgen cache verify``."""
    venv = str(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    torch = f"torch=={__import__('torch').__version__.split('+')[0]}"
    p = subprocess.run([_venv_python(venv), "-m", "pip", "install", "-q", torch, wheel, "pytest"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-4000:]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLINTGEN_", "PYTHON"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), PATH=os.path.join(venv, "bin") + os.pathsep + env["PATH"])
    tests = os.path.join(REPO, "tests", "installed")
    p = subprocess.run([_venv_python(venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", tests,
                        os.path.join(REPO, "tests", "test_spec.py"), os.path.join(REPO, "tests", "test_cli_errors.py")],
                       capture_output=True, text=True, cwd=outside, env=env)
    assert p.returncode == 0 and " passed" in p.stdout, p.stdout[-4000:] + p.stderr[-2000:]
    flintgen = os.path.join(venv, "bin", "flintgen")
    p = subprocess.run([flintgen, "build", "--preset", "flint", "--arch", "sm_90a", "--jobs", "2"],
                       capture_output=True, text=True, cwd=outside, env=env)
    assert p.returncode == 0 and "0 failed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    root = os.path.join(tmp_path, "xdg", "flintgen")
    assert f"cache {root}:" in p.stdout                                   # the user cache dir
    built = re.search(r"(\d+) built: 0 hits", p.stdout)                   # a cold cache: every variant compiled
    assert built and int(built.group(1)) == flint_variants(), p.stdout
    p = subprocess.run([flintgen, "cache", "verify"], capture_output=True, text=True, cwd=outside, env=env)
    assert p.returncode == 0 and " 0 bad" in p.stdout and root in p.stdout, p.stdout + p.stderr
    assert p.stdout.startswith(f"{built.group(1)} ok, 0 bad"), p.stdout  # every flint kernel, loaded
