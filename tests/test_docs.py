"""The docs match the code: the options page is generated from
``StreamConfig``, the README stays a front door, and every relative link
in the docs leads somewhere."""

import re
from pathlib import Path

from mlx_streaming.config import options_doc

ROOT = Path(__file__).resolve().parent.parent
QUICK_START = [
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && '
    "python -m mlx_streaming.demo",
    ". .venv/bin/activate && python -m pytest -q",
]


def test_options_doc_is_generated_from_the_config():
    assert (ROOT / "docs" / "options.md").read_text() == options_doc(), \
        "docs/options.md is out of date: run python scripts/options_doc.py"


def test_readme_is_a_front_door_with_the_two_quick_start_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for command in QUICK_START:
        assert f"```bash\n{command}\n```" in readme


def test_relative_links_in_the_docs_resolve():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)


def test_batch_generate_examples_take_the_texts_of_its_response():
    """batch_generate returns mlx-lm's BatchResponse: an example that names
    its result ``texts`` takes its ``.texts``."""
    wrong = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            m = re.match(r"\s*texts?\s*=\s*[\w.]*batch_generate\(.*\)(\.\w+)?\s*$", line)
            if m and m.group(1) != ".texts":
                wrong.append(f"{doc.relative_to(ROOT)}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_repository_paths_named_in_the_docs_exist():
    """A file or folder of the repository named in the README, docs/ or
    native/README.md (``mlx_streaming/runtime/store.py``) is there."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "native" / "README.md"]
    missing = []
    for doc in docs:
        for path in re.findall(r"(?<![\w/.-])((?:mlx_streaming|tests|scripts|native|docs|\.ci)/"
                               r"[\w./-]*\w)", doc.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)} names {path}")
    assert not missing, "\n".join(missing)
