"""The documents checked against the code (issue 48 item 1).

What a document quotes from pocketllm.py is read from the document and compared with the code, as
test_fields.py does for the field tables: every "section N" reference names something defined in that
section, the start-up log lines the documents quote are what a real start-up prints, the flag defaults written
in prose are the parser's, and the bundled model's generation_config.json is what docs/pocket-tiny.md says.
"""

import ast
import bisect
import contextlib
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import pocketllm  # noqa: E402

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCE = (ROOT / "pocketllm.py").read_text()
SECTION_REF = re.compile(r"section (\d+[a-c]?)\b")
CODE_NAME = re.compile(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`")      # `name`, `Class.method`, `call(args)`


def sections() -> tuple[list[int], list[str]]:
    """The first line of each section banner of pocketllm.py, and its number ('3b')."""
    lines, starts, numbers = SOURCE.splitlines(), [], []
    for i, line in enumerate(lines):
        m = re.match(r"# (\d+[a-c]?)\. ", line)
        if m and i and lines[i - 1].startswith("# ----"):
            starts.append(i + 1)
            numbers.append(m[1])
    return starts, numbers


def definitions() -> dict[str, int]:
    """Module-level names and Class.method -> the line defining them."""
    defs = {}
    for node in ast.parse(SOURCE).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node.lineno
            for sub in node.body if isinstance(node, ast.ClassDef) else ():
                if isinstance(sub, ast.FunctionDef):
                    defs[f"{node.name}.{sub.name}"] = sub.lineno
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    defs.setdefault(target.id, node.lineno)
    return defs


def section_references():
    """(document, referenced section, the nearest `name` defined in pocketllm.py, its section) per reference;
    the name is searched in the same paragraph, at most 150 characters before or 100 after."""
    starts, numbers = sections()
    defs = definitions()
    for doc in DOCS:
        text = doc.read_text()
        for m in SECTION_REF.finditer(text):
            lo = max(text.rfind("\n\n", 0, m.start()), m.start() - 150)
            end = text.find("\n\n", m.end())
            hi = min(m.end() + 100, end if end >= 0 else len(text))
            near = []
            for n in CODE_NAME.finditer(text, lo, hi):
                name = n[1] if n[1] in defs else n[1].split(".")[0]      # Class.attribute: the class
                if name in defs:
                    section = numbers[bisect.bisect_right(starts, defs[name]) - 1]
                    near.append((abs(n.start() - m.start()), n[1], section))
            yield doc.name, m[1], min(near) if near else None


def test_section_references_name_what_the_section_defines():
    refs = list(section_references())
    assert len(refs) >= 20, refs                       # the documents do refer to sections
    wrong = [(doc, section, near) for doc, section, near in refs if near is None or near[2] != section]
    assert not wrong, "each 'section N' needs a `name` it defines nearby: " + repr(wrong)


def test_the_module_map_lists_every_section():
    """The docstring's map and docs/architecture.md's block table name every banner's section."""
    _, numbers = sections()
    top = pocketllm.__doc__
    table = (ROOT / "docs" / "architecture.md").read_text().split("\n## ")[0]
    for number in numbers:
        assert re.search(rf"(^|[\s;]){number}[ .]", top), number
        assert re.search(rf"[|,] {number} ", table), number


def test_the_module_maps_feature_index_names_each_steps_section():
    """The docstring's index of speculative decoding, the prefix cache and async scheduling: each 'N name' is
    defined in section N."""
    starts, numbers = sections()
    defs = definitions()
    index = pocketllm.__doc__.split("Three features cross sections")[1]
    steps = re.findall(r"(?<![\w.(+] )(?<![\w.(+])(\d+[a-c]?)\s+([A-Za-z]\w*[._]\w+)", index)   # not 'K + 1 positions'
    assert len(steps) >= 15, steps
    for section, name in steps:
        assert name in defs, name
        assert numbers[bisect.bisect_right(starts, defs[name]) - 1] == section, (section, name)


# -----------------------------------------------------------------------------------------------
# Quoted log lines: the start-up lines the documents quote, against a real start-up on pocket-tiny.
# -----------------------------------------------------------------------------------------------

LOGGED = ("memory per ", "pocketllm: generation defaults: ", "warm-up: ")


def quoted_log_lines() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            if span.startswith(LOGGED):
                out.append((doc.name, span))
    return out


def as_pattern(quoted: str) -> re.Pattern:
    """'...' and N stand for what varies."""
    parts = re.split(r"(\.\.\.|\bN\b)", quoted.removeprefix("pocketllm: "))
    return re.compile("".join(".*" if p in ("...", "N") else re.escape(p) for p in parts))


def test_quoted_log_lines_are_what_start_up_prints():
    quoted = quoted_log_lines()
    assert {span.split(":")[0] for _, span in quoted} >= {"memory per device (config estimate, docs/serving.md)",
                                                           "pocketllm", "warm-up"}, quoted
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        llm = pocketllm.LLM(max_context=256, max_batch_size=2, speculative_tokens=0)
        try:
            pocketllm._log(llm.options, llm.warm_up())
        finally:
            llm.close()
    printed = [line.removeprefix("pocketllm: ") for line in err.getvalue().splitlines()]
    for doc, span in quoted:
        assert any(as_pattern(span).fullmatch(line) for line in printed), (doc, span, printed)


def test_the_abi_version_the_documents_give_is_the_librarys():
    header = (ROOT / "csrc" / "pocketllm.h").read_text()
    version = int(re.search(r"#define PL_ABI_VERSION (\d+)", header)[1])
    assert version == pocketllm.NATIVE_ABI_VERSION
    said = [(doc.name, int(n)) for doc in DOCS for n in
            re.findall(r"\(currently (\d+)\)|\(ABI (\d+)\)|version[^.\n]{0,30}?\b(?:stays|is) (\d+)", doc.read_text())
            for n in [next(g for g in n if g)]]
    assert len(said) >= 4 and all(n == version for _, n in said), said


def test_native_fusion_defaults_are_what_architecture_md_says():
    """Which fusions ship off (NativeOps' thresholds at 0 / False) and that glu_tokens is on at one token."""
    text = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    init = dict(re.findall(r"self\.(prologue_tokens|glu_tokens|mlp_tokens|merged_attention) = (\w+)", SOURCE))
    assert init == {"prologue_tokens": "0", "glu_tokens": "1", "mlp_tokens": "0", "merged_attention": "False"}, init
    assert ("turn three fusions off where an H200 measured them slower (`NativeOps.prologue_tokens`, `mlp_tokens`, "
            "`merged_attention`; `glu_tokens` is on at one token)") in text


# -----------------------------------------------------------------------------------------------
# Defaults written in prose.
# -----------------------------------------------------------------------------------------------

FLAG_DEFAULT = re.compile(r"`(--[a-z-]+)[^`]*`[^`(\n]{0,40}\(default:? ([\w.]+)[,)]")


def test_flag_defaults_in_prose_are_the_parsers():
    defaults = {name: action.default for action in pocketllm.command_line_parser()._actions
                for name in action.option_strings}
    found = []
    for doc in DOCS:
        for flag, value in FLAG_DEFAULT.findall(doc.read_text()):
            if flag in defaults:
                found.append((doc.name, flag, value))
                assert value == str(defaults[flag]), (doc.name, flag, value, defaults[flag])
    assert found                                            # the pattern still finds flag defaults in prose
    assert pocketllm.EngineOptions(device="cuda").speculative_tokens == pocketllm.GPU_SPECULATIVE_TOKENS == 2
    assert pocketllm.EngineOptions(device="cpu").speculative_tokens == 0


def test_pocket_tiny_generation_config_is_what_the_doc_says():
    row = next(line for line in (ROOT / "docs" / "pocket-tiny.md").read_text().splitlines()
               if line.startswith("| `generation_config.json` |"))
    config = json.loads((pocketllm.DEFAULT_CKPT / "generation_config.json").read_text())
    assert set(re.findall(r"`(\w+): ", row)) == set(config), row
    for key, value in config.items():
        if not isinstance(value, list):
            assert f"`{key}: {json.dumps(value)}`" in row or key == "pad_token_id", (key, value)


def test_pocket_tiny_files_are_in_the_docs_table():
    text = (ROOT / "docs" / "pocket-tiny.md").read_text()
    for path in pocketllm.DEFAULT_CKPT.iterdir():
        assert f"| `{path.name}` |" in text, path.name


# -----------------------------------------------------------------------------------------------
# Tables the code renders: the engine options and flags, vLLM's flags that pocketllm answers.
# -----------------------------------------------------------------------------------------------

API_DOC = ROOT / "docs" / "api.md"
TABLES = re.compile(r"(<!-- table: ([\w -]+) -->\n)(.*?)(<!-- end table -->)", re.S)


def render_tables(text: str) -> str:
    return TABLES.sub(lambda m: m[1] + pocketllm.DOC_TABLES[m[2]]() + "\n" + m[4], text)


def test_docs_are_what_the_engine_options_render():
    text = API_DOC.read_text()
    assert sorted(m[2] for m in TABLES.finditer(text)) == sorted(pocketllm.DOC_TABLES)
    assert render_tables(text) == text, "docs/api.md is stale: run `python tests/test_docs.py`"


def test_help_is_the_options_own():
    """--help says what the option's row says, with its default."""
    import dataclasses
    text = "".join(pocketllm.command_line_parser().format_help().split())    # wrapped at spaces and hyphens
    for f in dataclasses.fields(pocketllm.EngineOptions):
        assert "".join(f.metadata["help"].replace("`", "").split()) in text, f.name


if __name__ == "__main__":
    API_DOC.write_text(render_tables(API_DOC.read_text()))
