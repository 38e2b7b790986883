# SPDX-License-Identifier: Apache-2.0
"""One-off measurements behind a single decision (a before/after check, a probe); kept to re-run, not maintained
as benches."""
