"""Build the API reference (HTML, from the docstrings) with pdoc, and fail on a broken one.

    python scripts/api_docs.py docs/api          # what `make docs` runs; open docs/api/index.html
    python scripts/api_docs.py --check-only      # the docstring checks without writing HTML

Fails (exit 1) when a public module does not import (keras_lms.horovod needs Horovod installed), when pdoc
warns while reading a docstring or signature, or when a documented entry point (`API` below) lacks a section
of the Keras docstring standard: `Args:` (if it takes arguments), `Returns:` (functions), `Raises:` (if it
raises), `Example:` with a fenced ```python block, and markdown backticks rather than reStructuredText roles.
tests/test_api_docs.py runs this script and every `Example:` block.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pathlib
import re
import sys
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pdoc adds the public submodules of a package (keras_lms.callbacks, keras_lms.planning, ...) by itself.
MODULES = ["keras_lms", "keras_lms.config", "keras_lms.horovod"]
# The documented entry points: "module:qualname", and which sections they must have.
API = {
    "keras_lms:wrap": ("Args", "Returns", "Raises", "Example"),
    "keras_lms:unwrap": ("Args", "Returns", "Raises", "Example"),
    "keras_lms:LMSModel": ("Args", "Raises", "Example"),
    "keras_lms:LMSConfig": ("Args", "Raises", "Example"),
    "keras_lms:report": ("Args", "Returns", "Raises", "Example"),
    "keras_lms:ActivationReport": ("Args", "Example"),
    "keras_lms:largest_input": ("Args", "Returns", "Raises", "Example"),
    "keras_lms:LargestInput": ("Args", "Example"),
    "keras_lms:DeviceProfile": ("Args", "Raises", "Example"),
    "keras_lms:MemoryHighWaterMark": ("Args", "Raises", "Example"),
    "keras_lms:BackupAndRestore": ("Args", "Raises", "Example"),
    "keras_lms.horovod:init": ("Args", "Returns", "Raises", "Example"),
    "keras_lms.horovod:DistributedOptimizer": ("Args", "Returns", "Raises", "Example"),
    "keras_lms.horovod.elastic:run": ("Args", "Returns", "Raises", "Example"),
    "keras_lms.horovod.elastic:KerasState": ("Args", "Returns", "Raises", "Example"),
}
EXAMPLE_RE = re.compile(r"^Example:\n\n```python\n(.*?)^```", re.S | re.M)
RST_RE = re.compile(r":(func|class|meth|mod|attr):`|(?<!`)``(?!`)")


def resolve(target: str):
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def examples(target: str) -> list[str]:
    """The code of the ```python blocks under `Example:` in `target`'s docstring."""
    return EXAMPLE_RE.findall(inspect.getdoc(resolve(target)) or "")


def check_docstrings() -> list[str]:
    problems = []
    for target, sections in API.items():
        doc = inspect.getdoc(resolve(target)) or ""
        if not doc:
            problems.append(f"{target}: no docstring")
            continue
        for section in sections:
            if not re.search(rf"^{section}:$", doc, re.M):
                problems.append(f"{target}: no '{section}:' section")
        if "Example" in sections and not examples(target):
            problems.append(f"{target}: 'Example:' has no ```python block")
        if RST_RE.search(doc):
            problems.append(f"{target}: reStructuredText markup (``code`` or :role:`...`); use markdown `code`")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="docs/api", help="output directory (default docs/api)")
    parser.add_argument("--check-only", action="store_true", help="check the docstrings, write no HTML")
    args = parser.parse_args(argv)

    for name in MODULES:
        importlib.import_module(name)  # an import error fails here, with its traceback
    problems = check_docstrings()
    if not args.check_only:
        import pdoc
        import pdoc.render

        pdoc.render.configure(docformat="google", search=True, show_source=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pdoc.pdoc(*MODULES, output_directory=pathlib.Path(args.out))
        problems += [f"pdoc: {w.category.__name__}: {w.message}" for w in caught
                     if "pdoc" in (w.filename or "") or "keras_lms" in str(w.message)]
    for problem in problems:
        print(f"api_docs: {problem}", file=sys.stderr)
    if problems:
        return 1
    print("api_docs: docstrings complete" + ("" if args.check_only else f"; API reference in {args.out}/index.html"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
