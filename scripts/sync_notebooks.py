"""Write the Colab note and install cell (defined once, in `kit.ui.notebooks`) into every notebook.

    python scripts/sync_notebooks.py           # rewrite the notebooks that differ
    python scripts/sync_notebooks.py --check   # only list them; exit 1 when any differs

Run it after changing `COLAB_NOTE` or `COLAB_INSTALL`; `tests/test_notebook_colab.py` fails
until every notebook matches.
"""

from __future__ import annotations

import argparse
import sys

from kit.ui.notebooks import sync_colab_cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 on a difference"
    )
    args = parser.parse_args(argv)
    changed = sync_colab_cells(write=not args.check)
    verb = "differ" if args.check else "rewritten"
    print(f"{verb}: {', '.join(changed)}" if changed else "every notebook matches")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
