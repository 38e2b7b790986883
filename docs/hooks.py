# SPDX-License-Identifier: Apache-2.0
"""MkDocs hooks.

- Serve the committed benchmark plots (benchmarks/results/<topic>/*.png) as results/<topic>/<name>.png: the plots
  stay where the benchmarks write them; nothing is copied into docs/.
- The docstrings use Sphinx cross-reference roles (``:class:`~stepforge.fused.FusedAdam` ``), which the
  Markdown renderer leaves as literal text before the code span: drop the role, and a ``~``-shortened path keeps
  only its last component, as Sphinx shows it.
"""

from __future__ import annotations

import pathlib
import re

from mkdocs.structure.files import File, Files

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results"
_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj):<code>(~?)([^<]*)</code>")


def _unrole(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"<code>{target}</code>"


def on_files(files: Files, config) -> Files:
    for png in sorted(RESULTS.rglob("*.png")):
        files.append(
            File.generated(config, f"results/{png.relative_to(RESULTS).as_posix()}", abs_src_path=str(png))
        )
    return files


def on_page_content(html: str, **kwargs: object) -> str:
    return _ROLE.sub(_unrole, html)
