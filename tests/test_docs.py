"""The README and docs/ say what the code does: every `ggtrain` command they show parses (the
commands of ```bash blocks as the command line would parse them; those quoted in the text by
their command and option names), the families table is the registry's, links point at files
of the repository, and nothing points outside it."""
import pathlib
import re
import shlex

import pytest

from ggtrain.cli import families
from ggtrain.cli.main import _command, _register
from ggtrain.cli.options import canonical

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

_register()
APP = _command()


def _bash_commands(text: str) -> list:
    """argv lists of the `ggtrain` commands in the text's ```bash blocks (here-documents and
    comments skipped, `\\` continuations joined, `&&` chains split, `mpiexec ... ggtrain` and
    `.venv/bin/ggtrain` taken as ggtrain)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines, heredoc = [], None
        for line in block.replace("\\\n", " ").splitlines():
            if heredoc is not None:
                heredoc = None if line.strip() == heredoc else heredoc
                continue
            m = re.search(r"<<\s*'?(\w+)'?", line)
            if m:
                heredoc = m.group(1)
            lines.append(line)
        for line in lines:
            words = shlex.split(line, comments=True)
            chain, part = [], []
            for w in words + ["&&"]:
                if w == "&&":
                    chain.append(part)
                    part = []
                else:
                    part.append(w)
            for part in chain:
                at = [i for i, w in enumerate(part) if w == "ggtrain" or w.endswith("/ggtrain")]
                if at:
                    out.append(part[at[0] + 1:])
    return out


def _inline_commands(text: str) -> list:
    """The `ggtrain ...` spans of the running text (outside code blocks)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [span for span in re.findall(r"`(ggtrain [^`]*)`", prose)]


def _resolve(argv: list):
    """(click command, the rest of argv) for a ggtrain argv: its (sub)command looked up."""
    cmd, rest = APP, list(argv)
    while getattr(cmd, "commands", None) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        assert name in cmd.commands, f"no command {name!r} in {' '.join(argv)}"
        cmd = cmd.commands[name]
    return cmd, rest


def _option_names(cmd) -> set:
    names = {"--help"}
    for p in cmd.params:
        names.update(getattr(p, "opts", ()))
        names.update(getattr(p, "secondary_opts", ()))
    return names


BASH = [(page.name, argv) for page in PAGES for argv in _bash_commands(page.read_text())]
INLINE = [(page.name, span) for page in PAGES for span in _inline_commands(page.read_text())]


def test_the_pages_show_commands():
    """The extraction finds what it must (else the tests below would pass on nothing)."""
    readme = [argv for page, argv in BASH if page == "README.md"]
    assert ["train", "--out", "model.gguf"] in readme
    assert any(argv[:1] == ["finetune"] for argv in readme)
    assert len(BASH) >= 15 and len(INLINE) >= 20


@pytest.mark.parametrize("page, argv", BASH, ids=[f"{p}: {' '.join(a)[:60]}" for p, a in BASH])
def test_every_shown_command_parses(page, argv):
    cmd, rest = _resolve(canonical(argv))
    assert not getattr(cmd, "commands", None), f"{page}: `ggtrain {' '.join(argv)}` names no command"
    ctx = cmd.make_context(cmd.name, rest)        # raises on an unknown option, a bad value,
    assert ctx.params is not None                 # a missing argument or option


@pytest.mark.parametrize("page, span", INLINE, ids=[f"{p}: {s[:60]}" for p, s in INLINE])
def test_every_quoted_command_names_real_options(page, span):
    assert "…" not in span, f"{page}: {span}"
    words = span.split()[1:]
    if not words or words[0].startswith("<"):
        return                                       # `ggtrain <command> --help`: no command named
    cmd, rest = _resolve(canonical([w.split("=")[0] for w in words if not w.startswith("[")]))
    for w in rest:
        name = w.strip("[]").split("=")[0]
        if name.startswith("-") and not re.fullmatch(r"-\d.*", name):
            assert name in _option_names(cmd), f"{page}: `{span}`: {cmd.name} has no option {name}"


def test_families_table_is_the_registrys():
    text = (ROOT / "README.md").read_text()
    start, end = text.index(families.BEGIN), text.index(families.END) + len(families.END)
    assert text[start:end] == families.markdown(), "run `python -m ggtrain.cli.families` and paste its table"
    for arch in families.FAMILIES:
        assert f"| `{arch}` |" in text


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_pages_point_inside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text and "/work/" not in text
    assert not re.search(r"\blease", text, re.I)
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not re.match(r"\w+://", target):
            assert (page.parent / target).exists(), f"{page.name}: link to {target}, which is not there"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert "python -m pytest -q" in "\n".join(lines)


def test_help_panels_mentioned_in_docs_exist():
    """The docs send users to --help's panels for details: every training command has them."""
    for path in (("train",), ("finetune",), ("mnist", "train")):
        cmd, _ = _resolve(list(path))
        panels = {getattr(p, "rich_help_panel", None) for p in cmd.params} - {None}
        assert len(panels) >= 4, (path, panels)

