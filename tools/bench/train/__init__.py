# SPDX-License-Identifier: Apache-2.0
"""End to end: the demo GPT trained by a plain torch loop and by Strategy with each plugin."""
