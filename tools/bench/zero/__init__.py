# SPDX-License-Identifier: Apache-2.0
"""stepforge.zero's data-parallel schemes and its parameter gather on gloo ranks."""
