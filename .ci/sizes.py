"""Sizes in sight (a report, not a gate): lines per Python file of the package, and the files
over 600 lines and functions over 100 that STYLE.md asks to look at again ("past ~600 lines or
a function past ~100, stop and ask what the second job is")."""
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("ggtrain", "cli", "core", "formats", "native")
FILE_LINES, FUNCTION_LINES = 600, 100


def main() -> None:
    rows, long_functions = [], []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "build" in path.parts or path.name.startswith("_"):
                continue
            text = path.read_text()
            rows.append((len(text.splitlines()), path.relative_to(ROOT)))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > FUNCTION_LINES:
                        long_functions.append((n, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    total = sum(n for n, _ in rows)
    print(f"sizes: {len(rows)} Python files, {total} lines; largest:", file=sys.stderr)
    for n, path in sorted(rows, reverse=True)[:12]:
        print(f"  {n:6d}  {path}{'  (over %d)' % FILE_LINES if n > FILE_LINES else ''}", file=sys.stderr)
    for n, where in sorted(long_functions, reverse=True):
        print(f"  function of {n} lines (over {FUNCTION_LINES}): {where}", file=sys.stderr)


if __name__ == "__main__":
    main()
