# SPDX-License-Identifier: Apache-2.0
"""stepforge's benchmarks, one topic folder each (README.md lists them). A script is run by its path; its first
import line puts ``tools/`` on ``sys.path`` so that its parts import as ``bench.<folder>._<part>``."""
