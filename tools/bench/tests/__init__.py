# SPDX-License-Identifier: Apache-2.0
"""Tests of the benches and their runner (``nox -s bench_smoke`` runs them)."""
