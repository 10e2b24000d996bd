"""The documentation site builds with --strict, and the README's links lead somewhere."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def test_readme_links_point_at_files_that_exist():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local), "the README should link into docs/"
    missing = [link for link in local if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, f"README links to missing files: {missing}"


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed (make docs)")
def test_mkdocs_build_strict(tmp_path):
    """What `make docs` runs: a broken link, a page outside the nav or a bad reference fails it."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for page in ("index.html", "quickstart/index.html", "reference/collectives/index.html"):
        assert (tmp_path / "site" / page).exists(), page
    api = (tmp_path / "site" / "reference" / "collectives" / "index.html").read_text()
    assert 'id="tf_commstrategy.collectives.allreduce"' in api  # the API reference came from the docstrings
