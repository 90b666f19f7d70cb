"""pocketllm.py reads top to bottom: one import block, every module-level name defined above its first use
(the two self-referring tables excepted, each for a stated reason), section banners in the order the header's
map gives them."""

import ast
import re
from pathlib import Path

import pocketllm

SOURCE = Path(pocketllm.__file__).read_text(encoding="utf-8")
TREE = ast.parse(SOURCE)
# A table that cannot precede what it lists: SamplingParams.validate reads the rows built from its own fields,
# and /openapi.json's endpoint lists the route table that routes to it.
SELF_REFERRING = {"SAMPLING_FIELDS", "ROUTES"}


def top_level_definitions() -> dict[str, int]:
    defined = {}
    for node in TREE.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [(a.asname or a.name).split(".")[0] for a in node.names]
        else:
            names = []
        for name in names:
            defined.setdefault(name, node.lineno)
    return defined


def test_one_import_block_at_the_top():
    imports = [i for i, node in enumerate(TREE.body) if isinstance(node, (ast.Import, ast.ImportFrom))
               and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    assert imports == list(range(imports[0], imports[-1] + 1)), "an import statement after the top block"


def test_every_name_is_defined_above_its_first_use():
    defined = top_level_definitions()
    late = set()
    for node in TREE.body:
        local = {a.arg for sub in ast.walk(node) if isinstance(sub, ast.arguments)
                 for a in sub.args + sub.kwonlyargs + sub.posonlyargs}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in defined and sub.id not in local \
                    and sub.lineno < defined[sub.id] and not node.lineno <= defined[sub.id] <= node.end_lineno:
                late.add(sub.id)
    assert late == SELF_REFERRING, f"used above their definition: {sorted(late - SELF_REFERRING)}"


def test_section_banners_follow_the_map():
    mapped = re.findall(r"^ {4,5}(\d+)\. ", pocketllm.__doc__, flags=re.M)
    banners = re.findall(r"^# (\d+)[a-z]?\. ", SOURCE, flags=re.M)
    assert [int(n) for n in mapped] == list(range(15))
    assert [int(n) for n in dict.fromkeys(banners)] == list(range(15)), banners
    assert not re.search(r"^# =+ SECTION", SOURCE, flags=re.M)     # one banner per section, no second one
