"""Print the summary of a finished segmentation run (what the example prints at its end) from its summary.json.

    python examples/summary.py runs/demo                 # or runs/demo/summary.json
"""

import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if __package__:  # python -m examples.summary (or imported as examples.summary)
    from .artefacts import print_summary
else:  # python examples/summary.py: examples/ is on sys.path
    from artefacts import print_summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the example's --out directory, or its summary.json")
    path = pathlib.Path(parser.parse_args(argv).run)
    if path.is_dir():
        path = path / "summary.json"
    if not path.is_file():
        print(f"summary: no {path}: the run did not finish (rank 0 writes summary.json at the end)", file=sys.stderr)
        return 1
    print_summary(json.loads(path.read_text()), path.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
