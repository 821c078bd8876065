"""The results files and the notes agree. Every results file the notes cite is in the
repository: the names in backticks in docs/*.md, README.md, results/*.md and results/h200/*.txt
(a bare name is one of results/h200/, `h200/NAME` one of results/, and `{a,b}` stands for both),
and every `results/h200/...` path named in the code. Names that start with `_` shorten the name
cited before them and are not checked; neither are files of the folders the notes cite at an
earlier commit (`git show REV:PATH`). And every file of results/h200 is cited by one of those
notes, and every section a text cites by name (`docs/NOTE.md`, "Section") is a heading or a bold
paragraph of that note."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results" / "h200"
QUOTED = re.compile(r"`([^`\s]+)`")
# a.txt, a.{json,txt}, a{.txt,_on.json}
RESULT_FILE = re.compile(
    r"(\.(json|txt|png|gz)|\.\{[a-z.,]+\}|\{[^{}]*\.(json|txt|png|gz)[^{}]*\})$"
)
CODE_PATH = re.compile(r"results/h200/[\w.{},-]+")
# the notes: the design notes, the README and the results' READMEs
NOTES = [
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "README.md",
    *sorted(RESULTS.parent.glob("*.md")),
]
SECTION_CITE = re.compile(r'docs/(\w+)\.md`?\s*[,(]?\s*\(?\s*"([^"]+)"', re.S)


def expand(name: str) -> list[str]:
    """`a_{1,2}.{json,txt}` -> a_1.json, a_1.txt, a_2.json, a_2.txt."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [
        full
        for alt in m.group(1).split(",")
        for full in expand(name[: m.start()] + alt + name[m.end() :])
    ]


def cited_paths(text: str, quoted: bool = True) -> set[str]:
    """The repository paths of the results files `text` cites (quoted names, or with
    quoted=False bare `results/h200/` paths as code names them)."""
    if quoted:
        names = [n for n in QUOTED.findall(text) if RESULT_FILE.search(n)]
    else:
        names = [n.rstrip(".,") for n in CODE_PATH.findall(text)]
    paths = set()
    for name in names:
        for full in expand(name):
            if full.startswith("_") or any(c in full for c in "*<>$[]"):
                continue
            if "/" not in full:
                full = f"results/h200/{full}"
            elif full.startswith("h200/"):
                full = f"results/{full}"
            if full.startswith("results/h200/"):
                paths.add(full)
    return paths


def test_the_scan_reads_every_form_of_citation():
    text = (
        "(`results/h200/a.{json,txt}`, `b_{1,2}.txt`, `h200/c.png`, `_headline.txt`, "
        "`d{.txt,_on.json}`, `results/2026-01-01-h200/old.txt`, `not_a_file`)"
    )
    names = ("a.json", "a.txt", "b_1.txt", "b_2.txt", "c.png", "d.txt", "d_on.json")
    want = {f"results/h200/{n}" for n in names}
    assert cited_paths(text) == want
    assert cited_paths("--ceilings=results/h200/ceilings.json.", quoted=False) == {
        "results/h200/ceilings.json"
    }


def test_every_cited_results_file_exists():
    notes = [*NOTES, *sorted(RESULTS.glob("*.txt"))]
    code = [p for d in ("experiments", "huginn_jax", "pallas_kernels", "tools") for p in
            sorted((REPO / d).rglob("*.py"))]  # fmt: skip
    cited: dict[str, set[str]] = {}
    for path in notes + code:
        for cite in cited_paths(path.read_text(errors="replace"), quoted=path in notes):
            cited.setdefault(cite, set()).add(str(path.relative_to(REPO)))
    assert len(cited) > 100  # the scan found the notes' citations
    missing = sorted(f"{c} (cited in {', '.join(sorted(cited[c]))})"
                     for c in cited if not (REPO / c).exists())  # fmt: skip
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_every_results_file_is_cited():
    """No file of results/h200 is left that no note explains (the README or a doc)."""
    notes = NOTES
    cited = set()
    for path in notes:
        cited |= cited_paths(path.read_text(errors="replace"))
    kept = {str(p.relative_to(REPO)) for p in RESULTS.iterdir() if p.is_file()}
    assert not sorted(kept - cited), "results files no note cites:\n" + "\n".join(
        sorted(kept - cited)
    )


def section_names(note: str) -> set[str]:
    """The headings and bold paragraph titles of a note, whitespace collapsed."""
    found = re.findall(r"^#+ (.*)$", note, re.M) + re.findall(r"^\*\*(.+?)\*\*", note, re.M | re.S)
    return {" ".join(name.split()) for name in found}


def cited_sections(text: str) -> list[tuple[str, str]]:
    """(note, section) of each `docs/NOTE.md`, "Section" in `text` (a name wrapped over comment
    lines read as one line)."""
    return [
        (f"docs/{note}.md", " ".join(re.sub(r"\s*#\s*", " ", name).split()))
        for note, name in SECTION_CITE.findall(text)
    ]


def test_every_cited_section_exists():
    assert cited_sections('(`docs/a.md`, "One\n  # two") and docs/b.md ("Three")') == [
        ("docs/a.md", "One two"),
        ("docs/b.md", "Three"),
    ]
    patterns = ("docs/*.md", "*.md", "results/*.md", "results/h200/*.txt")
    patterns += tuple(
        f"{d}/**/*.py" for d in ("experiments", "huginn_jax", "pallas_kernels", "tools")
    )
    texts = [p for pattern in patterns for p in sorted(REPO.glob(pattern))]
    names: dict[str, set[str]] = {}
    cites, missing = 0, []
    for path in texts:
        for note, section in cited_sections(path.read_text(errors="replace")):
            cites += 1
            if note not in names:
                file = REPO / note
                names[note] = section_names(file.read_text()) if file.exists() else set()
            if not any(name.startswith(section) for name in names[note]):
                missing.append(f'{path.relative_to(REPO)}: {note}, "{section}"')
    assert cites > 50  # the scan found the citations
    assert not missing, "sections cited but not in their note:\n" + "\n".join(missing)
