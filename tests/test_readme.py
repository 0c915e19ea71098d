"""The README stays a short manual: its length, its Quick start, its Layout tree against the
repository, and the relative links (and their anchors) of README.md and docs/*.md.

The details live in docs/; the README keeps one short section per command and points there.
"""

import glob
import os
import re
import subprocess

import pytest

from conftest import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")
DOCS_DIR = os.path.join(REPO_ROOT, "docs")
MAX_README_LINES = 420


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _rel(path):
    return os.path.relpath(path, REPO_ROOT).replace(os.sep, "/")


def _markdown_files():
    return [README] + sorted(glob.glob(os.path.join(DOCS_DIR, "*.md")))


def _section(text, title):
    """The body of the level-2 section `## title` (up to the next level-2 heading)."""
    match = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _code_blocks(text):
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)


# ---------------------------------------------------------------------------------------------
# (a) length, and the Quick start
# ---------------------------------------------------------------------------------------------

def test_readme_is_a_short_manual():
    lines = len(_read(README).splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, more than {MAX_README_LINES}: move the details into a "
        f"docs/*.md file and leave a short section with a link")


def test_quick_start_is_exactly_make_demo_and_make_test():
    blocks = _code_blocks(_section(_read(README), "Quick start"))
    commands = []
    for block in blocks:
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append(command)
    assert commands == ["make demo", "make test"], (
        f"the Quick start must hold exactly two commands, `make demo` and `make test`; "
        f"it holds {commands}")


# ---------------------------------------------------------------------------------------------
# (b), (c) the Layout tree
# ---------------------------------------------------------------------------------------------

# One entry per line: tree prefix ("│   " or "    " per level, then "├── " or "└── "), the
# name (a folder ends in "/"), two or more spaces, a few words on what it holds.
TREE_LINE = re.compile(r"^(?P<indent>(?:[│ ]   )*)(?P<branch>[├└]── )?(?P<name>\S+)"
                       r"(?:\s{2,}(?P<note>\S.*))?$")


def parse_layout(block):
    """The paths a tree block lists, relative to the repository root: {path: is_folder}.
    The first line is the root (e.g. `./`)."""
    lines = [line.rstrip() for line in block.splitlines() if line.strip()]
    assert lines, "the Layout code block is empty"
    paths, stack, problems = {}, [], []
    for number, line in enumerate(lines[1:], start=2):
        match = TREE_LINE.match(line)
        if not match or not match.group("branch"):
            problems.append(f"line {number} of the Layout block is not a tree entry "
                            f"('├── name  what it holds', one entry per line): {line!r}")
            continue
        depth = len(match.group("indent")) // 4
        if depth > len(stack):
            problems.append(f"line {number} of the Layout block is indented below no folder: "
                            f"{line!r}")
            continue
        name = match.group("name")
        if not match.group("note"):
            problems.append(f"Layout entry {name!r} (line {number}) says nothing about what "
                            f"it holds")
        del stack[depth:]
        stack.append(name.rstrip("/"))
        paths["/".join(stack)] = name.endswith("/")
    assert not problems, "\n".join(problems)
    return paths


def _layout():
    blocks = _code_blocks(_section(_read(README), "Layout"))
    assert blocks, "the README's Layout section has no code block"
    return parse_layout(blocks[0])


def test_parse_layout_reads_a_tree():
    block = ("./\n"
             "├── a.py         a file\n"
             "├── pkg/         a folder\n"
             "│   ├── sub/     below it\n"
             "│   │   └── x/   deeper\n"
             "│   └── other/   a sibling\n"
             "└── last/        the last one\n"
             "    └── in/      inside it\n")
    assert parse_layout(block) == {"a.py": False, "pkg": True, "pkg/sub": True,
                                   "pkg/sub/x": True, "pkg/other": True, "last": True,
                                   "last/in": True}
    with pytest.raises(AssertionError, match="says nothing"):
        parse_layout("./\n├── a.py\n")
    with pytest.raises(AssertionError, match="not a tree entry"):
        parse_layout("./\n├── a.py   a file\n    continued text\n")


def test_every_layout_path_exists():
    missing = []
    for path, is_folder in sorted(_layout().items()):
        full = os.path.join(REPO_ROOT, path)
        if is_folder and not os.path.isdir(full):
            missing.append(f"{path}/ (no such folder)")
        elif not is_folder and not os.path.exists(full):
            missing.append(f"{path} (no such file)")
    assert not missing, ("the README's Layout lists paths that do not exist: "
                         + ", ".join(missing))


def _holds_files(folder, suffix=""):
    """Whether a folder holds files ending in suffix directly (outside __pycache__)."""
    return any(entry.is_file() and entry.name.endswith(suffix) for entry in os.scandir(folder))


def _folders(top, keep):
    found = []
    for root, dirs, _ in os.walk(os.path.join(REPO_ROOT, top)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        if keep(root):
            found.append(_rel(root))
    return found


def _tracked_top_level():
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, check=True,
                                 capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"git ls-files does not work here: {error}")
    names = {path.split("/", 1)[0] for path in listing.split("\0") if path}
    # A tracked file deleted from the working tree is not part of the tree any more.
    return sorted(name for name in names
                  if not name.startswith(".") and os.path.exists(os.path.join(REPO_ROOT, name)))


