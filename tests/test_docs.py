"""The documentation's rules: a short README, one page per concern in docs/, links that
resolve inside the repository, and config examples that the gateway accepts.

A README a newcomer reads in five minutes stays under 250 lines; every page of docs/
stays under 400. A clone has nothing outside the repository, so no file may point there,
and a link that resolves nowhere is a broken promise to the reader."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.config import config_from_mapping

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, *PAGES]

# [text](target) and ![alt](target); the target ends at whitespace or the closing paren.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_YAML_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)
# Split so that this file does not itself name the place it forbids.
_OUTSIDE = "../" + "shared"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))  # code is not a link
    return _LINK.findall(text)


def test_readme_is_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines < 250, f"README.md has {lines} lines; move detail to a page in docs/"


def test_the_pages_exist() -> None:
    assert len(PAGES) >= 10, [p.name for p in PAGES]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_page_is_short(page: Path) -> None:
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines < 400, f"{_rel(page)} has {lines} lines; split it by concern"


def _anchors(path: Path) -> set[str]:
    """The heading anchors GitHub gives a page: lower case, punctuation dropped, spaces
    to hyphens."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    headings = re.findall(r"^#+ (.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCUMENTS, ids=_rel)
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.is_relative_to(ROOT) or not path.is_file():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(target)
    assert not broken, f"{_rel(doc)}: links to no file or heading in the repository: {broken}"


def test_every_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / t.split("#", 1)[0]).resolve() for t in _links(README)}
    orphans = [_rel(p) for p in PAGES if p not in linked]
    assert not orphans, f"pages the README does not link: {orphans}"


def _text_files() -> list[Path]:
    """The repository's own files: what git tracks (and would clone), not what an
    install or a run left beside them (an egg-info copies an older README)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    out = []
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if path.is_file() and path.suffix not in {".png", ".gguf", ".pyc"}:
            out.append(path)
    assert len(out) > 100  # the listing worked
    return out


def test_no_file_refers_outside_the_repository() -> None:
    offenders = []
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if _OUTSIDE in text:
            offenders.append(_rel(path))
    assert not offenders, f"files that refer to {_OUTSIDE}, which a clone lacks: {offenders}"


def _configs(doc: Path) -> list[dict]:
    blocks = _YAML_BLOCK.findall(doc.read_text(encoding="utf-8"))
    return [yaml.safe_load(b) for b in blocks if "replicas:" in b]


@pytest.mark.parametrize("doc", [README, ROOT / "docs" / "configuration.md"], ids=_rel)
def test_config_examples_are_valid(doc: Path) -> None:
    configs = _configs(doc)
    assert configs, f"{_rel(doc)} shows no config with replicas"
    for data in configs:
        assert config_from_mapping(data, env={}).replicas


def test_the_quick_start_config_is_minimal_and_complete() -> None:
    """One replica, one key, an admin token; the models and the pool are discovered."""
    (data,) = _configs(README)
    config = config_from_mapping(data, env={})
    assert len(config.replicas) == 1 and config.replicas[0].pool_tokens is None
    assert [len(t.keys_sha256) for t in config.tenants] == [1]
    assert config.auth.admin_token
    assert data == _configs(ROOT / "docs" / "configuration.md")[0], "the two pages differ"
