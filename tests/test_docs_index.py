"""The README and the docs index stay a way in, not a dead end.

- README.md fits on a screen or two (at most 100 lines) and shows the two fresh-machine commands
  byte for byte (docs/install.md repeats them);
- docs/README.md links every page under docs/, subfolders included (docs/collapse/ holds the
  collapse reports; a page nobody links is a page nobody finds);
- every relative link of README.md and docs/README.md names a file that exists;
- the documented commands work with what the install gives: the notebook command of
  docs/study.md ("Notebooks") runs against a stand-in for nbclient's kernel client (a real kernel
  is tests/test_notebooks.py's job), and the paper-scale commands of the README and
  docs/scaling.md §0 pass the launch scripts' argument parsing (`--dry-run`, which starts nothing).

Each checker is a function of text or a directory, so the tests at the end plant a failure
(an unlisted page, a dead link, a long README) and see it caught."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from _configs import load_module

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 100

# The two commands of a fresh machine, exactly as users copy them (.ci/run runs the second's test
# command; bench/toy_run.py --readme the first's run).
COMMAND_1 = ('python3 -m venv .venv && .venv/bin/pip install -c constraints/cpu-py311.txt -e ".[dev]" && '
             '.venv/bin/python -m cleaner_jax.train --config configs/toy.py --workdir runs/toy')
COMMAND_2 = ('python3 -m venv .venv && .venv/bin/pip install -c constraints/cpu-py311.txt -e ".[dev]" && '
             '(command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)) && '
             '.venv/bin/python -m pytest -q -n 2')

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(text: str) -> list[str]:
    """The targets of the markdown links and images in `text`, in order."""
    return _LINK.findall(text)


def relative_targets(text: str) -> list[str]:
    """Link targets that name a file of the repository: no scheme, no bare `#anchor`; the
    anchor of `page.md#section` dropped."""
    out = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def dead_links(page: Path) -> list[str]:
    """The relative link targets of `page` that name no existing file or directory."""
    return [t for t in relative_targets(page.read_text()) if not (page.parent / t).exists()]


def pages(docs: Path) -> set[Path]:
    """Every markdown page under `docs`, subfolders included, but the index itself."""
    return {p.resolve() for p in docs.rglob("*.md")} - {(docs / "README.md").resolve()}


def unlisted(docs: Path) -> list[str]:
    """The pages under `docs` that `docs/README.md` does not link, relative to `docs`."""
    index = docs / "README.md"
    listed = {(docs / t).resolve() for t in relative_targets(index.read_text())}
    return sorted(str(p.relative_to(docs.resolve())) for p in pages(docs) - listed)


def too_long(text: str, limit: int = MAX_README_LINES) -> bool:
    return len(text.splitlines()) > limit


def code_blocks(text: str, lang: str = "bash") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)


def command_lines(block: str) -> list[str]:
    """A bash block as logical command lines: continuations joined, comments and blank lines out."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(line)
    return out


# ------------------------------------------------------------------ the README and the index


def test_readme_fits_on_a_screen_or_two():
    n = len(README.read_text().splitlines())
    assert not too_long(README.read_text()), f"README.md has {n} lines; at most {MAX_README_LINES}: move the rest to docs/"


