"""The project's own documents stay true to the tree: every module is named where
docs/architecture.md says what each package holds, every local link resolves, and no file cites
a document the project does not have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"client/": "client", "client/shared/": "client/shared", "client/engines/": "client/engines",
            "server/": "server", "kernels/": "kernels"}
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def package_rows() -> dict[str, str]:
    """docs/architecture.md's table of packages: folder -> its row."""
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        found = re.match(r"\| `([a-z/_]+)` \|", line)
        if found:
            rows[found.group(1)] = line
    return rows


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_every_module_is_named_in_the_architecture_page(folder):
    row = package_rows().get(folder)
    assert row is not None, f"docs/architecture.md has no row for {folder}"
    named = set(re.findall(r"`([a-z_]+\.py)`", row))
    modules = {p.name for p in (ROOT / PACKAGES[folder]).glob("*.py") if p.name != "__init__.py"}
    assert modules - named == set(), f"modules of {folder} that docs/architecture.md does not name"
    assert named - modules - {"__init__.py"} == set(), f"named for {folder} but not in the tree"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(document):
    """Markdown links to files of the project (not web addresses, not anchors alone)."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z]+:", path):
            continue
        if not (document.parent / path).exists():
            broken.append(target)
    assert broken == [], f"{document.relative_to(ROOT)} links to files that do not exist"


def test_no_file_cites_a_document_the_project_does_not_have():
    """Code and docs once cited design notes kept outside the project; what they said the project
    relies on is in docs/ now."""
    absent = re.compile(r"\b(DESIGN|STYLE|DEVICE|ENGRAM_REFERENCE)\.md\b|\bENGRAM_REFERENCE\b")
    citing = []
    for path in ROOT.rglob("*"):
        if (path.suffix not in {".py", ".md", ".sh", ".toml"} or not path.is_file()
                or any(part.startswith(".") for part in path.relative_to(ROOT).parts)):
            continue
        if absent.search(path.read_text(errors="replace")) and path != Path(__file__).resolve():
            citing.append(str(path.relative_to(ROOT)))
    assert citing == []