def test_layout_lists_every_package_test_folder_and_top_level_entry():
    listed = _layout()
    required = {
        "package folders under megatron/ (holding .py files)":
            _folders("megatron", lambda root: _holds_files(root, ".py")),
        "folders under tests/":
            [path for path in _folders("tests", lambda root: True) if path != "tests"],
        "folders under tools/":
            [path for path in _folders("tools", lambda root: True) if path != "tools"],
        "top-level entries tracked by git": _tracked_top_level(),
    }
    assert required["package folders under megatron/ (holding .py files)"], \
        "found no package folder under megatron/"
    missing = [f"{what}: {', '.join(path for path in paths if path not in listed)}"
               for what, paths in required.items()
               if any(path not in listed for path in paths)]
    assert not missing, ("the README's Layout code block does not list these (add a line "
                         "with a few words each):\n" + "\n".join(missing))


# ---------------------------------------------------------------------------------------------
# (d) relative links in README.md and docs/*.md
# ---------------------------------------------------------------------------------------------

INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
EXTERNAL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # http:, https:, mailto:, ...


def _without_code(text):
    """Markdown without fenced code blocks and inline code (same line count)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$",
                  lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def links(path):
    """(line number, target) of every link in a markdown file."""
    text = _without_code(_read(path))
    found = []
    for pattern in (INLINE_LINK, REFERENCE_LINK):
        for match in pattern.finditer(text):
            found.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return sorted(found)


def _local_links():
    for path in _markdown_files():
        for line, target in links(path):
            if EXTERNAL.match(target):
                continue
            yield path, line, target


def test_links_parse_as_expected():
    text = ("[a](b.md) ![img](figs/x.png \"title\") [ext](https://x.org/y) `[no](code.md)`\n"
            "```\n[no](block.md)\n```\n[r]: ref.md#part\n")
    found = []
    plain = _without_code(text)
    for pattern in (INLINE_LINK, REFERENCE_LINK):
        found += [m.group(1) for m in pattern.finditer(plain)]
    assert sorted(found) == sorted(["b.md", "figs/x.png", "https://x.org/y", "ref.md#part"])


def test_every_relative_link_points_to_an_existing_file():
    broken = []
    for path, line, target in _local_links():
        file_part = target.split("#", 1)[0]
        if not file_part:  # a pure #anchor
            continue
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
        if not os.path.exists(resolved):
            broken.append(f"{_rel(path)}:{line}: ({target}) -> {_rel(resolved)} does not exist")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def github_anchors(path):
    """The anchors GitHub gives the headings of a markdown file."""
    anchors, seen = set(), {}
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", _read(path), flags=re.M | re.S)
    for match in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", text, re.M):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # links: their text
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_github_anchors(tmp_path):
    sample = tmp_path / "sample.md"
    sample.write_text("# Training (pretrain_gpt.py)\n## Capture rules (--tensor-save-config)\n"
                      "## Notes\n## Notes\n### `--quant-stats-interval N` and [a link](x.md)\n"
                      "```\n# not a heading\n```\n", encoding="utf-8")
    assert github_anchors(str(sample)) == {
        "training-pretrain_gptpy", "capture-rules---tensor-save-config", "notes", "notes-1",
        "--quant-stats-interval-n-and-a-link"}


def test_every_link_anchor_names_a_heading():
    broken = []
    for path, line, target in _local_links():
        if "#" not in target:
            continue
        file_part, anchor = target.split("#", 1)
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
            if file_part else path
        if not resolved.endswith(".md") or not os.path.exists(resolved):
            continue  # a missing file is the test above's failure
        if anchor.lower() not in github_anchors(resolved):
            broken.append(f"{_rel(path)}:{line}: ({target}) -> {_rel(resolved)} has no "
                          f"heading #{anchor}")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(broken)


PITFALL_TAG = re.compile(r"\bP(\d{1,2})\b")


def _pitfall_entries():
    text = open(os.path.join(REPO_ROOT, "docs", "pitfalls.md"), encoding="utf-8").read()
    return {int(n) for n in re.findall(r"^## P(\d+) — ", text, flags=re.M)}


def test_every_pitfall_tag_has_an_entry_in_docs_pitfalls():
    """The `Pn` tags the formats code and tests use resolve to docs/pitfalls.md."""
    entries = _pitfall_entries()
    assert entries == set(range(1, 19)), sorted(entries)
    missing = []
    for root in ("megatron", "tests"):
        for path in glob.glob(os.path.join(REPO_ROOT, root, "**", "*.py"), recursive=True):
            for number, line in ((int(m.group(1)), i) for i, text in
                                 enumerate(open(path, encoding="utf-8"), 1)
                                 for m in PITFALL_TAG.finditer(text)):
                if number not in entries:
                    missing.append(f"{os.path.relpath(path, REPO_ROOT)}:{line} P{number}")
    assert not missing, "pitfall tags without an entry in docs/pitfalls.md: " + ", ".join(missing)


def test_the_quantization_docs_name_every_quantization_flag():
    """Every flag megatron/quantization/config.py generates is explained in
    docs/quantization.md's table."""
    from megatron.quantization.config import flag_names

    text = open(os.path.join(REPO_ROOT, "docs", "quantization.md"), encoding="utf-8").read()
    missing = [flag for flag in flag_names() if f"`{flag}" not in text]
    assert not missing, f"flags missing from docs/quantization.md: {missing}"