@pytest.mark.parametrize("page", [README, DOCS / "install.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_two_commands_are_shown_byte_for_byte(page):
    lines = page.read_text().splitlines()
    assert COMMAND_1 in lines and COMMAND_2 in lines


def test_every_docs_page_is_listed_in_the_index():
    missing = unlisted(DOCS)
    assert not missing, f"add these pages to docs/README.md: {missing}"


@pytest.mark.parametrize("page", [README, DOCS / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert relative_targets(page.read_text()), "no links found: the link pattern no longer matches"
    assert not dead_links(page), f"{page.relative_to(ROOT)}: links to missing files: {dead_links(page)}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "README.md").write_text("| [a.md](a.md) | a |\n[b](b.md#part) and [web](https://example.org) [top](#x)\n")
    for name in ("a.md", "b.md", "c.md", "sub/d.md"):
        (docs / name).write_text("# page\n")
    assert unlisted(docs) == ["c.md", "sub/d.md"]  # planted: one page here, one in a subfolder
    (docs / "README.md").write_text((docs / "README.md").read_text() + "[c](c.md) [d](sub/d.md) [gone](gone.md)\n")
    assert unlisted(docs) == []
    assert dead_links(docs / "README.md") == ["gone.md"]
    assert too_long("x\n" * (MAX_README_LINES + 1)) and not too_long("x\n" * MAX_README_LINES)
    assert command_lines("a \\\n  b  # c\n# only a comment\n\nd &  # e\n") == ["a    b  # c", "d &  # e"]


# ------------------------------------------------------------------ the notebook command


def _notebook_command() -> tuple[list[str], str, str]:
    """(argv after `python -`, the heredoc's Python, the doc's text) of docs/study.md's command."""
    text = (DOCS / "study.md").read_text()
    notes = text.split("\n## Notebooks\n", 1)[1]
    block = next(b for b in code_blocks(notes) if "<<'EOF'" in b)
    head, body = block.split("<<'EOF'\n", 1)
    script, end = body.rsplit("EOF\n", 1)
    assert end == ""
    argv = shlex.split(head.replace("\\\n", " "))
    assert argv[:2] == [".venv/bin/python", "-"]
    return argv[2:], script, notes


def _parameters(notebook: Path) -> set[str]:
    nb = nbformat.read(notebook, as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    return set(re.findall(r"^([A-Z_]+) =", cell.source, re.M))


def test_the_documented_notebook_command_uses_what_the_install_gives(tmp_path, monkeypatch):
    """The command's own Python, run against a stand-in for nbclient's client: it reads the
    notebook it names, puts the given values in a cell right after the parameters cell (each
    value a Python literal, else a string), executes that notebook and writes it where it says."""
    args, script, notes = _notebook_command()
    src, out, *params = args
    assert (ROOT / src).is_file()
    names = {p.split("=", 1)[0] for p in params}
    assert names <= _parameters(ROOT / src), f"{names - _parameters(ROOT / src)} are no parameters of {src}"
    # the output goes into the study the same section's command writes, and the baseline is one of its arms
    study = dict(p.split("=", 1) for p in params)["STUDY_DIR"]
    assert Path(out).parent == Path(study)
    config = load_module(ROOT / "configs" / "recoverable_gamma_study.py").get_config()
    assert f"--config configs/recoverable_gamma_study.py --workdir {study}" in (DOCS / "study.md").read_text()
    assert dict(p.split("=", 1) for p in params)["BASELINE"] in config.arms
    # the trajectories variant names parameters of that notebook
    variant = re.search(r"For the trajectories of one run.*?`((?:[A-Z_]+=\S+ ?)+)`", notes, re.S)
    assert variant and {w.split("=")[0] for w in variant.group(1).split()} <= _parameters(ROOT / "notebooks/trajectories.ipynb")

    import nbclient

    ran = []

    class Client:  # no kernel: records what it was asked to run
        def __init__(self, nb, timeout, kernel_name, **kw):
            assert kernel_name == "python3" and timeout > 0
            self.nb = nb

        def execute(self):
            ran.append(self.nb)
            return self.nb

    monkeypatch.setattr(nbclient, "NotebookClient", Client)
    monkeypatch.chdir(ROOT)
    written = tmp_path / "out.ipynb"
    monkeypatch.setattr(sys, "argv", ["-", src, str(written), *params, "SHOW=4"])
    exec(compile(script, "docs/study.md (notebook command)", "exec"), {"__name__": "__main__"})
    (nb,) = ran
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    injected = nb.cells[at + 1]
    assert "injected-parameters" in injected.metadata["tags"]
    values: dict = {}
    exec(injected.source, {}, values)
    assert values == {**{k: v for k, v in (p.split("=", 1) for p in params)}, "SHOW": 4}
    assert nbformat.read(written, as_version=4).cells[at + 1].source == injected.source


def test_no_page_tells_users_to_run_papermill():
    """papermill is not installed; `notebook.ipynb -p NAME VALUE` is its syntax."""
    bad = [str(p.relative_to(ROOT)) for p in [README, *DOCS.rglob("*.md")] if re.search(r"\.ipynb -p ", p.read_text())]
    assert not bad


# ------------------------------------------------------------------ the paper-scale commands


def _dry_run(line: str) -> str:
    """Run a documented `launch/*.sh ...` line with `--dry-run` right after the script (it then
    prints its commands and starts nothing); its stdout."""
    words = shlex.split(line, comments=True)
    if words[-1] == "&":
        words = words[:-1]
    assert words[0].startswith("launch/") and words[0].endswith(".sh"), line
    proc = subprocess.run(["bash", words[0], "--dry-run", *words[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, f"{line}\n{proc.stderr}"
    return proc.stdout


def test_the_readme_paper_command_parses_and_puts_the_learner_on_gpus_2_3():
    (block,) = [b for b in code_blocks(README.read_text()) if "train_single_node.sh" in b]
    (line,) = command_lines(block)
    trainer = _dry_run(line).splitlines()[-1]
    assert "CUDA_VISIBLE_DEVICES=2,3 python -m cleaner_jax.train --config configs/qwen3_4b_cleaner.py" in trainer


def test_the_two_learner_gpu_command_of_scaling_md_parses_and_sets_one_row_per_gpu():
    text = (DOCS / "scaling.md").read_text()
    section = text.split("## 0. ", 1)[1].split("\n## 1. ", 1)[0]
    (block,) = [b for b in code_blocks(section) if "learner_node.sh" in b]
    lines = [ln for ln in command_lines(block) if ln.lstrip().startswith("launch/")]
    servers, learner = lines
    urls = _dry_run(servers).splitlines()[-1]  # the servers' URL line, printed last
    trainer = _dry_run(learner).splitlines()[-1]
    assert f"--config.rollout.server_urls={urls} " in trainer
    assert trainer.startswith("+ env CUDA_VISIBLE_DEVICES=2,3 python -m cleaner_jax.train")
    assert trainer.endswith("--config.algo.micro_batch_size=2")
    assert "mkdir -p /dev/shm/cleaner_sync" in block and "--config.train.weight_export_dir=/dev/shm/cleaner_sync" in trainer
