# SPDX-License-Identifier: Apache-2.0
"""MkDocs hook: serve the committed benchmark plots (benchmarks/results/*.png) as results/<name>.png.

The plots stay where the benchmarks write them; nothing is copied into docs/.
"""

from __future__ import annotations

import pathlib

from mkdocs.structure.files import File, Files

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def on_files(files: Files, config) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files
